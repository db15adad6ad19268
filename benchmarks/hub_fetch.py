"""Time to first token of a three-node split of a model named on the hub, no member holding the file at the
start, three ways (issue 52, item 3):

The serving node starts first and gives the others its ticket once it has the model, as people start a mesh.

- ``share``: the serving node downloads the file, each worker fetches only its own layers' tensors from the
  hub (Range requests) and the load sends those by hash: the product's default;
- ``whole``: every node names the model (``--model hf:...``) and downloads the whole file;
- ``push``: only the serving node downloads it; the workers (``--no-weight-cache``) get their layers over the
  LAN during the load, as before layer sharing.

The hub is tests/helpers/local_hub.py on 127.0.0.1, its link to the "home" shared by every download and
capped at ``--hub-mib-per-s`` (a home's internet link); the LAN is loopback (every tunnel on the native data
path), far faster than that link, as a home LAN is. Each node has its own hub cache, as machines do.

    .venv/bin/python -m benchmarks.hub_fetch [--preset bench-1gb] [--hub-mib-per-s 50] [--modes share,whole,push]
        [--json benchmarks/results/hub_fetch.json]

Prints a table (seconds to the first token, bytes the hub sent in all and to each worker) and writes the JSON.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.report import make_table, publish, wide_console
from benchmarks.setup import quiet
from benchmarks.synthetic_model import PRESETS, ensure_synthetic_model
from mesh_sidecar.units import MIB
from tests.helpers.local_hub import LocalHub
from tests.helpers.nodes import TICKET_LINE, LoopbackNodes
from tests.helpers.waiting import wait_until

REPO = "bench/synthetic-GGUF"
MODES = ("share", "whole", "push")
FIRST_TOKEN_TIMEOUT_S = 1800.0
POLL_S = 0.2
_FETCHED = re.compile(r"^(\S+) fetched ([\d.]+) GiB from the hub", re.MULTILINE)


def first_token_s(hub: LocalHub, file: str, mode: str, workdir: Path) -> dict[str, Any]:
    """One run of ``mode``: seconds from the nodes' start to the serving node's first token, and the bytes."""
    name = f"hf:{REPO}/{file}"
    sent_before = hub.sent_bytes
    workdir.mkdir(parents=True)
    nodes = LoopbackNodes(workdir)

    def env(node: str) -> dict[str, str]:
        return {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(workdir / f"hub-cache-{node}"), "HF_TOKEN": ""}

    worker_args = {"share": (), "whole": ("--model", name), "push": ("--no-weight-cache",)}[mode]
    started = time.monotonic()
    try:
        # As people start a mesh: the serving node first; its ticket, once it has the model, to the others.
        c = nodes.start("c", "--min-peers", "2", "--model", name, env=env("c"), serve=True, wait=False)
        wait_until(lambda: TICKET_LINE.search(c.text()) is not None or c.proc.poll() is not None,
                   FIRST_TOKEN_TIMEOUT_S, "the serving node's ticket")
        if c.proc.poll() is not None:
            raise AssertionError(f"c exited:\n{c.diagnosis()}")
        for worker in ("a", "b"):
            nodes.start(worker, "--join", c.ticket(), *worker_args, env=env(worker), wait=False)

        def answered() -> bool:
            if c.proc.poll() is not None:
                raise AssertionError(f"c exited:\n{c.diagnosis()}")
            try:
                response = httpx.post(f"http://127.0.0.1:{c.serve_port}/v1/completions", timeout=600,
                                      json={"prompt": "The", "max_tokens": 1, "temperature": 0})
            except httpx.HTTPError:
                return False
            return response.status_code == 200

        wait_until(answered, FIRST_TOKEN_TIMEOUT_S, "the serving node's first token", poll_s=POLL_S)
        elapsed_s = time.monotonic() - started
        plan = c.status()["serving"]["plan"]
        fetched = {who: float(gib) for who, gib in _FETCHED.findall(c.text())}
    finally:
        nodes.stop_all()
    return {"mode": mode, "first_token_s": round(elapsed_s, 2), "hub_sent_bytes": hub.sent_bytes - sent_before,
            "workers_fetched_gib": fetched, "plan": [(n["name"], n["layers"]) for n in plan["nodes"]]}


def print_tables(report: dict[str, Any]) -> None:
    table = make_table(f"Three-node split of {report['model_gib']:.2f} GiB ({report['preset']}), hub link "
                       f"{report['hub_mib_per_s']} MiB/s, LAN loopback",
                       ("mode", "first token (s)", "hub sent (GiB)", "each worker fetched (GiB)"))
    for run in report["runs"]:
        table.add_row(run["mode"], f"{run['first_token_s']:.1f}", f"{run['hub_sent_bytes'] / (1 << 30):.2f}",
                      ", ".join(f"{w} {g:.2f}" for w, g in run["workers_fetched_gib"].items()) or "-")
    wide_console(100).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench-1gb")
    parser.add_argument("--hub-mib-per-s", type=int, default=50, help="the hub's link to the home, all downloads")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/hub_fetch.json"))
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}, not {', '.join(sorted(unknown))}")
    model = ensure_synthetic_model(PRESETS[args.preset], quiet)
    file = f"{model.stem}-F16.gguf"
    runs = []
    with LocalHub() as hub, tempfile.TemporaryDirectory(prefix="hub-fetch-") as tmp:
        hub.add_repo(REPO, {file: model.read_bytes()})
        hub.bytes_per_s = args.hub_mib_per_s * MIB
        for mode in modes:
            runs.append(first_token_s(hub, file, mode, Path(tmp) / mode))
            print(f"{mode}: first token after {runs[-1]['first_token_s']:.1f} s", flush=True)
    report = {"preset": args.preset, "model_gib": model.stat().st_size / (1 << 30),
              "hub_mib_per_s": args.hub_mib_per_s, "runs": runs}
    return publish(report, print_tables, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
