"""Scorecard: the decode, relay and load benchmarks in one run, checked against the performance goals.

Runs, one after the other, each as its own process with its JSON kept in this run's directory:

- ``benchmarks.decode`` on the default model (SmolLM2 135M, the mesh's worst case: the least
  compute per token to hide its per-token cost), unshaped, with the b2b setup and 4 concurrent
  streams (``decode``), then on the 20 ms profile with the b2b setup (``decode-20ms``);
- ``benchmarks.decode`` on the synthetic 1.25 GB model (``bench-1gb``), unshaped and 5 ms
  (``decode-1gb``): decode tok/s and time to first token;
- ``benchmarks.relay`` on the product's QUIC library (aioquic), once with 1500-byte links
  (Ethernet) and once with 9000-byte ones (jumbo frames);
- ``benchmarks.load`` with the synthetic 1.25 GB model (``bench-1gb``), stock vs. seeded.

Each prints its own tables as it goes. Then one table: every goal, the figure this run measured,
and whether the figure meets it. A benchmark that fails leaves its goals without a figure
(its logs are kept, see its output) and the others still run. Nothing here is asserted anywhere;
the figures depend on the machine and on what else runs on it.

Run as root: ``.venv/bin/python -m benchmarks.scorecard [--decode-reps N] [--n-predict N]
[--decode-1gb-reps N] [--n-predict-1gb N] [--relay-mb N] [--load-reps N] [--json PATH]``. With the
defaults, about 20 minutes on 2 cores once builds and models are cached (an estimate from short
runs of its parts, not yet timed whole: decode 4, decode-20ms 4, decode-1gb 8, relay and load 4).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.report import make_table, wide_console, write_report
from benchmarks.setup import REPO_ROOT, lacks_root
from mesh_sidecar.environment import DEFAULT_QUIC_LIBRARY

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "scorecard.json"
RELAY_MTUS = (1500, 9000)
STREAMS = 4  # the concurrent streams of the aggregate decode goal
Reports = dict[str, dict[str, Any]]  # a run's name -> its JSON report


@dataclass(frozen=True)
class Goal:
    """One performance goal: a figure read from the runs' reports, and the bound it must meet."""

    name: str
    bound: float
    at_least: bool  # the figure must be >= bound (else <= bound)
    figure: Callable[[Reports], float | None]

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.bound if self.at_least else value <= self.bound

    def describe_bound(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.bound:g}"


def _decode_figure(run: str, profile: str, key: str) -> Callable[[Reports], float | None]:
    """``key`` of ``profile``'s entry in the decode report of ``run`` (a ratio decode.py computed)."""
    def figure(reports: Reports) -> float | None:
        for entry in reports.get(run, {}).get("profiles", []):
            if entry.get("profile") == profile and key in entry:
                return entry[key]
        return None
    return figure


def _relay_gbit_s(mtu: int) -> Callable[[Reports], float | None]:
    def figure(reports: Reports) -> float | None:
        report = reports.get(f"relay-{mtu}", {})
        for label, library in report.get("libraries", {}).items():
            if library == DEFAULT_QUIC_LIBRARY:
                return report["paths"][f"tunnel {label}"]["bulk_gbit_s"]["median"]
        return None
    return figure


def _seeded_over_stock(measure: Callable[[dict[str, Any]], float]) -> Callable[[Reports], float | None]:
    def figure(reports: Reports) -> float | None:
        load = reports.get("load")
        if not load or "mesh seeded" not in load:
            return None
        stock = measure(load["mesh stock"])
        return measure(load["mesh seeded"]) / stock if stock else None
    return figure


GOALS = (
    # The 135M model is the worst case for the mesh: its tokens take the least compute, so the
    # fixed per-token cost of the tunnels weighs the most.
    Goal("decode tok/s mesh/direct, 135M (worst case), unshaped veth", 0.95, True,
         _decode_figure("decode", "unshaped", "decode_ratio_mesh_over_direct")),
    Goal("decode tok/s mesh/direct, 135M (worst case), +20 ms one way", 0.95, True,
         _decode_figure("decode-20ms", "20ms", "decode_ratio_mesh_over_direct")),
    Goal(f"aggregate decode tok/s mesh/direct, {STREAMS} streams, 135M, unshaped veth", 0.95, True,
         _decode_figure("decode", "unshaped", "aggregate_ratio_mesh_over_direct")),
    # Every profile a --b2b run covers (see _runs).
    Goal("decode tok/s b2b/stock mesh, 135M, unshaped veth", 1.0, True,
         _decode_figure("decode", "unshaped", "b2b_over_stock")),
    Goal("decode tok/s b2b/stock mesh, 135M, +20 ms one way", 1.0, True,
         _decode_figure("decode-20ms", "20ms", "b2b_over_stock")),
    Goal("decode tok/s mesh/direct, 1 GB, unshaped veth", 0.95, True,
         _decode_figure("decode-1gb", "unshaped", "decode_ratio_mesh_over_direct")),
    Goal("decode tok/s mesh/direct, 1 GB, +5 ms one way", 0.95, True,
         _decode_figure("decode-1gb", "5ms", "decode_ratio_mesh_over_direct")),
    Goal("TTFT mesh/direct, 1 GB, unshaped veth", 1.10, False,
         _decode_figure("decode-1gb", "unshaped", "ttft_ratio_mesh_over_direct")),
    Goal("TTFT mesh/direct, 1 GB, +5 ms one way", 1.10, False,
         _decode_figure("decode-1gb", "5ms", "ttft_ratio_mesh_over_direct")),
    *(Goal(f"relay bulk Gbit/s ({DEFAULT_QUIC_LIBRARY}), MTU {mtu}", 1.0, True, _relay_gbit_s(mtu))
      for mtu in RELAY_MTUS),
    Goal("load: weight bytes over tunnels, seeded/stock", 0.05, False,
         _seeded_over_stock(lambda setup: sum(setup["tunnel_bytes_to_peer"].values()))),
    Goal("load: load time, seeded/stock", 0.2, False, _seeded_over_stock(lambda setup: setup["load_s"])),
)


def evaluate(reports: Reports) -> list[dict[str, Any]]:
    """One row per goal: its bound, this run's figure (None if its benchmark failed) and whether it is met."""
    rows = []
    for goal in GOALS:
        value = goal.figure(reports)
        rows.append({"goal": goal.name, "bound": goal.describe_bound(), "figure": value, "met": goal.met(value)})
    return rows


def greedy_texts_identical(reports: Reports) -> bool | None:
    """Whether direct and mesh decoded the same single-stream text in every decode profile that ran."""
    profiles = [p for name, report in reports.items() if name.startswith("decode")
                for p in report.get("profiles", []) if "greedy_texts_identical" in p]
    return all(p["greedy_texts_identical"] for p in profiles) if profiles else None


def _runs(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each benchmark's module and arguments (all but ``--json``), by the name its report goes under."""
    decode = ["benchmarks.decode", "--reps", str(args.decode_reps), "--n-predict", str(args.n_predict)]
    # Concurrent streams on the unshaped link only: at +20 ms their rounds would add minutes.
    return {
        "decode": [*decode, "--profiles", "unshaped", "--b2b", "--streams", str(STREAMS)],
        "decode-20ms": [*decode, "--profiles", "20ms", "--b2b"],
        # Random weights never pick end-of-text, so every answer runs to --n-predict: a shorter one here.
        "decode-1gb": ["benchmarks.decode", "--model", "bench-1gb", "--profiles", "unshaped,5ms",
                       "--reps", str(args.decode_1gb_reps), "--n-predict", str(args.n_predict_1gb)],
        **{f"relay-{mtu}": ["benchmarks.relay", "--libraries", DEFAULT_QUIC_LIBRARY, "--mtu", str(mtu),
                            "--bulk-mb", str(args.relay_mb)] for mtu in RELAY_MTUS},
        "load": ["benchmarks.load", "--model", args.load_model, "--reps", str(args.load_reps)],
    }


def _print(rows: list[dict[str, Any]], texts_identical: bool | None, elapsed: dict[str, float]) -> None:
    table = make_table("performance goals, one run", ("goal", "bound", "this run", "met"))
    for row in rows:
        value, met = row["figure"], row["met"]
        table.add_row(row["goal"], row["bound"], "no figure" if value is None else f"{value:.4g}",
                      {True: "yes", False: "no", None: "-"}[met])
    wide_console(100).print(table)
    answer = {True: "yes", False: "NO", None: "no figure"}[texts_identical]
    print(f"greedy text mesh == direct in every decode profile: {answer}")
    print("minutes per benchmark: " + ", ".join(f"{name} {s / 60:.1f}" for name, s in elapsed.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scorecard", description=__doc__.split("\n")[0])
    parser.add_argument("--decode-reps", type=int, default=5)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--decode-1gb-reps", type=int, default=5)
    parser.add_argument("--n-predict-1gb", type=int, default=64)
    parser.add_argument("--relay-mb", type=int, default=100)
    parser.add_argument("--load-model", default="bench-1gb", help="a GGUF or a synthetic preset (default bench-1gb)")
    parser.add_argument("--load-reps", type=int, default=2)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if lacks_root():
        return 2

    directory = args.json.parent / f"{args.json.stem}-runs"
    directory.mkdir(parents=True, exist_ok=True)
    reports: Reports = {}
    elapsed: dict[str, float] = {}
    failed: list[str] = []
    runs = _runs(args)
    paths = {name: directory / f"{name}.json" for name in runs}
    for name, arguments in runs.items():
        report = paths[name]
        command = [sys.executable, "-m", *arguments, "--json", str(report)]
        print(f"\n== {name}: {' '.join(command[1:])}", flush=True)
        report.unlink(missing_ok=True)  # an earlier run's figures must not stand in for this one's
        began = time.monotonic()
        status = subprocess.run(command, check=False, cwd=REPO_ROOT).returncode
        elapsed[name] = time.monotonic() - began
        if report.exists():  # decode writes the profiles that ran even when another failed
            reports[name] = json.loads(report.read_text())
        if status != 0:
            failed.append(name)
            print(f"== {name} failed (exit {status}): goals it measured get no figure", file=sys.stderr, flush=True)

    rows = evaluate(reports)
    texts_identical = greedy_texts_identical(reports)
    _print(rows, texts_identical, elapsed)
    write_report({"benchmark": "scorecard", "date": datetime.now(UTC).isoformat(timespec="seconds"),
                  "goals": rows, "greedy_texts_identical": texts_identical, "failed": failed,
                  "minutes": {name: s / 60 for name, s in elapsed.items()},
                  "reports": {name: str(paths[name]) for name in reports}}, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
