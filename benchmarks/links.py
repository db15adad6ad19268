"""Link profiles measured: ping RTT and one TCP stream's throughput between two lab hosts.

For each link profile of ``tests/helpers/netns.py`` (``LINK_PROFILES``), a lab with hosts a
and b: ICMP echo from a to b (``--pings`` of them, 10 ms apart, after one more that
waits for ARP), then one TCP stream from a to b for ``--seconds`` (a Python sender
writing 256 KiB at a time, a Python receiver counting bytes from the first to EOF).
The pings and the stream each get a fresh lab, so on the delay switch its own
figures (how late frames left it: send time minus due time; its CPU seconds,
per GB streamed) are kept apart for light and for saturating traffic.

Run as root: ``.venv/bin/python -m benchmarks.links [--profiles unshaped,0ms,5ms,20ms]
[--pings 100] [--seconds 5] [--json PATH]``.
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
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.report import make_table, wide_console
from benchmarks.setup import lacks_root

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "links.json"
DEFAULT_PROFILES = "unshaped,1gbit,100mbit,0ms,5ms,20ms"
TCP_PORT = 5201
CHUNK_BYTES = 256 * 1024
PING_INTERVAL_S = 0.01
PING_TIMEOUT_S = 2.0
ICMP_ECHO_REQUEST, ICMP_ECHO_REPLY = 8, 0
PING_PAYLOAD = bytes(56)


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


def _ping(ip: str, count: int) -> dict:
    """ICMP echo over a raw socket (no ping binary here); RTTs in ms, the ARP-resolving first left out."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    sock.settimeout(PING_TIMEOUT_S)
    ident = os.getpid() & 0xFFFF
    rtts, lost = [], 0
    for seq in range(count + 1):
        header = struct.pack("!BBHHH", ICMP_ECHO_REQUEST, 0, 0, ident, seq)
        packet = struct.pack("!BBHHH", ICMP_ECHO_REQUEST, 0, _checksum(header + PING_PAYLOAD), ident, seq)
        started = time.perf_counter()
        sock.sendto(packet + PING_PAYLOAD, (ip, 0))
        try:
            while True:
                data = sock.recv(2048)
                offset = (data[0] & 0x0F) * 4  # past the IP header
                kind, _, _, rid, rseq = struct.unpack_from("!BBHHH", data, offset)
                if kind == ICMP_ECHO_REPLY and rid == ident and rseq == seq:
                    break
        except TimeoutError:
            lost += 1
            continue
        if seq:
            rtts.append((time.perf_counter() - started) * 1000)
        time.sleep(PING_INTERVAL_S)
    return {"rtt_ms": rtts, "lost": lost}


def _tcp_receive(port: int) -> dict:
    listener = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    conn, _ = listener.accept()
    buffer = bytearray(CHUNK_BYTES)
    received, first = 0, None
    while n := conn.recv_into(buffer):
        first = first or time.perf_counter()
        received += n
    return {"bytes": received, "seconds": time.perf_counter() - first}


def _tcp_send(ip: str, port: int, seconds: float) -> dict:
    conn = socket.create_connection((ip, port))
    chunk, sent = bytes(CHUNK_BYTES), 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        conn.sendall(chunk)
        sent += len(chunk)
    conn.close()
    return {"bytes": sent}


def _in(host, *args: str, **kwargs) -> subprocess.Popen:
    argv = host.exec_argv(sys.executable, "-m", "benchmarks.links", *args)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, **kwargs)


def _last_json(proc: subprocess.Popen, timeout: float) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{proc.args} failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def measure(profile: str, pings: int, seconds: float) -> dict:
    """Pings on one lab, the TCP stream on a fresh one: the switch's figures for each stay apart."""
    from tests.helpers.netns import LINK_PROFILES, Lab

    def on_lab(work):
        lab = Lab(**LINK_PROFILES[profile], sniff=False)
        try:
            result = work(lab.add_host("a"), lab.add_host("b"))
        finally:
            lab.close()
        return result, lab.switch_stats

    def pinging(a, b) -> dict:
        return _last_json(_in(a, "--ping", b.ip, str(pings)), timeout=60 + pings)

    def streaming(a, b) -> dict:
        receiver = _in(b, "--tcp-receive", str(TCP_PORT))
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError("the TCP receiver did not start")
        _last_json(_in(a, "--tcp-send", b.ip, str(TCP_PORT), str(seconds)), timeout=seconds + 60)
        return _last_json(receiver, timeout=60)

    ping, ping_switch = on_lab(pinging)
    tcp, tcp_switch = on_lab(streaming)
    rtts = sorted(ping["rtt_ms"])
    return {
        "profile": profile,
        "lab": LINK_PROFILES[profile],
        "rtt_ms": {"min": rtts[0], "median": statistics.median(rtts), "p99": rtts[int(0.99 * (len(rtts) - 1))],
                   "max": rtts[-1], "stdev": statistics.stdev(rtts), "lost": ping["lost"]},
        "tcp_mbit_s": tcp["bytes"] * 8 / tcp["seconds"] / 1e6,
        "tcp_bytes": tcp["bytes"],
        "switch_while_pinging": ping_switch,
        "switch_while_streaming": tcp_switch,
    }


def _print(rows: list[dict]) -> None:
    def late(stats: dict | None) -> str:
        if not stats:
            return ""
        return "/".join(f"{stats['late_ms'][k]:.2f}" for k in ("p50", "p99", "max"))

    table = make_table("link profiles: a → b (switch: how late frames left it, ms p50/p99/max)",
                       ("profile", "RTT ms min", "median", "p99", "max", "switch while pinging", "TCP Mbit/s",
                        "switch while streaming", "switch CPU s / GB"))
    for r in rows:
        rtt, streaming = r["rtt_ms"], r["switch_while_streaming"]
        cpu = f"{streaming['cpu_s'] / (r['tcp_bytes'] / 1e9):.1f}" if streaming else ""
        table.add_row(r["profile"], f"{rtt['min']:.3f}", f"{rtt['median']:.3f}", f"{rtt['p99']:.3f}",
                      f"{rtt['max']:.3f}", late(r["switch_while_pinging"]), f"{r['tcp_mbit_s']:,.0f}",
                      late(streaming), cpu)
    wide_console(130).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.links", description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", default=DEFAULT_PROFILES)
    parser.add_argument("--pings", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--ping", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--tcp-receive", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tcp-send", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ping:
        print(json.dumps(_ping(args.ping[0], int(args.ping[1]))))
        return 0
    if args.tcp_receive:
        print(json.dumps(_tcp_receive(args.tcp_receive)))
        return 0
    if args.tcp_send:
        print(json.dumps(_tcp_send(args.tcp_send[0], int(args.tcp_send[1]), float(args.tcp_send[2]))))
        return 0
    if lacks_root():
        return 2

    rows = []
    for profile in args.profiles.split(","):
        print(f"{profile}...", flush=True)
        rows.append(measure(profile, args.pings, args.seconds))
    _print(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"benchmark": "links", "date": datetime.now(UTC).isoformat(
        timespec="seconds"), "cpu_count": os.cpu_count(), "profiles": rows}, indent=2) + "\n")
    print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
