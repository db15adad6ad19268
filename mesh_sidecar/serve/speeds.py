"""How much slower each worker runs now than when it was measured: the traffic's correction to the speeds.

Pure, over figures the serving loop passes in. Each member measures its devices once, when its
rpc-server starts (llama/calibration.py), and announces the speed in gossip; that ranks the
devices before any traffic. A device can become slower later (thermal limits, another program,
a CPU quota), and only the traffic shows it: after each request the serving node knows how long
llama-server decoded and how many tokens it made, and how long each worker owed it replies over
that window (net/reply_waits.py). A worker's time per token, less its link's round trip, over
the weight bytes its layers hold is its time per byte. Only a request that ran alone counts
(batched requests share the workers' time) and only within one plan: a time per byte depends
on the model and on each stage's fixed costs, so each plan has its own baseline, the least of
the worker's moving average on it. The average now over that baseline is the slowdown, and the
planner divides the announced speed by it. A new plan starts from the slowdown its worker had
(its first measurement is taken as that much slower than the baseline), so a worker planned
slower stays planned slower until it measures faster. Under SLOWDOWN_FLOOR the slowdown counts
as 1 (noise), so only a real change moves layers.
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
        self._carried: dict[bytes, float] = {}  # each worker's slowdown when the plan last changed
        self._plan: tuple[object, ...] | None = None  # the plan the baselines belong to

    def observe(self, plan: Plan, own_id: bytes, tokens: int, owed_s: Mapping[bytes, float],
                links_s: Mapping[bytes, float]) -> None:
        """One request's decode, alone on ``plan``: ``tokens`` made while each worker owed replies ``owed_s``
        seconds in all; ``links_s``: each worker's round trip (a token crosses each link once)."""
        if tokens < MIN_TOKENS_OBSERVED:
            return
        key = (plan.model, *((n.node_id, n.device, n.start, n.end) for n in plan.nodes))
        if key != self._plan:
            self._carried = {node_id: self.slowdown(node_id) for node_id in self._workers}
            self._workers.clear()
            self._plan = key
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
                self._workers[node_id] = _Worker(per_byte_s / self._carried.get(node_id, 1.0), per_byte_s)
                continue
            worker.average_s_per_byte = NEWEST_WEIGHT * per_byte_s + (1 - NEWEST_WEIGHT) * worker.average_s_per_byte
            worker.baseline_s_per_byte = min(worker.baseline_s_per_byte, worker.average_s_per_byte)

    def slowdown(self, node_id: bytes) -> float:
        """How many times slower than its baseline ``node_id`` runs now (1.0: as measured, or never seen)."""
        worker = self._workers.get(node_id)
        if worker is None:
            return self._carried.get(node_id, 1.0)
        ratio = worker.average_s_per_byte / worker.baseline_s_per_byte
        return ratio if ratio >= SLOWDOWN_FLOOR else 1.0

    def forget(self, node_id: bytes) -> None:
        """A member left, or its rpc-server started again (it measured itself afresh)."""
        self._workers.pop(node_id, None)
        self._carried.pop(node_id, None)

    def to_json(self) -> dict[str, float]:
        """Each worker seen: its slowdown, for status."""
        return {node_id.hex(): round(self.slowdown(node_id), 2) for node_id in {*self._workers, *self._carried}}
