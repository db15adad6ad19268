"""The serving loop's decisions, pure over a snapshot: which tier and plan, when to replan, whom to blame.

The serving loop (supervisor.py) reads the live mesh and the loop clock into a
:class:`ServingSnapshot`, asks the functions here, and does what they say:

    choose_plan(snapshot, gate)          the tier and plan to start llama-server on now
    replan_reason(snapshot, gate)        why the plan in service should be replaced, or None
    blame_slow(slow, waits_s, snapshot, left_out)
                                         which worker held a slow stream up, and what to do

A plan in service stays while its participants are the same and it still fits
their offers (a GPU's free memory moves whenever another program allocates): a
new layout alone is no reason to restart llama-server. Within the same
participants only speed is: a plan expected SPEED_REPLAN_GAIN faster (a worker
became slower, or recovered), at most once per SPEED_REPLAN_INTERVAL_S.

A bigger tier replaces the one in service only once the step-up gate allows
(tiers.py); each decision that looks at the gate returns a :class:`StepUp`
with the gate as it is after the look, which the loop keeps. Nothing here reads
a clock or the mesh, so tests run these over made-up members and times.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING

from ..errors import PlanError
from ..identity import short_id
from .pace import SLOW_BLAME_SHARE, Slow
from .planner import NodeCapacity, Plan, PlanBy, choose_tier, tier_needs_bytes
from .step_up import StepUpGate

if TYPE_CHECKING:
    from ..llama.estimate import ModelEstimate
    from ..mesh.exclusion import Exclusion

# A plan over the same participants replaces the one in service only when expected this much faster,
# and at most once in this long: each restart costs a reload, and a speed measured from traffic moves.
SPEED_REPLAN_GAIN = 0.15
SPEED_REPLAN_INTERVAL_S = 180.0


@dataclass(frozen=True)
class Tier:
    """One ``--model`` file as planning sees it."""

    path: PurePath
    estimate: ModelEstimate

    @property
    def needs_bytes(self) -> int:
        return tier_needs_bytes(self.estimate)


@dataclass(frozen=True)
class ServingSnapshot:
    """What the serving loop decides over, read at one moment."""

    now: float  # the loop's clock
    members: tuple[NodeCapacity, ...]  # to plan over, in device order: peers first, this node last
    refused: tuple[tuple[NodeCapacity, Exclusion], ...]  # connected members left out, and why
    tiers: tuple[Tier, ...]  # every --model, in the order given
    in_service: int | None  # the tier llama-server was last started on (an index into tiers)
    plan: Plan | None  # the plan in service; None while the API refuses
    by: PlanBy = PlanBy.MEMORY  # --plan-by
    spread: bool = False  # --spread: every free member takes part
    speed_replanned_at: float | None = None  # when the last replan for speed happened (the loop's clock)
    # Connected members this round does not plan over (the claimed tier needs fewer workers, or serving nodes):
    # a plan's member among them has not left, its tier no longer needs it.
    unplanned: frozenset[bytes] = frozenset()

    @property
    def own_id(self) -> bytes:
        return self.members[-1].node_id

    def connected(self) -> frozenset[bytes]:
        """The node ids connected now, refused ones and this node's included."""
        return (frozenset(m.node_id for m in self.members) | {m.node_id for m, _ in self.refused}
                | self.unplanned)

    def without(self, node_id: bytes) -> ServingSnapshot:
        """The same moment with one member gone."""
        return dataclasses.replace(self, members=tuple(m for m in self.members if m.node_id != node_id),
                                   refused=tuple((m, why) for m, why in self.refused if m.node_id != node_id),
                                   unplanned=self.unplanned - {node_id})


def plan_largest(tiers: Sequence[Tier], members: Sequence[NodeCapacity],
                 refused: tuple[tuple[NodeCapacity, Exclusion], ...] = (), *,
                 at_most_bytes: int | None = None, by: PlanBy = PlanBy.MEMORY,
                 spread: bool = False) -> tuple[int, Plan]:
    """The index of the largest tier ``members`` can hold and its plan, noting ``refused``; PlanError if none.

    ``at_most_bytes``, ``by``, ``spread``: see choose_tier.
    """
    index, plan = choose_tier([(tier.path.name, tier.estimate) for tier in tiers], members,
                              at_most_bytes=at_most_bytes, by=by, spread=spread)
    return index, dataclasses.replace(plan, refused=refused)


def _plan(snapshot: ServingSnapshot, at_most_bytes: int | None = None) -> tuple[int, Plan]:
    return plan_largest(snapshot.tiers, snapshot.members, snapshot.refused, at_most_bytes=at_most_bytes,
                        by=snapshot.by, spread=snapshot.spread)


@dataclass(frozen=True)
class StepUp:
    """One look at the step-up gate: whether a tier may replace the one in service now, and the gate after."""

    allowed: bool
    gate: StepUpGate
    waiting: str | None = None  # not allowed yet: the bigger tier's file name
    ready_at: float | None = None  # not allowed yet: when it may happen (loop time)


def step_up(snapshot: ServingSnapshot, tier: int, gate: StepUpGate) -> StepUp:
    """Whether ``tier`` may replace the tier in service now: always, unless it is a bigger one."""
    if snapshot.in_service is None or (
            snapshot.tiers[tier].needs_bytes <= snapshot.tiers[snapshot.in_service].needs_bytes):
        return StepUp(True, gate.bigger_gone())
    gate = gate.bigger_fits(snapshot.now)
    if (ready_at := gate.ready_at(snapshot.now)) > snapshot.now:
        return StepUp(False, gate, snapshot.tiers[tier].path.name, ready_at)
    return StepUp(True, gate)


@dataclass(frozen=True)
class PlanChoice:
    """What llama-server starts on: a tier, its plan, and how the step-up gate looked."""

    tier: int
    plan: Plan
    step_up: StepUp
    switch: str | None  # "up" or "down" when the tier differs from the one in service


def choose_plan(snapshot: ServingSnapshot, gate: StepUpGate) -> PlanChoice:
    """The largest tier that fits, or the one in service while a step up must wait; PlanError if none fits."""
    tier, plan = _plan(snapshot)
    look = step_up(snapshot, tier, gate)
    if not look.allowed:
        assert snapshot.in_service is not None  # a step up is always from a tier in service
        tier, plan = _plan(snapshot, at_most_bytes=snapshot.tiers[snapshot.in_service].needs_bytes)
    switch = None
    if snapshot.in_service is not None and snapshot.tiers[tier].path != snapshot.tiers[snapshot.in_service].path:
        bigger = snapshot.tiers[tier].needs_bytes > snapshot.tiers[snapshot.in_service].needs_bytes
        switch = "up" if bigger else "down"
    return PlanChoice(tier, plan, look, switch)


@dataclass(frozen=True)
class Replan:
    """llama-server should be replaced: why, for people, and whether that is a failover."""

    reason: str
    failover: bool
    for_speed: bool = False  # a faster plan over the same members (SPEED_REPLAN_INTERVAL_S applies)


def replan_reason(snapshot: ServingSnapshot, gate: StepUpGate) -> tuple[Replan | None, StepUp | None]:
    """Why the state in service should be replaced (None: it goes on), and the step-up look taken, if any."""
    if snapshot.plan is not None:
        connected = snapshot.connected()
        lost = [n for n in snapshot.plan.nodes if n.node_id not in connected]
        if lost:
            return Replan(f"{', '.join(f'{n.name} ({short_id(n.node_id)})' for n in lost)} left the plan", True), None
    try:
        tier, candidate = _plan(snapshot)
    except PlanError:
        # No tier fits, a bigger one neither: a step up once members return waits its whole time again.
        gone = StepUp(False, gate.bigger_gone())
        return (None if snapshot.plan is None else Replan("The mesh can no longer hold the model", True)), gone
    if snapshot.plan is None:
        return Replan("The mesh can hold the model now", False), None
    # A plan is in service, so a tier is: llama-server was started on it.
    assert snapshot.in_service is not None
    look = step_up(snapshot, tier, gate)
    planned, serving = snapshot.tiers[tier], snapshot.tiers[snapshot.in_service]
    if planned.path != serving.path:
        if not look.allowed:
            return None, look  # the tier in service goes on as it is until the step up may happen
        if planned.needs_bytes > serving.needs_bytes:
            return Replan(f"{planned.path.name} has fitted the mesh for {gate.rules.after_s:g} s; stepping up",
                          False), look
        return Replan(f"Members changed and {planned.path.name} is the largest model that fits now", False), look
    # Nothing bigger fits (the look said so to the gate): a later step up waits afresh.
    if layout(candidate) == layout(snapshot.plan):
        return None, look
    if moved := [n for n in snapshot.plan.nodes if n.node_id in snapshot.unplanned]:
        names = ", ".join(f"{n.name} ({short_id(n.node_id)})" for n in moved)
        return Replan(f"Members changed and {planned.path.name} no longer takes {names}", False), look
    if (short := short_of_memory(snapshot.plan, snapshot.members)) is not None:
        return Replan(f"{short} no longer has the memory its layers need", False), look
    if snapshot.spread and participants(candidate) != participants(snapshot.plan):
        return Replan("Members changed and --spread uses every free one", False), look
    now_s, candidate_s = token_s_now(snapshot.plan, snapshot.members), candidate.token_s
    if now_s is None or candidate_s is None:
        # Speeds unknown (planned by memory): a new member the model needs joins; nothing else restarts.
        if participants(candidate) != participants(snapshot.plan):
            return Replan("Members changed and the layers can be spread better", False), look
        return None, look
    if candidate_s > (1 - SPEED_REPLAN_GAIN) * now_s:
        return None, look
    if snapshot.speed_replanned_at is not None and snapshot.now < snapshot.speed_replanned_at + SPEED_REPLAN_INTERVAL_S:
        return None, look
    return Replan(f"Speeds changed: a new plan is expected at {1 / candidate_s:.1f} tok/s against "
                  f"{1 / now_s:.1f} now", False, for_speed=True), look


def participants(plan: Plan) -> frozenset[tuple[bytes, str]]:
    """The devices holding layers."""
    return frozenset((n.node_id, n.device) for n in plan.nodes)


def short_of_memory(plan: Plan, members: Sequence[NodeCapacity]) -> str | None:
    """The first participant of ``plan`` whose offer no longer holds its share (its name), or None."""
    offers = {(m.node_id, m.device): m.usable_bytes for m in members}
    for node in plan.nodes:
        if offers.get((node.node_id, node.device), 0) < node.needed_bytes:
            return f"{node.name} ({short_id(node.node_id)})"
    return None


def token_s_now(plan: Plan, members: Sequence[NodeCapacity]) -> float | None:
    """``plan``'s expected token time at the speeds ``members`` have now; None when one is unknown."""
    now = {(m.node_id, m.device): m for m in members}
    total = 0.0
    for node in plan.nodes:
        member = now.get((node.node_id, node.device))
        if member is None or member.decode_bytes_per_s <= 0:
            return None
        total += (node.weights_bytes + node.output_bytes) / member.decode_bytes_per_s + member.link_s
    return total


def layout(plan: Plan) -> list[tuple[bytes, int, int]]:
    """Who holds which layers: two plans with the same layout need no restart."""
    return [(n.node_id, n.start, n.end) for n in plan.nodes]


class Blame(enum.Enum):
    """What a slow stream says about the plan's workers."""

    NOBODY = "nobody"  # no worker of the plan kept the serving node waiting
    ALREADY_LEFT_OUT = "already_left_out"  # the one to blame is left out as slow already: a replan is coming
    NOT_ENOUGH = "not_enough"  # the longest wait was under SLOW_BLAME_SHARE of the window: not a worker's doing
    NEEDED = "needed"  # a worker held it up, but the model in service does not fit without it
    LEAVE_OUT = "leave_out"  # a worker held it up and the model in service fits without it


@dataclass(frozen=True)
class SlowVerdict:
    """Whom a slow stream is blamed on, and what to do."""

    blame: Blame
    node_id: bytes | None = None  # the worker that owed replies longest (None for NOBODY)
    owed_s: float = 0.0  # how long, within the stream's window


def blame_slow(slow: Slow, waits_s: Mapping[bytes, float], snapshot: ServingSnapshot,
               left_out_as_slow: Collection[bytes]) -> SlowVerdict:
    """Which worker of the plan in service held ``slow`` up, from the seconds each kept the node waiting.

    ``left_out_as_slow``: the workers already refused as slow.
    """
    assert snapshot.plan is not None and snapshot.in_service is not None  # a stream runs on a plan
    workers = {n.node_id for n in snapshot.plan.nodes if n.node_id != snapshot.own_id}
    waits = {node_id: s for node_id, s in waits_s.items() if node_id in workers}
    if not waits:
        return SlowVerdict(Blame.NOBODY)
    node_id, owed_s = max(waits.items(), key=lambda wait: wait[1])
    if node_id in left_out_as_slow:
        return SlowVerdict(Blame.ALREADY_LEFT_OUT, node_id, owed_s)
    if owed_s < SLOW_BLAME_SHARE * slow.window_s:
        return SlowVerdict(Blame.NOT_ENOUGH, node_id, owed_s)
    try:
        tier, _ = _plan(snapshot.without(node_id))
    except PlanError:
        return SlowVerdict(Blame.NEEDED, node_id, owed_s)
    if snapshot.tiers[tier].path != snapshot.tiers[snapshot.in_service].path:
        return SlowVerdict(Blame.NEEDED, node_id, owed_s)
    return SlowVerdict(Blame.LEAVE_OUT, node_id, owed_s)


def tier_index(tiers: Sequence[Tier], path: PurePath | None) -> int | None:
    """The index of the tier at ``path`` (the first, if given twice); None for None."""
    return None if path is None else next(i for i, tier in enumerate(tiers) if tier.path == path)
