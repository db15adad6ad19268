"""How much slower each worker runs now than when it was measured: the traffic's correction to the speeds.

Pure, over figures the serving loop passes in. Each member measures its devices once, when its
rpc-server starts (llama/calibration.py), and announces the speed in gossip; that ranks the
devices before any traffic. A device can become slower later (thermal limits, another program,
a CPU quota), and only the traffic shows it: after each request the serving node knows how long
llama-server decoded and how many tokens it made, and how long each worker owed it replies over
that window (net/reply_waits.py). A worker's time per token, less its link's round trip, over
the weight bytes its layers hold is its time per byte. The least of its moving average since it
joined the plan is its baseline (its layers and overheads as they were when things went well);
the average now over that baseline is its slowdown, and the planner divides the announced speed
by it. Under SLOWDOWN_FLOOR it counts as 1 (noise), so only a real change moves layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .planner import Plan

# Requests shorter than this say little about a worker's speed (prompt work blurs the window).
MIN_TOKENS_OBSERVED = 8
NEWEST_WEIGHT = 0.5  # of the newest request, in each worker's moving average
SLOWDOWN_FLOOR = 1.5  # slower than its baseline by less than this: as measured


@dataclass
class _Worker:
    baseline_s_per_byte: float
    average_s_per_byte: float


class ObservedSpeeds:
    """Each worker's slowdown against its own baseline, from the decode windows of finished requests."""

    def __init__(self) -> None:
        self._workers: dict[bytes, _Worker] = {}

    def observe(self, plan: Plan, own_id: bytes, tokens: int, owed_s: Mapping[bytes, float],
                links_s: Mapping[bytes, float]) -> None:
        """One request's decode: ``tokens`` made while each worker owed replies ``owed_s`` seconds in all;
        ``links_s``: each worker's round trip (a token crosses each link once)."""
        if tokens < MIN_TOKENS_OBSERVED:
            return
        held: dict[bytes, int] = {}
        for node in plan.nodes:
            if node.node_id != own_id:
                held[node.node_id] = held.get(node.node_id, 0) + node.weights_bytes
        for node_id, weights_bytes in held.items():
            if node_id not in owed_s or weights_bytes <= 0:
                continue
            per_token_s = owed_s[node_id] / tokens - links_s.get(node_id, 0.0)
            if per_token_s <= 0:
                continue
            per_byte_s = per_token_s / weights_bytes
            worker = self._workers.get(node_id)
            if worker is None:
                self._workers[node_id] = _Worker(per_byte_s, per_byte_s)
                continue
            worker.average_s_per_byte = NEWEST_WEIGHT * per_byte_s + (1 - NEWEST_WEIGHT) * worker.average_s_per_byte
            worker.baseline_s_per_byte = min(worker.baseline_s_per_byte, worker.average_s_per_byte)

    def slowdown(self, node_id: bytes) -> float:
        """How many times slower than its baseline ``node_id`` runs now (1.0: as measured, or never seen)."""
        worker = self._workers.get(node_id)
        if worker is None:
            return 1.0
        ratio = worker.average_s_per_byte / worker.baseline_s_per_byte
        return ratio if ratio >= SLOWDOWN_FLOOR else 1.0

    def forget(self, node_id: bytes) -> None:
        """A member left, or its rpc-server started again (it measured itself afresh)."""
        self._workers.pop(node_id, None)

    def to_json(self) -> dict[str, float]:
        """Each worker seen: its slowdown, for status."""
        return {node_id.hex(): round(self.slowdown(node_id), 2) for node_id in self._workers}
