"""The benchmarks' report: figures summarised from the client's results, ratios between setups, the
JSON beside the printed tables, and the table rows every benchmark prints alike.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(result: dict) -> dict[str, Any]:
    reps = result["reps"]
    texts = {r["text"] for r in reps} | {r["stream_text"] for r in reps} | {result["warmup_text"]}
    summary = {
        "prompt_tokens": reps[0]["prompt_tokens"],
        "completion_tokens": [r["completion_tokens"] for r in reps],
        "prompt_tok_s": stats([r["timings"]["prompt_per_second"] for r in reps]),
        "decode_tok_s": stats([r["timings"]["predicted_per_second"] for r in reps]),
        "prompt_ms": stats([r["timings"]["prompt_ms"] for r in reps]),
        "ttft_ms": stats([r["ttft_ms"] for r in reps]),
        "text": reps[0]["text"],
        "texts_all_identical": len(texts) == 1,
    }
    if result["concurrent"]:
        summary["streams"] = _streams_summary(result["concurrent"]["reps"])
    return summary


def _streams_summary(reps: list[dict]) -> dict[str, Any]:
    """Aggregate decode rate of the concurrent streams: tokens all of them generated over the wall time
    from sending the first to receiving the last answer (their prompts' evaluation included)."""
    tokens = [[s["timings"]["predicted_n"] for s in r["streams"]] for r in reps]
    return {
        "count": len(reps[0]["streams"]),
        "completion_tokens": tokens,
        "wall_s": stats([r["wall_s"] for r in reps]),
        "aggregate_tok_s": stats([sum(t) / r["wall_s"] for t, r in zip(tokens, reps, strict=True)]),
        "texts": [s["text"] for s in reps[0]["streams"]],
    }


def _tokens(result: dict) -> int:
    """Tokens generated in the timed repetitions: a plain and a streamed request each."""
    return sum(r["completion_tokens"] for r in result["reps"]) * 2


def sidecar_cpu_ms_per_token(result: dict, cpu_s: dict[str, float]) -> dict[str, float]:
    """Each node's sidecar CPU (``cpu_s``, over the warm-up and the timed repetitions of ``result``) per token."""
    tokens = _tokens(result) * (len(result["reps"]) + 1) / len(result["reps"])
    return {name: 1000 * seconds / tokens for name, seconds in cpu_s.items()}


def tunnel_bytes(result: dict) -> dict[str, Any]:
    """Bytes per generated token on each of c's tunnels over the timed repetitions."""
    tokens = _tokens(result)
    before = {p["name"]: p for p in result["status_before"]["peers"]}
    rows = {}
    for peer in result["status_after"]["peers"]:
        b = before[peer["name"]]
        to_peer = peer["bytes_to_peer"] - b["bytes_to_peer"]
        from_peer = peer["bytes_from_peer"] - b["bytes_from_peer"]
        # The command count also covers the warm-up requests: one more round of each.
        tokens_with_warmup = tokens * (len(result["reps"]) + 1) / len(result["reps"])
        rows[f"c<->{peer['name']}"] = {"bytes_to_peer": to_peer, "bytes_from_peer": from_peer,
                                     "tokens": tokens, "to_peer_per_token": to_peer / tokens,
                                     "from_peer_per_token": from_peer / tokens,
                                     "rpc_commands_per_token": result["rpc_commands"][peer["name"]]
                                     / tokens_with_warmup}
    return rows


def publish(report: dict[str, Any], print_tables: Callable[[dict[str, Any]], None], path: Path,
            failed: bool = False) -> int:
    """The tables, then the JSON beside them; the exit status (1 if a part ``failed``)."""
    print_tables(report)
    write_report(report, path)
    return 1 if failed else 0


def write_report(report: dict[str, Any], path: Path) -> None:
    """The JSON beside the printed tables."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {path}")


def round_ratios(setup: dict, over: dict, figure: Callable[[dict], float]) -> dict[str, float]:
    """``figure`` of each round of ``setup`` over that of the same round of ``over``: median and quartiles."""
    ratios = [figure(s) / figure(o) for s, o in zip(setup["reps"], over["reps"], strict=True)]
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median": median, "q1": q1, "q3": q3}


def ratio_of_medians(entry: dict[str, Any], setup: str, over: str, *figure: str) -> float:
    """Median of ``figure`` (a path of keys into a setup's summary) in ``setup`` over that in ``over``."""
    def median(name: str) -> float:
        value = entry[name]
        for key in figure:
            value = value[key]
        return value["median"]
    return median(setup) / median(over)


def wide_console(min_width: int) -> Console:
    """A rich console at least ``min_width`` columns wide (wider on a wider terminal), so that a table
    keeps its shape in a log file or a narrow terminal."""
    from rich.console import Console

    return Console(width=max(Console().width, min_width))


def make_table(title: str, columns: Iterable[str], left: int = 1) -> Table:
    """A rich table of ``columns``: the first ``left`` (what a row is) left-aligned, the figures right."""
    from rich.table import Table

    made = Table(title=title)
    for i, column in enumerate(columns):
        made.add_column(column, justify="left" if i < left else "right")
    return made


def failed_row(rows: Table, name: str) -> None:
    """The row of a part that failed: its name, "failed", the other cells empty."""
    rows.add_row(name, "failed", *[""] * (len(rows.columns) - 2))
