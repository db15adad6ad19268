"""Tables for people, built from the same JSON that `--json` prints."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ..units import format_gib


def plan_table(plan: dict[str, Any], title: str = "Plan") -> Table:
    """node, layers, weights GiB, KV GiB, free GiB: seed 001's startup summary; then the model tiers."""
    model = f"{plan['model']}, " if plan.get("model") else ""
    refused = [f"{node['name']} refused: {node['detail']}." for node in plan.get("refused", [])]
    table = Table("node", "id", "layers", "weights GiB", "KV GiB", "needs GiB", "free GiB",
                  title=f"{title}: {model}{plan['n_layers']} layers", title_justify="left",
                  caption="\n".join(filter(None, [_tiers_caption(plan), *refused])) or None, caption_justify="left")
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


def _tiers_caption(plan: dict[str, Any]) -> str | None:
    """With several --model tiers: what each needs against what the mesh offers."""
    tiers = plan.get("tiers", [])
    if len(tiers) < 2:
        return None
    offered = sum(node["free_bytes"] for node in plan["nodes"] + plan.get("left_out", []))
    listed = "; ".join(f"{tier['model']} needs {format_gib(tier['needs_bytes'])} GiB"
                       f"{'' if tier['fits'] else ' (does not fit)'}" for tier in tiers)
    return f"Tiers, largest first: {listed}. The mesh offers {format_gib(offered)} GiB."
