"""llama-server started on a plan: its command line (the model, the --rpc endpoints in the plan's order:
our own rpc-server on loopback, a tunnel port per worker; the tensor split, the context and cache types,
speculation, the projector), what the user is told of the plan (``PlanAnnouncement``), and when a failed
start is tried again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..llama.build import LlamaBinaries
from ..llama.launch import llama_server_argv
from ..llama.projector import Projector
from .options import ServeOptions
from .planner import Plan
from .speculation import Speculation

# A llama-server that dies while loading (a tunnel torn down under it, say) is
# started again after this, doubling per failure in a row up to the maximum.
START_RETRY_FIRST_S = 2.0
START_RETRY_MAX_S = 60.0


@dataclass(frozen=True)
class PlanAnnouncement:
    """Said to the user when llama-server starts on a new plan; the CLI draws it as a table."""

    plan_json: dict[str, Any]  # Plan.to_json()

    def __str__(self) -> str:
        """One line, for the recent events (`status --json`, the dashboard) and logs."""
        nodes = ", ".join(f"{n['name']} [{n['layers'][0]}, {n['layers'][1]})" for n in self.plan_json["nodes"])
        title = f"Plan for {self.plan_json['model']}" if self.plan_json.get("model") else "Plan"
        return f"{title}: {self.plan_json['n_layers']} layers over {nodes}"


def plan_argv(binaries: LlamaBinaries, model: Path, plan: Plan, endpoint: Callable[[bytes], str], port: int, *,
              key_file: Path, options: ServeOptions, speculation: Speculation,
              projector: Projector | None) -> list[str]:
    """llama-server's command line for ``plan``: ``endpoint`` says where each member's rpc-server is reached."""
    # Alone, llama-server holds the model itself: no RPC between it and its own machine's memory.
    alone = plan.alone
    return llama_server_argv(
        binaries, model, [] if alone else [endpoint(node_id) for node_id in plan.rpc_nodes()], port,
        tensor_split=() if alone else plan.tensor_split(), api_key_file=key_file,
        extra=["--ctx-size", str(options.ctx_size), *options.kv_cache.llama_server_args(),
               *speculation.llama_server_args()], projector=None if projector is None else projector.path,
    )


def start_retry_delay(failures: int) -> float:
    """Seconds before starting llama-server again after ``failures`` failed starts in a row."""
    return min(START_RETRY_MAX_S, START_RETRY_FIRST_S * 2 ** max(0, failures - 1))
