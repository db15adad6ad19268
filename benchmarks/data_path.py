"""The native data path's own cost: round trips and bulk through two relays vs. plain TCP, one run.

    client --TCP--> relay A ==TLS 1.3 over TCP==> relay B --TCP--> target      (the tunnel)
    client --TCP------------------------------------------------> target      (direct)

Every party is its own process: the target (an echo or byte counter, ``--role target``), the two
``mesh-data-relay`` processes (started and told by the real ``net/data_relay.DataRelay``, as a
node's sidecar does), and the client (this process). The target's first byte picks its mode
("E": echo, "S": count to EOF and answer the count); it is no RPC HELLO, so the relays' RPC
watch passes the stream untouched.

- round trip: ``--round-trips`` ping-pongs of 64 bytes on one connection (TCP_NODELAY) after a
  warm-up; p50 and p99 in microseconds, direct and tunnel, and the tunnel's added time; and the two
  relays' own CPU per round trip (/proc): the rest of the added time is waiting to be scheduled;
- bulk: ``--bulk-mb`` MB one way, ``--reps`` times; Gbit/s from the first byte sent to the
  target's count coming back (every byte arrived).

With ``--cpu N`` every process runs on CPU N alone: no wake-up crosses cores (on a virtual machine
each such wake-up costs tens of microseconds, direct TCP's own included), so the added time left is
the relays' own work. With ``--host-cpus A,B`` the client and relay A run on CPU A, relay B and
the target on CPU B: two one-CPU hosts, where only the hop between hosts crosses cores.

Run: ``.venv/bin/python -m benchmarks.data_path [--round-trips N] [--bulk-mb N] [--reps N]
[--cpu N | --host-cpus A,B] [--json PATH]``. Needs the relay built (``mesh-inference setup``). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from mesh_sidecar.net.data_plane.build import ensure_data_relay
from tests.helpers.relay_pair import RelayPair

PING_BYTES = 64
WARMUP_ROUND_TRIPS = 500
CHUNK_BYTES = 1 << 20
COUNT = struct.Struct("<Q")


def target(port_file: Path) -> None:
    """--role target: echo ("E") or count to EOF ("S"), a thread per connection."""
    server = socket.create_server(("127.0.0.1", 0))
    port_file.write_text(str(server.getsockname()[1]))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == b"E":
            while data := conn.recv(65536):
                conn.sendall(data)
        elif mode == b"S":
            total = 0
            while data := conn.recv(CHUNK_BYTES):
                total += len(data)
            conn.sendall(COUNT.pack(total))
        conn.close()

    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def relays_cpu_s(relays: RelayPair) -> float:
    """User + system CPU seconds the two relay processes have used (/proc/PID/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for relay in (relays.a, relays.b):
        fields = Path(f"/proc/{relay.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


def round_trips(sock: socket.socket, count: int) -> list[float]:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(b"E")
    ping, times = b"p" * PING_BYTES, []
    for i in range(WARMUP_ROUND_TRIPS + count):
        began = time.perf_counter()
        sock.sendall(ping)
        got = 0
        while got < PING_BYTES:
            got += len(sock.recv(PING_BYTES - got))
        if i >= WARMUP_ROUND_TRIPS:
            times.append((time.perf_counter() - began) * 1e6)
    sock.close()
    return times


def bulk_gbit_s(sock: socket.socket, megabytes: int) -> float:
    chunk = b"b" * CHUNK_BYTES
    began = time.perf_counter()
    sock.sendall(b"S")
    for _ in range(megabytes):
        sock.sendall(chunk)
    sock.shutdown(socket.SHUT_WR)
    answer = b""
    while len(answer) < COUNT.size:
        answer += sock.recv(COUNT.size)
    elapsed = time.perf_counter() - began
    sock.close()
    assert COUNT.unpack(answer)[0] == megabytes * CHUNK_BYTES  # every byte arrived
    return megabytes * CHUNK_BYTES * 8 / elapsed / 1e9


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def _cpu_pair(text: str) -> tuple[int, int]:
    try:
        first, second = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two CPU numbers like 0,1, not {text!r}") from None
    return first, second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("bench", "target"), default="bench")
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--round-trips", type=int, default=20000)
    parser.add_argument("--bulk-mb", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument("--cpu", type=int, help="run every process of the measurement on this one CPU: no wake-up "
                                                   "crosses cores, so the added time is the relays' own work")
    placement.add_argument("--host-cpus", metavar="A,B", type=_cpu_pair,
                           help="two one-CPU hosts: the client and relay A on CPU A, relay B and the target on CPU B; "
                                "only the hop between hosts crosses cores, for direct and the tunnel alike")
    args = parser.parse_args()
    if args.role == "target":
        target(args.port_file)
        return
    port_file = Path(f"/tmp/data-path-bench-{time.time_ns()}.port")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.data_path", "--role", "target",
                             "--port-file", str(port_file)])
    try:
        while not port_file.exists() or not port_file.read_text():
            time.sleep(0.05)
        target_port = int(port_file.read_text())
        relays = RelayPair(ensure_data_relay(lambda *_: None), target_port)
        # The relays are single-threaded; the target's connection threads start later and inherit its CPU.
        if args.cpu is not None:
            for pid in (proc.pid, relays.a.pid, relays.b.pid, 0):
                os.sched_setaffinity(pid, {args.cpu})
        if args.host_cpus is not None:
            for pid, cpu in ((0, args.host_cpus[0]), (relays.a.pid, args.host_cpus[0]),
                             (relays.b.pid, args.host_cpus[1]), (proc.pid, args.host_cpus[1])):
                os.sched_setaffinity(pid, {cpu})
        direct = lambda: socket.create_connection(("127.0.0.1", target_port))  # noqa: E731
        ids = iter(range(1, 1000))
        rt = {"direct": round_trips(direct(), args.round_trips)}
        tunnel = relays.tunnel(next(ids))
        cpu_before = relays_cpu_s(relays)
        rt["tunnel"] = round_trips(tunnel, args.round_trips)
        # The two relays' own CPU per round trip: what remains of the added time is waiting to be scheduled.
        relay_cpu_us = (relays_cpu_s(relays) - cpu_before) / (args.round_trips + WARMUP_ROUND_TRIPS) * 1e6
        bulk: dict[str, list[float]] = {"direct": [], "tunnel": []}
        for _ in range(args.reps):  # alternating, so the machine's drift hits both
            bulk["direct"].append(bulk_gbit_s(direct(), args.bulk_mb))
            bulk["tunnel"].append(bulk_gbit_s(relays.tunnel(next(ids)), args.bulk_mb))
        relays.close()
    finally:
        proc.kill()
        port_file.unlink(missing_ok=True)
    result = {
        "round_trip_us": {path: {"p50": percentile(t, 50), "p99": percentile(t, 99)} for path, t in rt.items()},
        "bulk_gbit_s": {path: statistics.median(v) for path, v in bulk.items()},
        "relays_cpu_us_per_round_trip": relay_cpu_us,
        "cpu": args.cpu,
        "host_cpus": args.host_cpus,
    }
    rtt = result["round_trip_us"]
    result["added_round_trip_us"] = {q: rtt["tunnel"][q] - rtt["direct"][q] for q in ("p50", "p99")}
    print(f"{'path':<8} {'RTT p50 us':>11} {'RTT p99 us':>11} {'bulk Gbit/s':>12}")
    for path in ("direct", "tunnel"):
        print(f"{path:<8} {rtt[path]['p50']:>11.1f} {rtt[path]['p99']:>11.1f} {result['bulk_gbit_s'][path]:>12.2f}")
    added = result["added_round_trip_us"]
    print(f"added by the native tunnel: p50 {added['p50']:.1f} us, p99 {added['p99']:.1f} us; "
          f"bulk tunnel/direct {result['bulk_gbit_s']['tunnel'] / result['bulk_gbit_s']['direct']:.2f}; "
          f"the two relays' CPU per round trip {relay_cpu_us:.1f} us")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
