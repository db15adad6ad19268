"""Load benchmark: how long a model load takes and how many bytes it ships, stock vs. weight cache.

Three hosts a, b, c in network namespaces (``tests/helpers/netns.py``); c serves, a and b
are workers, ``--min-peers 2``. The model is the synthetic ``cache-test`` GGUF by
default (every per-layer matrix above llama.cpp's 10 MiB by-hash threshold), or
``--model PATH``. Setups, one after the other, each on a fresh lab:

- direct: stock llama.cpp, ``ggml-rpc-server`` on every host over TCP and
  ``llama-server --rpc`` on c (no cache): the yardstick;
- mesh stock: the mesh with ``--no-weight-cache`` everywhere;
- mesh seeded: every node holds the model file (``--model``) and seeds its weight
  cache before it starts; seeding time is reported on its own (a one-time cost).

``--reps`` rounds run the three setups in turn; the mesh's homes carry over from
round to round, as a user's would between starts (so only the first round seeds).
Load times are medians over the rounds; bytes come from the first round.

Load time is from the start of llama-server (for the mesh: c printing its plan,
just before it starts llama-server) to the API answering; c's whole start-up
(launch to API) is reported too. Bytes are what each worker host's network
interface received meanwhile (the same counter for every setup), and for the
mesh also c's tunnel counters. The model file is read just before each setup, so
none of them finds it paged out.

``--profile`` shapes every link as the decode benchmark's profiles do.

Run as root: ``.venv/bin/python -m benchmarks.load [--model PATH] [--reps N] [--profile NAME]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.report import make_table, publish, wide_console
from benchmarks.setup import (
    DIRECT_API_PORT,
    DIRECT_RPC_PORT,
    MESH_API_PORT,
    QUIC_PORT,
    REPO_ROOT,
    START_TIMEOUT_S,
    Started,
    lacks_root,
    listening,
    node_status,
    quiet,
    resolve_model,
    run_benchmark,
)
from tests.helpers.waiting import wait_until

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "load.json"
_TICKET_MARK = "Node ticket: "


def _rx_bytes(host) -> int:
    """Bytes received on ``host``'s link to the other hosts (its one non-loopback interface)."""
    out = subprocess.run(["ip", "-n", host.netns, "-j", "-s", "link", "show"], capture_output=True, text=True,
                         check=True)
    return sum(link["stats64"]["rx"]["bytes"] for link in json.loads(out.stdout) if link["ifname"] != "lo")


def _start_api_watch(host, port: int, started: Started, log: Path) -> subprocess.Popen:
    """One process in ``host`` that exits once ``port``'s /health answers 200.

    Started (and its imports done) before llama-server, polling with one client:
    a new process or client per poll would take CPU from the load it times.
    """
    code = ("import httpx,time\n"
            "with httpx.Client(timeout=2, trust_env=False) as c:\n"
            "    print('watching', flush=True)\n"
            "    while True:\n"
            "        try:\n"
            f"            if c.get('http://127.0.0.1:{port}/health').status_code == 200: break\n"
            "        except httpx.HTTPError: pass\n"
            "        time.sleep(0.05)\n")
    watch = started.popen("api watch", host.exec_argv(sys.executable, "-c", code), log)
    wait_until(lambda: "watching" in log.read_text(), START_TIMEOUT_S, "the API watch starts")
    return watch


def _warm_page_cache(path: Path) -> None:
    """Read ``path`` once so every setup loads it from memory.

    Some machines (this benchmark's VM among them) page out files left idle for
    half a minute; a setup that happened to find the model evicted would time
    the disk, not the load.
    """
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def _ticket(log: Path) -> str:
    def found() -> str | None:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(_TICKET_MARK):
                return line[len(_TICKET_MARK):].strip()
        return None
    return wait_until(found, 300, "a ticket (seeding a big model takes a while)")


def run_direct(hosts, started: Started, workdir: Path, binaries, model: Path, round_: int) -> dict[str, Any]:
    from mesh_sidecar.llama.launch import llama_server_argv

    for name in "abc":
        host = hosts[name]
        started.popen(f"rpc {name}", host.exec_argv(str(binaries.rpc_server), "-H", host.ip, "-p",
                                                    str(DIRECT_RPC_PORT)), workdir / f"direct-rpc-{name}-{round_}.out")
    for name in "abc":
        wait_until(partial(listening, hosts[name], DIRECT_RPC_PORT), 30, f"rpc-server on {name}")
    endpoints = [f"{hosts[n].ip}:{DIRECT_RPC_PORT}" for n in "abc"]
    rx_before = {n: _rx_bytes(hosts[n]) for n in "ab"}
    _warm_page_cache(model)
    watch = _start_api_watch(hosts["c"], DIRECT_API_PORT, started, workdir / f"direct-watch-{round_}.out")
    started_at = time.monotonic()
    started.popen("direct llama-server", hosts["c"].exec_argv(
        *llama_server_argv(binaries, model, endpoints, DIRECT_API_PORT, extra=["--ctx-size", "512"])),
        workdir / f"direct-llama-{round_}.out")
    wait_until(lambda: watch.poll() is not None, START_TIMEOUT_S * 3, "direct llama-server loads", poll_s=0.05)
    load_s = time.monotonic() - started_at
    return {"load_s": load_s, "startup_s": load_s,
            "rx_bytes": {n: _rx_bytes(hosts[n]) - rx_before[n] for n in "ab"}}


def run_mesh(hosts, started: Started, workdir: Path, model: Path, seeded: bool, label: str,
             round_: int) -> dict[str, Any]:
    """One start of the three nodes; later rounds reuse the homes (a seeded cache stays seeded)."""
    homes = {n: workdir / label / n for n in "abc"}
    extra = ["--model", str(model)] if seeded else ["--no-weight-cache"]

    def start(name: str, *args: str) -> Path:
        homes[name].mkdir(parents=True, exist_ok=True)
        log = workdir / f"{label}-{name}-{round_}.out"
        started.popen(f"{label} {name}", hosts[name].exec_argv(
            sys.executable, "-m", "mesh_sidecar", "--home", str(homes[name]), "--name", name, "--port",
            str(QUIC_PORT), "--ctx-size", "512", *args), log)
        return log

    _warm_page_cache(model)
    seed_started = time.monotonic()
    ticket = _ticket(start("a", *extra))
    _ticket(start("b", "--join", ticket, *extra))
    seeding_s = time.monotonic() - seed_started  # workers' start: mostly seeding when seeded
    rx_before = {n: _rx_bytes(hosts[n]) for n in "ab"}
    started_at = time.monotonic()
    log_c = start("c", "--join", ticket, "--serve", str(MESH_API_PORT), "--spread", "--min-peers", "2",
                  "--model", str(model), *([] if seeded else ["--no-weight-cache"]))
    wait_until(lambda: "Plan: " in log_c.read_text(errors="replace"), START_TIMEOUT_S, f"{label}: c plans")
    planned_at = time.monotonic()
    wait_until(lambda: "API ready" in log_c.read_text(errors="replace"), START_TIMEOUT_S * 3, f"{label}: c loads",
               poll_s=0.05)
    ready_at = time.monotonic()
    status = node_status(hosts["c"], homes["c"])
    for name in "abc":
        started.extra_pids += [p["pid"] for p in node_status(hosts[name], homes[name])["processes"]]
    return {"load_s": ready_at - planned_at, "startup_s": ready_at - started_at, "workers_start_s": seeding_s,
            "rx_bytes": {n: _rx_bytes(hosts[n]) - rx_before[n] for n in "ab"},
            "tunnel_bytes_to_peer": {p["name"]: p["bytes_to_peer"] for p in status["peers"]},
            "plan": [(n["name"], n["layers"], n["weights_bytes"]) for n in status["serving"]["plan"]["nodes"]]}


SETUPS = ("direct", "mesh stock", "mesh seeded")


def _summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median load and start-up times over the rounds; bytes and counters from the first round."""
    loads = [r["load_s"] for r in rounds]
    return {**rounds[0], "load_s": statistics.median(loads), "load_s_min": min(loads), "load_s_max": max(loads),
            "startup_s": statistics.median(r["startup_s"] for r in rounds), "rounds": rounds}


def _print(report: dict[str, Any]) -> None:
    stock = report["mesh stock"]
    table = make_table(f"load: {report['model']} ({report['model_bytes'] / 1e6:.0f} MB), 3 hosts, c serves, "
                       f"{report['profile']} links, median of {report['reps']}",
                       ("setup", "load s", "min-max", "vs mesh stock", "c start→API s", "MB into a", "MB into b",
                        "tunnel MB c→a", "tunnel MB c→b", "workers' first start s"))
    for name in SETUPS:
        r = report[name]
        tunnels = r.get("tunnel_bytes_to_peer", {})
        table.add_row(name, f"{r['load_s']:.1f}", f"{r['load_s_min']:.1f}-{r['load_s_max']:.1f}",
                      f"{r['load_s'] / stock['load_s']:.2f}x", f"{r['startup_s']:.1f}",
                      f"{r['rx_bytes']['a'] / 1e6:.1f}", f"{r['rx_bytes']['b'] / 1e6:.1f}",
                      *(f"{tunnels[n] / 1e6:.2f}" if n in tunnels else "-" for n in "ab"),
                      f"{r['workers_start_s']:.1f}" if "workers_start_s" in r else "-")
    wide_console(110).print(table)
    seeded, stock_bytes = report["mesh seeded"], sum(stock["tunnel_bytes_to_peer"].values())
    share = sum(seeded["tunnel_bytes_to_peer"].values()) / stock_bytes if stock_bytes else float("nan")
    print(f"seeded/stock: tunnel bytes {share:.2%}, load time {seeded['load_s'] / stock['load_s']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a GGUF, or a synthetic preset's name such as bench-1gb "
                                         "(default: the synthetic cache-test model)")
    parser.add_argument("--reps", type=int, default=3, help="rounds of the three setups (default 3)")
    parser.add_argument("--profile", default="unshaped",
                        help="link profile from tests/helpers/netns.py LINK_PROFILES, e.g. 1gbit, 100mbit "
                             "(default unshaped)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if lacks_root():
        return 2
    from benchmarks.synthetic_model import CACHE_TEST, ensure_synthetic_model
    from mesh_sidecar.llama.build import ensure_binaries
    from tests.helpers.netns import LINK_PROFILES, Lab

    if args.profile not in LINK_PROFILES:
        parser.error(f"unknown --profile {args.profile!r}; choose from {', '.join(LINK_PROFILES)}")
    binaries = ensure_binaries(None, quiet)
    model = resolve_model(args.model).resolve() if args.model else ensure_synthetic_model(CACHE_TEST)
    started = Started()
    workdir = Path(tempfile.mkdtemp(prefix="bench-load-"))
    report: dict[str, Any] = {"benchmark": "load", "date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "model": model.name, "model_bytes": model.stat().st_size, "cpu_count": os.cpu_count(),
                              "reps": args.reps, "profile": args.profile, "link": LINK_PROFILES[args.profile]}
    runs = {"direct": lambda h, i: run_direct(h, started, workdir, binaries, model, i),
            "mesh stock": lambda h, i: run_mesh(h, started, workdir, model, False, "stock", i),
            "mesh seeded": lambda h, i: run_mesh(h, started, workdir, model, True, "seeded", i)}

    def body() -> int:
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in SETUPS}
        # Rounds interleave the setups, so a slow spell of a shared machine hits all of them.
        for i in range(args.reps):
            for name in SETUPS:
                # The sniffer's per-frame loop would only compete for the CPU.
                lab = Lab(**LINK_PROFILES[args.profile], sniff=False)
                try:
                    hosts = {n: lab.add_host(n) for n in "abc"}
                    print(f"round {i + 1}/{args.reps}, {name}: loading (logs in {workdir})...", flush=True)
                    rounds[name].append(runs[name](hosts, i))
                finally:
                    started.stop_all()
                    lab.close()
        report.update({name: _summarize(rounds[name]) for name in SETUPS})
        return publish(report, _print, args.json)

    return run_benchmark(body, started, workdir)

if __name__ == "__main__":
    sys.exit(main())
