"""Speculative benchmark: over slow links, does a local draft beat plain RPC?

Three hosts in network namespaces, the delay switch adding 0, 5 and 20 ms one
way (``tests/helpers/netns.py``). The target is the padded model of
``benchmarks/spec_models.py`` (the real SmolLM2 blocks plus damped copies: 60
blocks, one tokenizer); the draft is SmolLM2 itself, on c's CPU. Per profile,
in one run and on the same lab:

- direct: stock llama.cpp ``--rpc`` over TCP to the three rpc-servers, no draft;
- mesh: the mesh, plain;
- mesh + draft: the mesh with ``--draft-model`` (its draft length follows the RTT).

Prints decode tok/s (median of ``--reps``), the ratio to direct, and the draft
acceptance rate llama-server reports; writes JSON. The acceptance rate belongs
to this constructed target/draft pair (see spec_models.py), not to real models.

Run as root: ``.venv/bin/python -m benchmarks.speculative [--reps N] [--n-predict N] [--profiles 0ms,5ms,20ms]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.report import make_table, publish, summary, wide_console
from benchmarks.setup import REPO_ROOT, Started, lacks_root, quiet, run_benchmark
from benchmarks.turns import PROMPT, run_direct, run_mesh

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "speculative.json"
DEFAULT_PROFILES = "0ms,5ms,20ms"


def _acceptance(result: dict[str, Any]) -> float | None:
    drafted = sum(r["timings"].get("draft_n", 0) for r in result["reps"])
    accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in result["reps"])
    return accepted / drafted if drafted else None


def run_profile(profile: str, target: Path, draft: Path, spec: dict[str, Any], workdir: Path,
                started: Started) -> dict[str, Any]:
    from tests.helpers.netns import LINK_PROFILES, Lab

    workdir.mkdir(parents=True)
    lab = Lab(**LINK_PROFILES[profile], sniff=False)
    entry: dict[str, Any] = {"profile": profile}
    try:
        hosts = {name: lab.add_host(name) for name in "abc"}
        print(f"[{profile}] mesh, plain...", flush=True)
        plain, order, plain_info = run_mesh(hosts, started, workdir, spec, target, ("--speculation", "off"),
                                            "plain")
        started.stop_all()
        print(f"[{profile}] mesh + draft...", flush=True)
        drafted, _, _ = run_mesh(hosts, started, workdir, spec, target, ("--draft-model", str(draft)), "draft")
        speculation = drafted["status_after"]["serving"]["speculation"]
        started.stop_all()
        print(f"[{profile}] direct, plain...", flush=True)
        # The plain mesh's own argv (its split and context size, its rpc-servers' flags), over TCP.
        direct, _ = run_direct(hosts, started, workdir, spec, order, plain_info)
        started.stop_all()
    finally:
        started.stop_all()
        lab.close()
    for name, result in (("direct", direct), ("mesh", plain), ("mesh + draft", drafted)):
        entry[name] = {**summary(result), "draft_acceptance": _acceptance(result)}
    entry["speculation"] = speculation
    base = entry["direct"]["decode_tok_s"]["median"]
    for name in ("mesh", "mesh + draft"):
        entry[name]["ratio_to_direct"] = entry[name]["decode_tok_s"]["median"] / base
    entry["greedy_texts_identical"] = len({entry[n]["text"] for n in ("direct", "mesh", "mesh + draft")}) == 1
    return entry


def _print(report: dict[str, Any]) -> None:
    table = make_table(f"speculative: target {report['target']}, draft {report['draft']}, "
                       f"{report['n_predict']} tokens, {report['reps']} reps (medians)",
                       ("profile", "direct tok/s", "mesh tok/s", "mesh/direct", "mesh+draft tok/s", "mesh+draft/direct",
                        "draft length", "acceptance", "same text"))
    for e in report["profiles"]:
        d, m, s = e["direct"], e["mesh"], e["mesh + draft"]
        acceptance = s["draft_acceptance"]
        table.add_row(e["profile"], f"{d['decode_tok_s']['median']:.1f}", f"{m['decode_tok_s']['median']:.1f}",
                      f"{m['ratio_to_direct']:.2f}", f"{s['decode_tok_s']['median']:.1f}",
                      f"{s['ratio_to_direct']:.2f}", str(e["speculation"]["draft_max"]),
                      "-" if acceptance is None else f"{acceptance:.0%}",
                      "yes" if e["greedy_texts_identical"] else "NO")
    wide_console(140).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--profiles", default=DEFAULT_PROFILES)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if lacks_root():
        return 2
    from benchmarks.spec_models import ensure_padded_target
    from mesh_sidecar.llama.build import ensure_binaries
    from mesh_sidecar.llama.model import ensure_model

    ensure_binaries(None, quiet)  # built now, not under a node's start timeout
    draft = ensure_model(None, quiet)
    target = ensure_padded_target(draft)
    spec = {"prompt": PROMPT, "n_predict": args.n_predict, "reps": args.reps}
    started = Started()
    workdir = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    report: dict[str, Any] = {"benchmark": "speculative", "date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "target": target.name, "draft": draft.name, "n_predict": args.n_predict,
                              "reps": args.reps, "cpu_count": os.cpu_count(), "profiles": []}

    def body() -> int:
        for profile in args.profiles.split(","):
            report["profiles"].append(run_profile(profile, target, draft, spec, workdir / profile, started))
        return publish(report, _print, args.json)

    return run_benchmark(body, started, workdir)


if __name__ == "__main__":
    sys.exit(main())
