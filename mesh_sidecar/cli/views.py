"""Tables for people, built from the same JSON that `--json` prints."""

from __future__ import annotations

from typing import Any

from rich.table import Table

GB = 1e9


def _gb(n: int) -> str:
    return f"{n / GB:.3f}"


def plan_table(plan: dict[str, Any], title: str = "Plan") -> Table:
    """node, layers, weights GB, KV GB, free GB: seed 001's startup summary."""
    table = Table("node", "id", "layers", "weights GB", "KV GB", "needs GB", "free GB",
                  title=f"{title}: {plan['n_layers']} layers", title_justify="left")
    for node in plan["nodes"]:
        start, end = node["layers"]
        output = " + output" if node.get("output_bytes") else ""
        table.add_row(node["name"], node["id"][:8], f"[{start}, {end}){output}", _gb(node["weights_bytes"]),
                      _gb(node["kv_bytes"]), _gb(node["needed_bytes"]), _gb(node["free_bytes"]))
    for node in plan.get("left_out", []):
        table.add_row(node["name"], node["id"][:8], "left out (too small)", "-", "-", "-", _gb(node["free_bytes"]))
    for node in plan.get("refused", []):
        table.add_row(node["name"], node["id"][:8], f"refused: {node['reason']}", "-", "-", "-", _gb(node["free_bytes"]))
    return table
