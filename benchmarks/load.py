"""Load benchmark: how long a model load takes and how many bytes it ships, stock vs. weight cache.

Three hosts a, b, c in network namespaces (``tests/netns.py``); c serves, a and b
are workers, ``--min-peers 2``. The model is the synthetic ``cache-test`` GGUF by
default (every per-layer matrix above llama.cpp's 10 MiB by-hash threshold), or
``--model PATH``. Setups, one after the other on fresh homes:

- direct: stock llama.cpp, ``ggml-rpc-server`` on every host over TCP and
  ``llama-server --rpc`` on c (no cache): the yardstick;
- mesh stock: the mesh with ``--no-weight-cache`` everywhere;
- mesh seeded: every node holds the model file (``--model``) and seeds its weight
  cache before it starts; seeding time is reported on its own (a one-time cost).

Load time is from the start of llama-server (for the mesh: c printing its plan,
just before it starts llama-server) to the API answering; c's whole start-up
(launch to API) is reported too. Bytes are what each worker host's network
interface received meanwhile (the same counter for every setup), and for the
mesh also c's tunnel counters.

Run as root: ``.venv/bin/python -m benchmarks.load [--model PATH] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.decode import (DIRECT_API_PORT, DIRECT_RPC_PORT, MESH_API_PORT, QUIC_PORT, REPO_ROOT, START_TIMEOUT_S,
                               Started, _listening, _quiet, _status, lacks_root, run_benchmark, write_report)
from tests.waiting import wait_until

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "load.json"
_TICKET_MARK = "Node ticket: "


def _rx_bytes(host) -> int:
    """Bytes received on ``host``'s link to the other hosts (its one non-loopback interface)."""
    out = subprocess.run(["ip", "-n", host.netns, "-j", "-s", "link", "show"], capture_output=True, text=True,
                         check=True)
    return sum(link["stats64"]["rx"]["bytes"] for link in json.loads(out.stdout) if link["ifname"] != "lo")


def _api_up(host, port: int) -> bool:
    code = (f"import httpx,sys; sys.exit(0 if httpx.get('http://127.0.0.1:{port}/health',timeout=2)"
            ".status_code==200 else 1)")
    return subprocess.run(host.exec_argv(sys.executable, "-c", code), capture_output=True).returncode == 0


def _ticket(log: Path) -> str:
    def found() -> str | None:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(_TICKET_MARK):
                return line[len(_TICKET_MARK):].strip()
        return None
    return wait_until(found, 300, "a ticket (seeding a big model takes a while)")


def run_direct(hosts, started: Started, workdir: Path, binaries, model: Path) -> dict[str, Any]:
    from mesh_sidecar.launch import llama_server_argv

    for name in "abc":
        host = hosts[name]
        started.popen(f"rpc {name}", host.exec_argv(str(binaries.rpc_server), "-H", host.ip, "-p",
                                                    str(DIRECT_RPC_PORT)), workdir / f"direct-rpc-{name}.out")
    for name in "abc":
        wait_until(lambda: _listening(hosts[name], DIRECT_RPC_PORT), 30, f"rpc-server on {name}")
    endpoints = [f"{hosts[n].ip}:{DIRECT_RPC_PORT}" for n in "abc"]
    rx_before = {n: _rx_bytes(hosts[n]) for n in "ab"}
    started_at = time.monotonic()
    started.popen("direct llama-server", hosts["c"].exec_argv(
        *llama_server_argv(binaries, model, endpoints, DIRECT_API_PORT, extra=["--ctx-size", "512"])),
        workdir / "direct-llama.out")
    wait_until(lambda: _api_up(hosts["c"], DIRECT_API_PORT), START_TIMEOUT_S * 3, "direct llama-server loads",
               poll_s=0.05)
    load_s = time.monotonic() - started_at
    return {"load_s": load_s, "startup_s": load_s,
            "rx_bytes": {n: _rx_bytes(hosts[n]) - rx_before[n] for n in "ab"}}


def run_mesh(hosts, started: Started, workdir: Path, model: Path, seeded: bool, label: str) -> dict[str, Any]:
    homes = {n: workdir / label / n for n in "abc"}
    extra = ["--model", str(model)] if seeded else ["--no-weight-cache"]

    def start(name: str, *args: str) -> Path:
        homes[name].mkdir(parents=True)
        log = workdir / f"{label}-{name}.out"
        started.popen(f"{label} {name}", hosts[name].exec_argv(
            sys.executable, "-m", "mesh_sidecar", "--home", str(homes[name]), "--name", name, "--port",
            str(QUIC_PORT), "--ctx-size", "512", *args), log)
        return log

    seed_started = time.monotonic()
    ticket = _ticket(start("a", *extra))
    _ticket(start("b", "--join", ticket, *extra))
    seeding_s = time.monotonic() - seed_started  # workers' start: mostly seeding when seeded
    rx_before = {n: _rx_bytes(hosts[n]) for n in "ab"}
    started_at = time.monotonic()
    log_c = start("c", "--join", ticket, "--serve", str(MESH_API_PORT), "--min-peers", "2", "--model", str(model),
                  *([] if seeded else ["--no-weight-cache"]))
    wait_until(lambda: "Plan for" in log_c.read_text(errors="replace"), START_TIMEOUT_S, f"{label}: c plans")
    planned_at = time.monotonic()
    wait_until(lambda: "API ready" in log_c.read_text(errors="replace"), START_TIMEOUT_S * 3, f"{label}: c loads",
               poll_s=0.05)
    ready_at = time.monotonic()
    status = _status(hosts["c"], homes["c"])
    for name in "abc":
        started.extra_pids += [p["pid"] for p in _status(hosts[name], homes[name])["processes"]]
    return {"load_s": ready_at - planned_at, "startup_s": ready_at - started_at, "workers_start_s": seeding_s,
            "rx_bytes": {n: _rx_bytes(hosts[n]) - rx_before[n] for n in "ab"},
            "tunnel_bytes_to_peer": {p["name"]: p["bytes_to_peer"] for p in status["peers"]},
            "plan": [(n["name"], n["layers"], n["weights_bytes"]) for n in status["serving"]["plan"]["nodes"]]}


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    stock = report["mesh stock"]
    table = Table(title=f"load: {report['model']} ({report['model_bytes'] / 1e6:.0f} MB), 3 hosts, c serves")
    for col in ("setup", "load s", "vs mesh stock", "c start→API s", "MB into a", "MB into b", "tunnel MB c→a",
                "tunnel MB c→b", "workers' start s"):
        table.add_column(col, justify="left" if col == "setup" else "right")
    for name in ("direct", "mesh stock", "mesh seeded"):
        r = report[name]
        tunnels = r.get("tunnel_bytes_to_peer", {})
        table.add_row(name, f"{r['load_s']:.1f}", f"{r['load_s'] / stock['load_s']:.2f}x", f"{r['startup_s']:.1f}",
                      f"{r['rx_bytes']['a'] / 1e6:.1f}", f"{r['rx_bytes']['b'] / 1e6:.1f}",
                      *(f"{tunnels[n] / 1e6:.2f}" if n in tunnels else "-" for n in "ab"),
                      f"{r['workers_start_s']:.1f}" if "workers_start_s" in r else "-")
    Console(width=max(Console().width, 110)).print(table)
    seeded, stock_bytes = report["mesh seeded"], sum(stock["tunnel_bytes_to_peer"].values())
    share = sum(seeded["tunnel_bytes_to_peer"].values()) / stock_bytes if stock_bytes else float("nan")
    print(f"seeded/stock: tunnel bytes {share:.2%}, load time {seeded['load_s'] / stock['load_s']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: the synthetic cache-test model)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if lacks_root():
        return 2
    from benchmarks.synthetic_model import CACHE_TEST, ensure_synthetic_model
    from mesh_sidecar.llama_build import ensure_binaries
    from tests.netns import Lab

    binaries = ensure_binaries(None, _quiet)
    model = args.model.resolve() if args.model else ensure_synthetic_model(CACHE_TEST)
    started = Started()
    workdir = Path(tempfile.mkdtemp(prefix="bench-load-"))
    report: dict[str, Any] = {"benchmark": "load", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "model": model.name, "model_bytes": model.stat().st_size, "cpu_count": os.cpu_count()}

    def body() -> int:
        for name, run in (("direct", lambda h: run_direct(h, started, workdir, binaries, model)),
                          ("mesh stock", lambda h: run_mesh(h, started, workdir, model, False, "stock")),
                          ("mesh seeded", lambda h: run_mesh(h, started, workdir, model, True, "seeded"))):
            lab = Lab(sniff=False)  # the sniffer's per-frame loop would only compete for the CPU
            try:
                hosts = {n: lab.add_host(n) for n in "abc"}
                print(f"{name}: loading (logs in {workdir})...", flush=True)
                report[name] = run(hosts)
            finally:
                started.stop_all()
                lab.close()
        _print(report)
        write_report(report, args.json)
        return 0

    return run_benchmark(body, started, workdir)

if __name__ == "__main__":
    sys.exit(main())
