"""How much slower each worker runs now than when it was measured: the traffic's correction to the speeds.

Pure, over figures the serving loop passes in. Each member measures its devices once, when its
rpc-server starts (llama/calibration.py), and announces the speed in gossip; that ranks the
devices before any traffic. A device can become slower later (thermal limits, another program,
a CPU quota), and only the traffic shows it: after each request the serving node knows how long
llama-server decoded and how many tokens it made, and how long each worker owed it replies over
that window (net/reply_waits.py). A worker's time per token over the weight bytes its layers hold
is its time per byte. It includes the link: the heartbeat's round trip is no measure of the data
path's (the native relay's is a tenth of it; subtracting it left noise, or less than nothing), so
a slower compute shows diluted by the link's share, and noise never makes one up.

Only a request that ran alone counts (batched requests share the workers' time), and each share
of each model has its own figures (a time per byte depends on the weights' type, and on how many
layers share a stage's fixed costs). The median of a worker's last RECENT_REQUESTS on that share
is its time now (from MIN_REQUESTS on: one request slowed by something passing moves nothing);
the least time now it ever had is its baseline. Both are medians, so noisy requests alone make no
slowdown (the least single request sits in the noise's fast tail). Now over the baseline is its
slowdown, and the planner divides the announced speed by it; under SLOWDOWN_FLOOR it counts as 1
(noise). After a replan for speed a worker's new share starts at 1 again: the plan in service is
then judged at the announced speeds, where it is no slower than the memory plan, so it stays
(replan.py: a speed replan needs 15% and waits its interval).

A speed from one calibration is one sample (llama/calibration.py: the member announces it as not
settled until a second calibration agrees). :func:`weighable_speeds` keeps a plan from weighing a
device below another on it: noise only slows a measurement, so an unsettled speed counts where no
other member is more than SAME_SPEED_RATIO faster, and is unknown (the plan goes by memory, alike)
where one is, until the member settles it or the traffic confirms it: a worker seen on
MIN_REQUESTS requests runs at least as fast as its weight bytes over its time per token
(``observed_bytes_per_s``, diluted by its link, so never an overstatement).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from .assignment import SAME_SPEED_RATIO

if TYPE_CHECKING:
    from .planner import Plan

# Requests shorter than this say little about a worker's speed (prompt work and the first token's wait blur
# the window).
MIN_TOKENS_OBSERVED = 16
# A worker's time per byte now: the median of its last few requests, once it has this many on the plan. One
# request slowed by something passing (another program starting on that machine) moves nothing.
RECENT_REQUESTS = 5
MIN_REQUESTS = 3
SLOWDOWN_FLOOR = 1.5  # slower than its baseline by less than this: as measured

K = TypeVar("K")


@dataclass(frozen=True)
class AnnouncedSpeed:
    """A member's fastest device as gossip announced it, and what the traffic showed of it."""

    bytes_per_s: float  # 0: unknown
    settled: bool  # two of its calibrations agreed (llama/calibration.py)
    observed_bytes_per_s: float | None = None  # ObservedSpeeds.observed_bytes_per_s: confirmed by traffic


def weighable_speeds(speeds: Mapping[K, AnnouncedSpeed]) -> dict[K, float]:
    """Each member's speed as plans may weigh it: settled or confirmed by traffic, as fast as announced or
    observed (the larger); unsettled, as announced where no other member is more than SAME_SPEED_RATIO faster,
    else unknown (0)."""
    confirmed = {key: max(speed.bytes_per_s, speed.observed_bytes_per_s or 0.0) for key, speed in speeds.items()
                 if speed.settled or speed.observed_bytes_per_s is not None}
    fastest = max((confirmed.get(key, speed.bytes_per_s) for key, speed in speeds.items()), default=0.0)
    return {key: confirmed[key] if key in confirmed
            else speed.bytes_per_s if fastest <= SAME_SPEED_RATIO * speed.bytes_per_s else 0.0
            for key, speed in speeds.items()}


@dataclass
class _Worker:
    recent_s_per_byte: deque[float]  # its last RECENT_REQUESTS times per byte on this share
    baseline_s_per_byte: float = math.inf  # the least median of them it ever had on this share

    def now_s_per_byte(self) -> float | None:
        """Its time per byte now: the median of its recent requests (None: fewer than MIN_REQUESTS)."""
        if len(self.recent_s_per_byte) < MIN_REQUESTS:
            return None
        return statistics.median(self.recent_s_per_byte)


class ObservedSpeeds:
    """Each worker's slowdown against its own baseline, from the decode windows of finished requests."""

    def __init__(self) -> None:
        # By (node id, model, weight bytes it holds): a time per byte depends on the weights' type, and on how
        # many layers share a stage's fixed costs, so only the same share of the same model compares.
        self._workers: dict[tuple[bytes, str, int], _Worker] = {}
        self._shares: dict[bytes, tuple[str, int]] = {}  # each worker's share in the last plan observed

    def observe(self, plan: Plan, own_id: bytes, tokens: int, owed_s: Mapping[bytes, float]) -> None:
        """One request's decode, alone on ``plan``: ``tokens`` made while each worker owed replies ``owed_s``
        seconds in all."""
        if tokens < MIN_TOKENS_OBSERVED:
            return
        held: dict[bytes, int] = {}
        for node in plan.nodes:
            if node.node_id != own_id:
                held[node.node_id] = held.get(node.node_id, 0) + node.weights_bytes
        for node_id, weights_bytes in held.items():
            if node_id not in owed_s or weights_bytes <= 0:
                continue
            per_token_s = owed_s[node_id] / tokens
            if per_token_s <= 0:
                continue
            self._shares[node_id] = (plan.model, weights_bytes)
            worker = self._workers.setdefault((node_id, plan.model, weights_bytes),
                                              _Worker(deque(maxlen=RECENT_REQUESTS)))
            worker.recent_s_per_byte.append(per_token_s / weights_bytes)
            if (now := worker.now_s_per_byte()) is not None:
                worker.baseline_s_per_byte = min(worker.baseline_s_per_byte, now)

    def slowdown(self, node_id: bytes) -> float:
        """How many times slower than its baseline ``node_id`` runs now, on its share of the last plan observed
        (1.0: as measured, or that share not yet seen MIN_REQUESTS times)."""
        worker = self._on_last_share(node_id)
        now = None if worker is None else worker.now_s_per_byte()
        if worker is None or now is None:
            return 1.0
        ratio = now / worker.baseline_s_per_byte
        return ratio if ratio >= SLOWDOWN_FLOOR else 1.0

    def observed_bytes_per_s(self, node_id: bytes) -> float | None:
        """The weight bytes a second ``node_id`` ran at at its best on its share of the last plan observed (its
        link included: at most its compute's pace); None before MIN_REQUESTS requests."""
        worker = self._on_last_share(node_id)
        if worker is None or worker.now_s_per_byte() is None:
            return None
        return 1.0 / worker.baseline_s_per_byte

    def _on_last_share(self, node_id: bytes) -> _Worker | None:
        """``node_id``'s figures on its share of the last plan observed (None: never observed)."""
        share = self._shares.get(node_id)
        return None if share is None else self._workers.get((node_id, *share))

    def to_json(self) -> dict[str, float]:
        """Each worker seen: its slowdown, for status."""
        return {node_id.hex(): round(self.slowdown(node_id), 2) for node_id in self._shares}
