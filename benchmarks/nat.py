"""NAT benchmark: machines in different homes, direct (punched) and relayed, in the NAT lab.

The lab of ``tests/helpers/natlab.py``: a public member p on an "internet" bridge and two
homes behind masquerade routers, h1 and h2; h2 serves the API with the model split
over the three. Run twice on fresh labs: routers that keep one mapping per local
port (h1 and h2 punch through, ``direct``), and h2's router picking a new port per
destination (they stay ``relayed`` through p). For each: the time from both home
nodes having joined p to each seeing the other on a path (from the nodes' own
event clocks), decode tok/s of a greedy completion from h2 (llama-server's timings),
and on p the sidecar's CPU seconds and the bytes it relayed meanwhile, so CPU
seconds per GB relayed. Decode runs the client of ``benchmarks/turns.py``.

Run as root: ``.venv/bin/python -m benchmarks.nat [--reps N] [--n-predict N] [--json PATH]``.
Figures are printed and written as JSON; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.report import write_report
from benchmarks.setup import Started, cpu_seconds, lacks_root, run_benchmark
from benchmarks.turns import PROMPT, run_client
from tests.helpers.natlab import NatMesh, peer, start_nat_mesh, stop_nat_mesh
from tests.helpers.netns import API_PORT

GIB_BYTES = 1 << 30
DEFAULT_JSON = Path("benchmarks/results/nat.json")


def measure(mesh: NatMesh, reps: int, n_predict: int) -> dict[str, Any]:
    p = mesh.nodes["p"]
    spec = {"prompt": PROMPT, "n_predict": n_predict, "reps": reps}
    relay_before = p.status()["mesh"]["relay"]["relayed_bytes"]
    cpu_before = cpu_seconds(p.proc.pid)
    watched = [(name, node.proc, node.output) for name, node in mesh.nodes.items()]
    result = run_client(mesh.homes[1].host, spec, {"mesh": {"port": API_PORT}}, watched)["mesh"]
    cpu_s = cpu_seconds(p.proc.pid) - cpu_before
    relayed_bytes = p.status()["mesh"]["relay"]["relayed_bytes"] - relay_before
    row = peer(mesh.nodes["h2"], "h1")
    return {
        "path": row["path"], "via": row["via"],
        "joined_to_path_s": round(mesh.joined_to_path_s, 2),
        "decode_tok_s": round(statistics.median(r["timings"]["predicted_per_second"] for r in result["reps"]), 2),
        "relay_sidecar_cpu_s": round(cpu_s, 2),
        "relayed_bytes": relayed_bytes,
        "relay_cpu_s_per_gb": round(cpu_s / (relayed_bytes / GIB_BYTES), 1) if relayed_bytes else None,
    }


def _print(rows: dict[str, dict[str, Any]]) -> None:
    print(f"{'lab':<10} {'path':<14} {'join->path s':>12} {'decode tok/s':>12} {'p CPU s':>8} "
          f"{'relayed MB':>10} {'relay CPU s/GB':>14}")
    for lab, r in rows.items():
        path = r["path"] + (f" via {r['via']}" if r["via"] else "")
        per_gb = "-" if r["relay_cpu_s_per_gb"] is None else f"{r['relay_cpu_s_per_gb']:.1f}"
        print(f"{lab:<10} {path:<14} {r['joined_to_path_s']:>12.1f} {r['decode_tok_s']:>12.1f} "
              f"{r['relay_sidecar_cpu_s']:>8.2f} {r['relayed_bytes'] / 1e6:>10.1f} {per_gb:>14}")
    if rows.get("relayed") and rows.get("punched"):
        relayed, direct = rows["relayed"], rows["punched"]
        print(f"relayed/direct decode: {relayed['decode_tok_s'] / direct['decode_tok_s']:.2f}")
        if relayed["relayed_bytes"]:
            # p serves layers in both labs: what relaying added to its sidecar's CPU, per GB relayed.
            extra_s = relayed["relay_sidecar_cpu_s"] - direct["relay_sidecar_cpu_s"]
            print(f"p's extra sidecar CPU when relaying: {extra_s:.2f} s, "
                  f"{extra_s / (relayed['relayed_bytes'] / GIB_BYTES):.0f} s per GB relayed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n-predict", type=int, default=64)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if lacks_root():
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="mesh-nat-bench-"))
    running: list[NatMesh] = []

    def body() -> int:
        rows = {}
        for lab, random_ports in (("punched", False), ("relayed", True)):
            mesh = start_nat_mesh(workdir / lab, random_ports=random_ports)
            running.append(mesh)
            rows[lab] = measure(mesh, args.reps, args.n_predict)
            stop_nat_mesh(running.pop())
        _print(rows)
        write_report({"reps": args.reps, "n_predict": args.n_predict, "labs": rows}, args.json)
        return 0

    return run_benchmark(body, Started(), workdir, lambda: [stop_nat_mesh(m) for m in running])


if __name__ == "__main__":
    sys.exit(main())
