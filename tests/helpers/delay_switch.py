"""A delay switch: an Ethernet switch in one process that hands every frame on D ms late.

`Lab(delay_ms=D)` (tests/helpers/netns.py) gives each host a TAP device instead of a veth
on a bridge and sends the TAP's file descriptor here; the device itself lives in
the host's namespace, this process holds the other end:

    host a: tap ─fd─┐                                   ┌─fd─ tap :host b
                    │ read frame, learn its source MAC, │
    host c: tap ─fd─┤ queue it for the destination's    ├─fd─ ...
                    │ port, due = arrival + D;          │
                    └ write it when due ────────────────┘

Every frame between two hosts crosses the switch exactly once, so a round trip
takes 2 x D more than without it, whatever the protocol (TCP, QUIC over UDP,
ARP). The delay is constant, so due times only grow on each output port: a FIFO
per port is already sorted by due time and keeps each link's order. Frames to an
unknown or a group MAC go to every other port.

The loop waits in select() (microsecond timeouts, where poll/epoll round up to
a millisecond) for a readable TAP or the next due frame, with a 1 µs timer
slack and a higher CPU priority than the hosts' processes, as the kernel's
own forwarding runs in softirq ahead of them. A wait longer than 1 ms ends in
a second one of 0.5 ms: on this VM a 5 ms sleep wakes ~0.11 ms late, a 0.5 ms
one ~0.03 ms. How late frames leave (send time
minus due time) is kept in a histogram; on exit (SIGTERM, or the lab's control
socket closing) it writes its counters as JSON to --stats.

Control: the lab passes a SOCK_SEQPACKET socket (--control-fd); each message is
a port name with one TAP fd attached (SCM_RIGHTS), answered with b"ok" once the
port is in use. Run by the lab as ``python -m tests.helpers.delay_switch --delay-ms D
--control-fd N --stats PATH``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import socket
import sys
import time
from collections import deque

READ_BYTES = 65536  # more than any frame at the TAP's MTU
READ_BATCH_FRAMES = 64  # per TAP per wake-up, so one busy host cannot starve the others
MAX_QUEUE_BYTES = 32 * 1024 * 1024  # per output port; past it, drop-tail (counted)
PORT_NAME_MAX_BYTES = 64
LATENESS_BUCKET_US = 10
LATENESS_BUCKETS = 10_000  # 10 µs buckets up to 100 ms; later frames land in the last one
PR_SET_TIMERSLACK = 29
TIMER_SLACK_NS = 1_000
SWITCH_NICE = -10
SHORT_WAIT_S = 0.0005


class Port:
    """One TAP: its fd and the frames waiting to be written to it."""

    def __init__(self, name: str, fd: int) -> None:
        self.name, self.fd = name, fd
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued_bytes = 0
        self.frames_in = self.bytes_in = self.frames_out = self.bytes_out = self.dropped = 0


class Switch:
    """MAC learning, per-port delay queues, lateness figures. `run()` does the I/O."""

    def __init__(self, control: socket.socket, delay_s: float) -> None:
        self.control, self.delay_s = control, delay_s
        self.ports: dict[int, Port] = {}
        self.by_mac: dict[bytes, Port] = {}
        self.lateness = [0] * LATENESS_BUCKETS
        self.lateness_max_s = 0.0
        self.max_queue_bytes = 0

    def run(self) -> None:
        while True:
            now = time.monotonic()
            next_due = self._flush(now)
            timeout = None
            if next_due is not None:
                wait = next_due - time.monotonic()
                # Long sleeps in a VM wake ~0.1 ms late, short ones ~0.03 ms: end a long wait with a short one.
                timeout = wait - SHORT_WAIT_S if wait > 2 * SHORT_WAIT_S else max(0.0, wait)
            readable, _, _ = select.select([self.control.fileno(), *self.ports], [], [], timeout)
            if not readable:
                continue
            now = time.monotonic()
            for fd in readable:
                if fd == self.control.fileno():
                    if not self._take_port():
                        return  # the lab is gone: so are we
                else:
                    self._read(self.ports[fd], now)

    def _take_port(self) -> bool:
        message, fds, _, _ = socket.recv_fds(self.control, PORT_NAME_MAX_BYTES, 1)
        if not message:
            return False
        for fd in fds:
            os.set_blocking(fd, False)
            self.ports[fd] = Port(message.decode(), fd)
        self.control.send(b"ok")
        return True

    def _read(self, port: Port, now: float) -> None:
        due = now + self.delay_s
        for _ in range(READ_BATCH_FRAMES):
            try:
                frame = os.read(port.fd, READ_BYTES)
            except BlockingIOError:
                return
            port.frames_in += 1
            port.bytes_in += len(frame)
            if len(frame) < 14:
                continue
            self.by_mac[frame[6:12]] = port
            out = None if frame[0] & 1 else self.by_mac.get(frame[0:6])
            for target in (out,) if out is not None else self.ports.values():
                if target is port:
                    continue
                if target.queued_bytes + len(frame) > MAX_QUEUE_BYTES:
                    target.dropped += 1
                    continue
                target.queue.append((due, frame))
                target.queued_bytes += len(frame)
                self.max_queue_bytes = max(self.max_queue_bytes, target.queued_bytes)

    def _flush(self, now: float) -> float | None:
        """Write every frame due by `now`; return the next due time, if any."""
        next_due = None
        for port in self.ports.values():
            queue = port.queue
            while queue and queue[0][0] <= now:
                due, frame = queue.popleft()
                port.queued_bytes -= len(frame)
                try:
                    os.write(port.fd, frame)
                except OSError:  # the host's device is down or gone: the frame is lost, as on a wire
                    port.dropped += 1
                    continue
                port.frames_out += 1
                port.bytes_out += len(frame)
                late = now - due
                self.lateness[min(int(late * 1e6) // LATENESS_BUCKET_US, LATENESS_BUCKETS - 1)] += 1
                self.lateness_max_s = max(self.lateness_max_s, late)
            if queue and (next_due is None or queue[0][0] < next_due):
                next_due = queue[0][0]
        return next_due

    def stats(self) -> dict:
        """Counters per port, and how late frames left (percentiles to 10 µs, and the maximum)."""
        total = sum(self.lateness)

        def percentile(p: float) -> float | None:
            if not total:
                return None
            seen = 0
            for bucket, count in enumerate(self.lateness):
                seen += count
                if seen >= p * total:  # the bucket's upper edge, never past the true maximum
                    return min((bucket + 1) * LATENESS_BUCKET_US / 1000, self.lateness_max_s * 1000)
            return None

        cpu = os.times()
        return {
            "delay_ms": self.delay_s * 1000,
            "frames_out": total,
            "late_ms": {"p50": percentile(0.5), "p99": percentile(0.99), "p999": percentile(0.999),
                        "max": self.lateness_max_s * 1000},
            "max_queue_bytes": self.max_queue_bytes,
            "cpu_s": cpu.user + cpu.system,
            "ports": {p.name: {"frames_in": p.frames_in, "bytes_in": p.bytes_in, "frames_out": p.frames_out,
                               "bytes_out": p.bytes_out, "dropped": p.dropped} for p in self.ports.values()},
        }


def _terminate(signum, frame) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.delay_switch", description=__doc__.split("\n")[0])
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every frame")
    parser.add_argument("--control-fd", type=int, required=True, help="SOCK_SEQPACKET socket from the lab")
    parser.add_argument("--stats", help="write counters here as JSON on exit")
    args = parser.parse_args(argv)

    # A late wake-up is added delay: ask for tight timers and to run ahead of the hosts' processes.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, SWITCH_NICE)
    except PermissionError:
        pass
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    switch = Switch(socket.socket(fileno=args.control_fd), args.delay_ms / 1000)
    try:
        switch.run()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second stop request must not cut the write short
        if args.stats:
            with open(args.stats + ".partial", "w") as f:
                json.dump(switch.stats(), f)
            os.replace(args.stats + ".partial", args.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
