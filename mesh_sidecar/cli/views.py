"""Tables for people, built from the same JSON that `--json` prints."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ..units import format_gib


def plan_table(plan: dict[str, Any], title: str = "Plan") -> Table:
    """node, layers, weights GiB, KV GiB, free GiB: seed 001's startup summary."""
    table = Table("node", "id", "layers", "weights GiB", "KV GiB", "needs GiB", "free GiB",
                  title=f"{title}: {plan['n_layers']} layers", title_justify="left")
    for node in plan["nodes"]:
        start, end = node["layers"]
        output = " + output" if node.get("output_bytes") else ""
        table.add_row(node["name"], node["id"][:8], f"[{start}, {end}){output}", format_gib(node["weights_bytes"]),
                      format_gib(node["kv_bytes"]), format_gib(node["needed_bytes"]),
                      format_gib(node["free_bytes"]))
    for node in plan.get("left_out", []):
        table.add_row(node["name"], node["id"][:8], "left out (too small)", "-", "-", "-",
                      format_gib(node["free_bytes"]))
    for node in plan.get("refused", []):
        table.add_row(node["name"], node["id"][:8], f"refused: {node['reason']}", "-", "-", "-",
                      format_gib(node["free_bytes"]))
    return table
