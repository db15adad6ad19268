"""Relay benchmark: one tunnel (TCP -> QUIC -> TCP) vs. a plain TCP connection, same two hosts.

Two hosts a and b live in network namespaces on one bridge (``tests/helpers/netns.py``). On b a
target server listens on 127.0.0.1 (for the tunnel) and on b's bridge address (for plain
TCP). From a, one client connection at a time measures:

- bulk: ``--bulk-mb`` MB one way, a -> b, ``--reps`` times; Gbit/s from the first byte sent
  to the target's byte count coming back (so every byte has arrived);
- round trip: ``--round-trips`` 64-byte request/response ping-pongs on one connection
  (TCP_NODELAY), after ``WARMUP_ROUND_TRIPS``; p50/p95 in microseconds.

Paths, all in one run:

- tcp: a's client -> b's bridge address, over the veth pair (the stock RPC way);
- tunnel, once per QUIC library (``--libraries``, default every one importable;
  ``qh3:DIR`` runs the mesh processes with DIR first on PYTHONPATH, e.g. another qh3
  version installed there with ``pip install --target DIR``):
  a's client -> a's TunnelListener on 127.0.0.1 -> QUIC over the veth pair -> b's
  serve_peer_stream / serve_inbound_stream -> b's target on 127.0.0.1. Each host runs
  one mesh process of its own (``node`` in ``benchmarks/relay_roles.py``: a MeshTransport with a
  tunnel, no llama.cpp), with ``MESH_QUIC`` set to the library.

The target's first byte picks its mode ("S": count to EOF, "E": echo); it is no RPC
HELLO, so the tunnel's RPC filter passes the stream through untouched (its opaque path).
While each bulk repetition runs, the CPU seconds of every process are read from /proc,
and each host's UDP buffer drops from /proc/net/snmp.
``--profile`` adds one more bulk transfer per library under py-spy on both mesh
processes (not timed) and sums its samples by where they fall.

Run as root: ``.venv/bin/python -m benchmarks.relay [--bulk-mb N] [--reps N]
[--round-trips N] [--libraries aioquic,qh3[:DIR]] [--mtu N] [--tweak MODULE.NAME=INT]...
[--uvloop] [--profile] [--json PATH]``. ``--tweak`` sets an int constant in the mesh
processes before they start, for experiments: ``net.quic.MAX_DATAGRAM_BYTES=1452``,
``net.endpoint.MAX_DATAGRAMS_PER_READ=1`` (no read batching), ``net.endpoint.GSO_MAX_SEGMENTS=1``
(no GSO), ``net.tunnel.RELAY_CHUNK_BYTES=65536``.
Figures are printed and written as JSON; nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.relay_roles import MESSAGE_BYTES, TARGET_PORT
from benchmarks.report import make_table, publish, stats, wide_console
from benchmarks.setup import REPO_ROOT, Started, cpu_seconds, lacks_root, run_benchmark, run_watched

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "relay.json"
MB = 1_000_000
START_TIMEOUT_S = 30.0
PROFILE_RATE_HZ = 250
LIBRARIES = ("aioquic", "qh3")
# --------------------------------------------------------------------------------------------
# The orchestrator: lab, processes, figures.
# --------------------------------------------------------------------------------------------

def _role_argv(host, role: str, spec: dict[str, Any]) -> list[str]:
    return host.exec_argv(sys.executable, "-m", "benchmarks.relay_roles", role, json.dumps(spec))


def _udp_drops(hosts) -> dict[str, int]:
    """Datagrams each host's kernel dropped for want of socket buffer room (both ways), so far."""
    drops = {}
    for host in hosts:
        lines = [line.split() for line in subprocess.run(
            host.exec_argv("cat", "/proc/net/snmp"), capture_output=True, text=True, check=True).stdout.splitlines()
            if line.startswith("Udp:")]
        row = dict(zip(lines[0][1:], map(int, lines[1][1:]), strict=True))
        drops[host.name] = row["RcvbufErrors"] + row["SndbufErrors"]
    return drops


@dataclass
class Bench:
    """What every measurement needs: the processes started, the lab's hosts, the options."""

    started: Started
    hosts: dict[str, Any]
    args: argparse.Namespace
    workdir: Path
    py_spy: str


def _measure(bench: Bench, spec: dict[str, Any], watched: dict[str, int]) -> dict[str, Any]:
    """One client run on host a; the CPU seconds each watched pid spent meanwhile, and the UDP drops."""
    hosts = bench.hosts.values()
    drops_before = _udp_drops(hosts)
    before = {name: cpu_seconds(pid) for name, pid in watched.items()}
    returncode, out, err = run_watched(_role_argv(bench.hosts["a"], "client", spec), bench.started.check, 0.05)
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in watched.items()}
    drops = {name: n - drops_before[name] for name, n in _udp_drops(hosts).items()}
    if returncode != 0:
        raise RuntimeError(f"client failed ({returncode}):\n{err[-3000:]}")
    return {**json.loads(out), "cpu_s": cpu, "udp_drops": drops}


def _run_path(bench: Bench, target: dict[str, Any], watched: dict[str, int], profile_as: str | None = None
              ) -> dict[str, Any]:
    args = bench.args
    bulk_spec = {**target, "mode": "bulk", "bytes": args.bulk_mb * MB}
    bulk = [_measure(bench, bulk_spec, watched) for _ in range(args.reps)]
    rtt = _measure(bench, {**target, "mode": "rtt", "round_trips": args.round_trips}, watched)
    result = {"bulk": bulk, "round_trip": rtt}
    if profile_as is not None:
        result["profile"] = _profiled_bulk(bench, bulk_spec, watched, profile_as)
    return result


def _profiled_bulk(bench: Bench, bulk_spec: dict[str, Any], watched: dict[str, int], label: str) -> dict[str, Any]:
    """One more bulk transfer with py-spy sampling both mesh processes; samples summed by place."""
    spies = {}
    for name in ("node a", "node b"):
        out = bench.workdir / f"profile-{label}-{name.replace(' ', '-')}.txt"
        argv = [bench.py_spy, "record", "--pid", str(watched[name]), "--rate", str(PROFILE_RATE_HZ),
                "--format", "raw", "--full-filenames", "--nonblocking", "--output", str(out)]
        spies[name] = (subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        start_new_session=True), out)
    time.sleep(1.0)  # py-spy attaches
    run = _measure(bench, bulk_spec, watched)
    summary = {"bulk_gbit_s_while_sampled": run["gbit_s"], "seconds": run["seconds"]}
    for name, (spy, out) in spies.items():
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
        summary[name] = _summarize_profile(out, run["seconds"] + 1.0) if out.exists() else {
            "error": spy.stderr.read().decode(errors="replace")[-500:] if spy.stderr else "no output"}
    return summary


def _place(frame: str) -> str:
    """Where a frame's code lives, coarsely: the library, our modules, asyncio, the rest."""
    name, _, location = frame.partition(" (")
    path = location.rsplit(":", 1)[0]
    for key in ("aioquic", "qh3", "uvloop"):
        if f"/{key}/" in path:
            return key
    if "/mesh_sidecar/" in path:
        return "mesh_sidecar/" + path.rsplit("/", 1)[1]
    if "/asyncio/" in path:
        return "asyncio"
    return path.rsplit("/", 1)[-1] or name


def _summarize_profile(path: Path, seconds: float) -> dict[str, Any]:
    """py-spy's collapsed stacks: busy share of one core; self samples by place and by function."""
    by_place: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")[1:]  # the first entry names the thread
        total += n
        leaf = frames[-1] if frames else "?"
        by_place[_place(leaf)] += n
        by_function[leaf.split(" (")[0] + " @ " + _place(leaf)] += n
        for frame in set(frames):
            if "/mesh_sidecar/" in frame or "/aioquic/" in frame or "/qh3/" in frame:
                inclusive[frame.split(" (")[0] + " @ " + _place(frame)] += n
    share = {k: round(v / total, 3) for k, v in by_place.most_common(12)} if total else {}
    return {
        "samples": total,
        "busy_share_of_one_core": round(total / (seconds * PROFILE_RATE_HZ), 3),
        "self_by_place": share,
        "self_top_functions": {k: round(v / total, 3) for k, v in by_function.most_common(15)} if total else {},
        "inclusive_top": {k: round(v / total, 3) for k, v in inclusive.most_common(15)} if total else {},
    }


def _importable(library: str) -> bool:
    return importlib.util.find_spec(library) is not None


def _set_mtu(lab, mtu: int) -> None:
    subprocess.run(["ip", "link", "set", lab.bridge, "mtu", str(mtu)], check=True)
    for host in lab.hosts:
        outside, inside = f"{lab.tag}{host.name}o", f"{lab.tag}{host.name}i"
        subprocess.run(["ip", "link", "set", outside, "mtu", str(mtu)], check=True)
        subprocess.run(["ip", "-n", host.netns, "link", "set", inside, "mtu", str(mtu)], check=True)


def _start_mesh(bench: Bench, library: str) -> tuple[dict, dict]:
    """Node b, then node a dialing it with a tunnel, both on ``library``; their ready files."""
    from tests.helpers.waiting import wait_until

    hosts, started, args = bench.hosts, bench.started, bench.args
    name, _, path = library.partition(":")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=bench.workdir))
    env = {**os.environ, "MESH_QUIC": name}
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path, str(REPO_ROOT)])
    common = {"workdir": str(run_dir), "secret": secrets.token_hex(32), "tweaks": dict(args.tweak),
              "uvloop": args.uvloop}
    started.popen(f"node b ({library})", _role_argv(hosts["b"], "node", {**common, "name": "b", "ip": hosts["b"].ip}),
                  run_dir / "node-b.out", env)
    wait_until(lambda: started.check() or (run_dir / "b.ready").exists(), START_TIMEOUT_S, "node b starts")
    started.popen(f"node a ({library})", _role_argv(hosts["a"], "node", {
        **common, "name": "a", "ip": hosts["a"].ip, "peer_ip": hosts["b"].ip}),
        run_dir / "node-a.out", env)
    wait_until(lambda: started.check() or (run_dir / "a.ready").exists(), START_TIMEOUT_S, "node a connects")
    a, b = (json.loads((run_dir / f"{n}.ready").read_text()) for n in "ab")
    return a, b


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    bulk, rtt = result["bulk"], result["round_trip"]["us"]
    gigabytes = bulk[0]["bytes"] / 1e9
    cpu = {name: statistics.median(r["cpu_s"][name] for r in bulk) / gigabytes for name in bulk[0]["cpu_s"]}
    return {
        "bulk_gbit_s": stats([r["gbit_s"] for r in bulk]),
        "rtt_us": {"p50": _percentile(rtt, 50), "p95": _percentile(rtt, 95), "p99": _percentile(rtt, 99),
                   "mean": statistics.fmean(rtt)},
        "cpu_s_per_gb": cpu,
        "udp_drops_per_bulk_run": statistics.median(sum(r["udp_drops"].values()) for r in bulk),
    }


def _print(report: dict[str, Any]) -> None:
    console = wide_console(120)
    table = make_table(f"relay a -> b: {report['bulk_mb']} MB x {report['reps']}, {report['round_trips']} round trips "
                       f"of {MESSAGE_BYTES} B, MTU {report['mtu']}, {report['cpu_count']} CPUs"
                       + (f", tweaks {report['tweaks']}" if report["tweaks"] else "")
                       + (", uvloop" if report["uvloop"] else "")
                       + f", load {report['load_average_at_start'][0]:.1f}",
                       ("path", "bulk Gbit/s (med)", "min–max", "RTT p50 µs", "RTT p95 µs", "CPU s/GB node a | node b",
                        "UDP drops / run", "vs tcp"))
    tcp = report["paths"]["tcp"]
    for name, s in report["paths"].items():
        g = s["bulk_gbit_s"]
        cpu = s["cpu_s_per_gb"]
        nodes = f"{cpu['node a']:.1f} | {cpu['node b']:.1f}" if "node a" in cpu else ""
        ratio = "" if name == "tcp" else (f"{g['median'] / tcp['bulk_gbit_s']['median']:.3f}x, "
                                          f"+{s['rtt_us']['p50'] - tcp['rtt_us']['p50']:.0f} µs")
        table.add_row(name, f"{g['median']:.3f}", f"{g['min']:.3f}–{g['max']:.3f}", f"{s['rtt_us']['p50']:.0f}",
                      f"{s['rtt_us']['p95']:.0f}", nodes, f"{s['udp_drops_per_bulk_run']:.0f}", ratio)
    console.print(table)
    for name, s in report["paths"].items():
        profile = s.get("profile")
        if not profile:
            continue
        console.print(f"[bold]profile, {name}[/bold] (one bulk run at {profile['bulk_gbit_s_while_sampled']:.3f} "
                      f"Gbit/s under py-spy):")
        for node in ("node a", "node b"):
            p = profile[node]
            if "error" in p:
                console.print(f"  {node}: {p['error']}")
                continue
            places = ", ".join(f"{k} {v:.0%}" for k, v in p["self_by_place"].items() if v >= 0.02)
            console.print(f"  {node}: busy {p['busy_share_of_one_core']:.0%} of a core; self time: {places}")
            top = ", ".join(f"{k} {v:.0%}" for k, v in list(p["self_top_functions"].items())[:6])
            console.print(f"    top functions: {top}")


def _tweak(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if not value or "." not in name:
        raise argparse.ArgumentTypeError("a tweak is MODULE.NAME=INT, e.g. net.quic.MAX_DATAGRAM_BYTES=1452")
    return name, int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay", description=__doc__.split("\n")[0])
    parser.add_argument("--bulk-mb", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--libraries", default=",".join(lib for lib in LIBRARIES if _importable(lib)))
    parser.add_argument("--mtu", type=int, default=1500, help="of the veth pairs and the bridge")
    parser.add_argument("--tweak", type=_tweak, action="append", default=[])
    parser.add_argument("--uvloop", action="store_true", help="run the mesh processes on uvloop")
    parser.add_argument("--profile", action="store_true", help="one more bulk run per library under py-spy")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)

    if lacks_root():
        return 2
    libraries = [lib for lib in args.libraries.split(",") if lib]
    for lib in libraries:
        if lib.split(":")[0] not in LIBRARIES or not (":" in lib or _importable(lib)):
            print(f"QUIC library {lib!r} is not installed here (known: {', '.join(LIBRARIES)})", file=sys.stderr)
            return 2
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if args.profile and not Path(py_spy).exists():
        print("--profile needs py-spy: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO_ROOT))
    from tests.helpers.netns import Lab

    started = Started(stop_timeout_s=10)
    labs: list = []  # closed by run_benchmark, however the run ends
    workdir = Path(tempfile.mkdtemp(prefix="bench-relay-"))

    def run() -> int:
        lab = Lab()
        labs.append(lab)
        lab.sniffer.stop()  # its per-frame Python loop would only compete for the CPU
        hosts = {name: lab.add_host(name) for name in "ab"}
        if args.mtu != 1500:
            _set_mtu(lab, args.mtu)
        target = started.popen("target", _role_argv(hosts["b"], "target", {"hosts": ["127.0.0.1", hosts["b"].ip]}),
                               workdir / "target.out")
        time.sleep(0.5)
        started.check()
        watched = {"target": target.pid}
        load_at_start = os.getloadavg()
        bench = Bench(started, hosts, args, workdir, py_spy)
        print(f"tcp: a -> {hosts['b'].ip}:{TARGET_PORT} (logs in {workdir})...", flush=True)
        results = {"tcp": _run_path(bench, {"host": hosts["b"].ip, "port": TARGET_PORT}, watched)}
        libraries_info = {}
        for library in libraries:
            print(f"tunnel ({library}): a's 127.0.0.1 -> QUIC -> b's 127.0.0.1:{TARGET_PORT}...", flush=True)
            a, b = _start_mesh(bench, library)
            assert a["library"] == b["library"] == library.split(":")[0], (a, b)
            label = f"{a['library']} {a['version']}"
            host, port = a["tunnel"]
            results[f"tunnel {label}"] = _run_path(bench, {"host": host, "port": port},
                                                   {**watched, "node a": a["pid"], "node b": b["pid"]},
                                                   label.replace(" ", "-") if args.profile else None)
            libraries_info[label] = library
            for name, proc, _ in list(started.procs):
                if name.startswith("node "):
                    started.stop(proc)

        from mesh_sidecar.net import quic, streams, tunnel

        report = {
            "benchmark": "relay",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            "python": platform.python_version(),
            "libraries": libraries_info,
            "bulk_mb": args.bulk_mb,
            "reps": args.reps,
            "round_trips": args.round_trips,
            "mtu": args.mtu,
            "tweaks": dict(args.tweak),
            "uvloop": args.uvloop,
            "constants": {name: getattr(module, name) for module, names in (
                (quic, ("MAX_DATAGRAM_BYTES", "STREAM_RECEIVE_WINDOW_BYTES", "CONNECTION_RECEIVE_WINDOW_BYTES")),
                (streams, ("SEND_HIGH_WATER_BYTES", "SEND_LOW_WATER_BYTES")),
                (tunnel, ("RELAY_CHUNK_BYTES",))) for name in names},
            "paths": {name: {**_summary(r), **({"profile": r["profile"]} if "profile" in r else {})}
                      for name, r in results.items()},
            "raw": {name: {"bulk": r["bulk"], "round_trip_us": r["round_trip"]["us"]} for name, r in results.items()},
        }
        return publish(report, _print, args.json)

    return run_benchmark(run, started, workdir, lambda: [lab.close() for lab in labs])


if __name__ == "__main__":
    sys.exit(main())
