"""The serving loop's decisions over made-up members and times: tier and plan, replans, step ups, slow blame."""

from __future__ import annotations

import dataclasses
from pathlib import PurePath

from hypothesis import given
from hypothesis import strategies as st

from mesh_sidecar.llama.estimate import ModelEstimate
from mesh_sidecar.mesh.exclusion import CORRUPT_OUTPUT, Exclusion
from mesh_sidecar.serve.pace import SLOW_BLAME_SHARE, Slow
from mesh_sidecar.serve.planner import NodeCapacity, Plan, PlanBy
from mesh_sidecar.serve.replan import (
    SPEED_REPLAN_INTERVAL_S,
    Blame,
    ServingSnapshot,
    StepUp,
    Tier,
    blame_slow,
    choose_plan,
    plan_largest,
    replan_reason,
    tier_index,
)
from mesh_sidecar.serve.step_up import StepUpGate, StepUpRules


def estimate(n_layers: int, layer: int) -> ModelEstimate:
    return ModelEstimate(n_layers, (layer,) * n_layers, 0, 0, 0, 4096, 0)


SMALL = Tier(PurePath("/models/small.gguf"), estimate(4, 10))  # 40 bytes: the host alone holds it
BIG = Tier(PurePath("/models/big.gguf"), estimate(8, 100))  # 800 bytes: only with BIGGY
TIERS = (SMALL, BIG)
HOST = NodeCapacity(b"h" * 32, "host", 100)  # the serving node, always last
BIGGY = NodeCapacity(b"b" * 32, "biggy", 1000)
SMALLY = NodeCapacity(b"s" * 32, "smally", 30)
RULES = StepUpRules(after_s=20, interval_s=60)


def snapshot(*peers: NodeCapacity, in_service: Tier | None = None, plan: Plan | None = None, now: float = 100.0,
             refused: tuple[NodeCapacity, ...] = ()) -> ServingSnapshot:
    excluded = tuple((member, Exclusion(CORRUPT_OUTPUT, "made-up", "none")) for member in refused)
    return ServingSnapshot(now, (*peers, HOST), excluded, TIERS,
                           tier_index(TIERS, in_service.path if in_service else None), plan)


def serving(tier: Tier, *peers: NodeCapacity) -> Plan:
    """The plan the loop would run ``tier`` on over ``peers`` and the host."""
    index, plan = plan_largest([tier], [*peers, HOST])
    assert index == 0
    return plan


# --- which tier and plan ---------------------------------------------------------------------

def test_with_nothing_in_service_the_largest_tier_that_fits_is_chosen_at_once():
    choice = choose_plan(snapshot(BIGGY), StepUpGate(RULES))
    assert TIERS[choice.tier] is BIG and choice.switch is None and choice.step_up.allowed
    assert [n.name for n in choice.plan.nodes] == ["biggy", "host"]


def test_a_bigger_tier_waits_for_the_gate_while_the_one_in_service_goes_on():
    gate = StepUpGate(RULES)
    small_plan = serving(SMALL)
    replan, look = replan_reason(snapshot(BIGGY, in_service=SMALL, plan=small_plan, now=100.0), gate)
    assert replan is None  # not even re-spread onto the newcomer
    assert look is not None and not look.allowed and look.waiting == "big.gguf" and look.ready_at == 120.0
    gate = look.gate
    replan, look = replan_reason(snapshot(BIGGY, in_service=SMALL, plan=small_plan, now=119.0), gate)
    assert replan is None and look is not None and look.ready_at == 120.0
    replan, look = replan_reason(snapshot(BIGGY, in_service=SMALL, plan=small_plan, now=120.0), look.gate)
    assert replan is not None and not replan.failover
    assert replan.reason == "big.gguf has fitted the mesh for 20 s; stepping up"
    assert look is not None
    choice = choose_plan(snapshot(BIGGY, in_service=SMALL, plan=small_plan, now=120.0), look.gate)
    assert TIERS[choice.tier] is BIG and choice.switch == "up"


def test_planning_while_a_step_up_waits_keeps_the_tier_in_service():
    choice = choose_plan(snapshot(BIGGY, in_service=SMALL, plan=serving(SMALL)), StepUpGate(RULES))
    assert TIERS[choice.tier] is SMALL and choice.switch is None
    assert not choice.step_up.allowed and choice.step_up.ready_at == 120.0


def test_losing_a_member_of_the_plan_is_a_failover_and_a_smaller_tier_comes_at_once():
    big_plan = serving(BIG, BIGGY)
    replan, look = replan_reason(snapshot(in_service=BIG, plan=big_plan), StepUpGate(RULES))
    assert replan is not None and replan.failover and look is None
    assert replan.reason == "biggy (node_62626262) left the plan"
    choice = choose_plan(snapshot(in_service=BIG, plan=big_plan), StepUpGate(RULES))
    assert TIERS[choice.tier] is SMALL and choice.switch == "down" and choice.step_up.allowed


def test_a_member_of_the_plan_still_connected_but_no_longer_planned_over_has_not_left():
    # Issue 50: a and c hold the big tier; c leaves and the small one fits the host alone: only c left.
    a, c = NodeCapacity(b"a" * 32, "a", 400), NodeCapacity(b"c" * 32, "c", 400)
    big_plan = serving(BIG, a, c)
    gone = dataclasses.replace(snapshot(in_service=BIG, plan=big_plan), unplanned=frozenset({a.node_id}))
    replan, _ = replan_reason(gone, StepUpGate(RULES))
    assert replan is not None and replan.failover and replan.reason == "c (node_63636363) left the plan"
    # A step up waits over other workers than the tier in service runs on: nothing restarts meanwhile.
    small_plan = serving(SMALL, SMALLY)
    waiting = dataclasses.replace(snapshot(BIGGY, in_service=SMALL, plan=small_plan),
                                  unplanned=frozenset({SMALLY.node_id}))
    replan, look = replan_reason(waiting, StepUpGate(RULES))
    assert replan is None and look is not None and look.waiting == "big.gguf"
    # The same tier over other workers (say, a larger member joined): a replan that says so, not a failover.
    moved = dataclasses.replace(snapshot(BIGGY, in_service=BIG, plan=big_plan),
                                unplanned=frozenset({a.node_id, c.node_id}))
    replan, _ = replan_reason(moved, StepUpGate(RULES))
    assert replan is not None and not replan.failover
    assert replan.reason == "Members changed and big.gguf no longer takes a (node_61616161), c (node_63636363)"


def test_a_smaller_tier_that_alone_fits_replaces_the_one_in_service_without_waiting():
    # The plan's member is still connected but refused now (say, a corrupt output): not lost, yet the big tier
    # no longer fits.
    big_plan = serving(BIG, BIGGY)
    replan, _ = replan_reason(snapshot(in_service=BIG, plan=big_plan, refused=(BIGGY,)), StepUpGate(RULES))
    assert replan is not None and not replan.failover
    assert replan.reason == "Members changed and small.gguf is the largest model that fits now"


def test_when_no_tier_fits_a_plan_in_service_fails_over_and_none_in_service_waits():
    tiny = (Tier(BIG.path, BIG.estimate),)
    alone = ServingSnapshot(100.0, (HOST,), (), tiny, None, None)
    replan, look = replan_reason(alone, StepUpGate(RULES))
    assert replan is None and look is not None and not look.allowed and look.waiting is None
    # Nothing fits, a bigger tier neither: a step up's wait starts again once members return.
    waiting = StepUpGate(RULES).bigger_fits(50.0)
    assert replan_reason(alone, waiting)[1] == StepUp(False, waiting.bigger_gone())
    replan, _ = replan_reason(ServingSnapshot(100.0, (HOST,), (), tiny, 0, serving(BIG, BIGGY)), StepUpGate(RULES))
    assert replan is not None and replan.failover and replan.reason == "biggy (node_62626262) left the plan"
    # Still connected, but no longer able to hold its share: the mesh cannot hold the model.
    shrunk = NodeCapacity(BIGGY.node_id, BIGGY.name, 10)
    replan, _ = replan_reason(ServingSnapshot(100.0, (shrunk, HOST), (), tiny, 0, serving(BIG, BIGGY)),
                              StepUpGate(RULES))
    assert replan is not None and replan.failover and replan.reason == "The mesh can no longer hold the model"


def test_with_no_plan_a_fitting_tier_starts_without_a_failover():
    replan, _ = replan_reason(snapshot(), StepUpGate(RULES))
    assert replan is not None and not replan.failover and replan.reason == "The mesh can hold the model now"


def test_a_newcomer_that_spreads_the_layers_better_replans_and_the_same_members_do_not():
    small_plan = serving(SMALL)
    assert replan_reason(snapshot(in_service=SMALL, plan=small_plan), StepUpGate(RULES))[0] is None
    replan, look = replan_reason(snapshot(SMALLY, in_service=SMALL, plan=small_plan), StepUpGate(RULES))
    assert replan is not None and not replan.failover
    assert replan.reason == "Members changed and the layers can be spread better"
    assert look is not None and look.allowed and look.gate.fits_since is None


def test_a_bigger_tier_gone_before_its_wait_is_over_waits_afresh_next_time():
    small_plan = serving(SMALL)
    _, look = replan_reason(snapshot(BIGGY, in_service=SMALL, plan=small_plan, now=100.0), StepUpGate(RULES))
    assert look is not None and look.gate.fits_since == 100.0
    _, look = replan_reason(snapshot(in_service=SMALL, plan=small_plan, now=110.0), look.gate)
    assert look is not None and look.gate.fits_since is None
    _, look = replan_reason(snapshot(BIGGY, in_service=SMALL, plan=small_plan, now=115.0), look.gate)
    assert look is not None and look.ready_at == 135.0


# A run of the serving loop in memory: at each step BIGGY is there or not, the loop looks for a reason
# to replan and, when there is one, plans and "restarts".
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans()), max_size=40), st.integers(0, 30), st.integers(0, 90))
def test_the_loop_steps_down_at_once_and_up_only_after_an_unbroken_fit_and_the_interval(steps, after_s, interval_s):
    gate = StepUpGate(StepUpRules(after_s, interval_s))
    now, fits_since, last_switch = 0.0, None, None
    choice = choose_plan(snapshot(now=now), gate)
    in_service, plan, gate = choice.tier, choice.plan, choice.step_up.gate
    for dt, present in steps:
        now += dt
        peers = (BIGGY,) if present else ()
        fits_since = (fits_since if fits_since is not None else now) if present else None
        replan, look = replan_reason(snapshot(*peers, in_service=TIERS[in_service], plan=plan, now=now), gate)
        if look is not None:
            gate = look.gate
        if replan is None:
            continue
        choice = choose_plan(snapshot(*peers, in_service=TIERS[in_service], plan=plan, now=now), gate)
        gate = choice.step_up.gate
        if choice.switch == "up":
            assert fits_since is not None and now - fits_since >= after_s
            assert last_switch is None or now - last_switch >= interval_s
        if choice.switch is not None:
            gate, last_switch = gate.switched(now), now
        in_service, plan = choice.tier, choice.plan
        if not present:
            assert TIERS[in_service] is SMALL  # a step down never waits
    if not steps or not steps[-1][1]:
        assert TIERS[in_service] is SMALL


# --- whom a slow stream is blamed on -------------------------------------------------------------

SLOW = Slow(since=50.0, window_s=10.0, tokens=1, expected_s=0.05)
OTHER = NodeCapacity(b"o" * 32, "other", 1000)


def test_the_worker_owing_replies_longest_is_left_out_when_the_model_fits_without_it():
    plan = serving(SMALL, BIGGY, SMALLY)
    verdict = blame_slow(SLOW, {BIGGY.node_id: 8.0, SMALLY.node_id: 2.0}, snapshot(BIGGY, SMALLY, in_service=SMALL,
                                                                                    plan=plan), left_out_as_slow=())
    assert (verdict.blame, verdict.node_id, verdict.owed_s) == (Blame.LEAVE_OUT, BIGGY.node_id, 8.0)


def test_a_worker_the_model_needs_stays():
    verdict = blame_slow(SLOW, {BIGGY.node_id: 8.0}, snapshot(BIGGY, in_service=BIG, plan=serving(BIG, BIGGY)), ())
    assert (verdict.blame, verdict.node_id) == (Blame.NEEDED, BIGGY.node_id)


def test_a_wait_under_the_share_blames_nobody_and_one_left_out_already_is_not_blamed_again():
    now = snapshot(BIGGY, in_service=SMALL, plan=serving(SMALL, BIGGY))
    short = SLOW_BLAME_SHARE * SLOW.window_s - 0.1
    assert blame_slow(SLOW, {BIGGY.node_id: short}, now, ()).blame is Blame.NOT_ENOUGH
    assert blame_slow(SLOW, {BIGGY.node_id: 9.0}, now, {BIGGY.node_id}).blame is Blame.ALREADY_LEFT_OUT


def test_waits_on_members_outside_the_plan_or_on_this_node_blame_nobody():
    now = snapshot(BIGGY, OTHER, in_service=SMALL, plan=serving(SMALL, BIGGY))
    verdict = blame_slow(SLOW, {OTHER.node_id: 9.0, HOST.node_id: 9.0}, now, ())
    assert verdict.blame is Blame.NOBODY and verdict.node_id is None


@given(st.dictionaries(st.sampled_from([BIGGY.node_id, SMALLY.node_id, OTHER.node_id, HOST.node_id]),
                       st.floats(0, 10)))
def test_only_the_plans_worker_owing_longest_is_ever_named(waits):
    now = snapshot(BIGGY, SMALLY, OTHER, in_service=SMALL, plan=serving(SMALL, BIGGY, SMALLY))
    verdict = blame_slow(SLOW, waits, now, ())
    workers = {node_id: s for node_id, s in waits.items() if node_id in (BIGGY.node_id, SMALLY.node_id)}
    if not workers:
        assert verdict.blame is Blame.NOBODY
        return
    assert verdict.node_id in workers and verdict.owed_s == max(workers.values())
    assert (verdict.blame is Blame.NOT_ENOUGH) == (verdict.owed_s < SLOW_BLAME_SHARE * SLOW.window_s)


# --- a plan in service stays; speed replans ----------------------------------------------------

def fast(member: NodeCapacity, speed: float) -> NodeCapacity:
    return dataclasses.replace(member, decode_bytes_per_s=speed)


def speed_snapshot(*peers: NodeCapacity, host: NodeCapacity, plan: Plan | None, now: float = 100.0,
                   replanned_at: float | None = None, spread: bool = True) -> ServingSnapshot:
    return ServingSnapshot(now, (*peers, host), (), (BIG,), 0 if plan else None, plan, by=PlanBy.SPEED,
                           spread=spread, speed_replanned_at=replanned_at)


def test_free_memory_moving_keeps_the_plan_while_it_fits_and_replans_when_it_does_not():
    a, b = NodeCapacity(b"a" * 32, "a", 600), NodeCapacity(b"b" * 32, "b", 600)
    host = NodeCapacity(b"h" * 32, "host", 600)
    _, plan = plan_largest([BIG], [a, b, host])
    moved = dataclasses.replace(a, usable_bytes=560)  # a layer's worth less, its share still fits
    replan, _ = replan_reason(ServingSnapshot(100.0, (moved, b, host), (), (BIG,), 0, plan), StepUpGate(RULES))
    assert replan is None
    shrunk = dataclasses.replace(a, usable_bytes=100)
    replan, _ = replan_reason(ServingSnapshot(100.0, (shrunk, b, host), (), (BIG,), 0, plan), StepUpGate(RULES))
    assert replan is not None and "no longer has the memory" in replan.reason and not replan.failover


def test_a_worker_that_became_slow_is_replanned_for_speed_once_per_interval():
    a, b = fast(NodeCapacity(b"a" * 32, "a", 900), 1000.0), fast(NodeCapacity(b"b" * 32, "b", 900), 1000.0)
    host = fast(NodeCapacity(b"h" * 32, "host", 900), 1000.0)
    _, plan = plan_largest([BIG], [a, b, host], by=PlanBy.SPEED, spread=True)
    assert plan.by is PlanBy.MEMORY  # the same speeds: the memory plan
    # Nothing changed: no replan.
    assert replan_reason(speed_snapshot(a, b, host=host, plan=plan), StepUpGate(RULES))[0] is None
    slow_a = dataclasses.replace(a, decode_bytes_per_s=250.0)
    replan, _ = replan_reason(speed_snapshot(slow_a, b, host=host, plan=plan), StepUpGate(RULES))
    assert replan is not None and replan.for_speed and "tok/s" in replan.reason
    # Right after a speed replan, the next one waits for the interval.
    waits = speed_snapshot(slow_a, b, host=host, plan=plan, now=150.0, replanned_at=100.0)
    assert replan_reason(waits, StepUpGate(RULES))[0] is None
    later = speed_snapshot(slow_a, b, host=host, plan=plan, now=100.0 + SPEED_REPLAN_INTERVAL_S, replanned_at=100.0)
    assert replan_reason(later, StepUpGate(RULES))[0] is not None
    # A small change is no reason.
    bit_slower = dataclasses.replace(a, decode_bytes_per_s=900.0)
    assert replan_reason(speed_snapshot(bit_slower, b, host=host, plan=plan), StepUpGate(RULES))[0] is None
