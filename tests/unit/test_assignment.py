"""Which workers each serving node may use: the rule case by case, then its properties over made-up meshes
(hypothesis): no worker shared that does not share, the fewest picked, the same answer whatever the input order."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_sidecar.serve.assignment import (
    Assignment,
    Claim,
    ModelNeeds,
    Offer,
    assign,
    fits,
    pick_workers,
    pool_for,
)
from mesh_sidecar.units import GIB

NEEDS = ModelNeeds("gemma", alone_bytes=10 * GIB, margin_bytes=GIB // 2, layer_bytes=GIB // 2)
SMALL = ModelNeeds("SmolLM2", alone_bytes=GIB // 4, margin_bytes=GIB // 16, layer_bytes=GIB // 16)
PER_WORKER = NEEDS.margin_bytes + NEEDS.layer_bytes  # 1 GiB


def nid(index: int) -> bytes:
    return bytes([index]) * 32


def offer(index: int, gib: float, *, shares: bool = False, serving: bool = False) -> Offer:
    return Offer(nid(index), f"host{index}", int(gib * GIB), shares=shares, serving=serving)


def claim(index: int, since: float = 0.0, needs: ModelNeeds = NEEDS, *, spread: bool = False) -> Claim:
    return Claim(nid(index), since, needs, spread=spread)


def ids(offers: tuple[Offer, ...]) -> list[int]:
    return [o.node_id[0] for o in offers]


# fits


def test_fits_alone_needs_the_whole_model():
    assert fits(NEEDS.alone_bytes, [], NEEDS)
    assert not fits(NEEDS.alone_bytes - 1, [], NEEDS)


def test_fits_charges_each_worker_a_margin_and_a_layer():
    own = 4 * GIB
    # 4 + 4 + 4 = 12 GiB against 10 + 2 * 1: just enough; one byte less is not.
    assert fits(own, [4 * GIB, 4 * GIB], NEEDS)
    assert not fits(own, [4 * GIB, 4 * GIB - 1], NEEDS)
    # A worker offering less than its margin and a layer makes it worse, not better.
    assert fits(own, [7 * GIB], NEEDS) and not fits(own, [7 * GIB, PER_WORKER - 1], NEEDS)


# pick_workers


def test_alone_when_it_fits():
    assert pick_workers(offer(0, 10), [offer(1, 20), offer(2, 20)], NEEDS, spread=False) == ()


def test_fewest_members_largest_first():
    pool = [offer(1, 3), offer(2, 8), offer(3, 5), offer(4, 8)]
    # own 2 GiB: 2 + 8 = 10 < 11; 2 + 8 + 8 = 18 >= 12.
    assert ids(pick_workers(offer(0, 2), pool, NEEDS, spread=False)) == [2, 4]
    # own 4 GiB: 4 + 8 = 12 >= 11, one worker; of the two equal, the lower node id.
    assert ids(pick_workers(offer(0, 4), pool, NEEDS, spread=False)) == [2]


def test_spread_takes_the_whole_pool_even_when_it_fits_alone():
    pool = [offer(1, 3), offer(2, 8), offer(3, 0.1)]
    assert ids(pick_workers(offer(0, 100), pool, NEEDS, spread=True)) == [2, 1, 3]


def test_not_enough_takes_every_one():
    pool = [offer(1, 2), offer(2, 3), offer(3, 1)]
    assert ids(pick_workers(offer(0, 2), pool, NEEDS, spread=False)) == [2, 1, 3]


def test_own_node_is_never_its_own_worker():
    # Counted as its own worker, host0 would be enough (9 + 9 >= 11); without it 9 + 1 falls short: all the rest.
    assert ids(pick_workers(offer(0, 9), [offer(0, 9), offer(1, 1)], NEEDS, spread=False)) == [1]


# assign


def test_two_claims_never_share_a_worker_that_does_not_share():
    offers = [offer(0, 2, serving=True), offer(1, 2, serving=True), offer(2, 9), offer(3, 9), offer(4, 9)]
    result = assign([claim(0, 1.0), claim(1, 2.0)], offers)
    assert result.workers_of(nid(0)) == (nid(2),)
    assert result.workers_of(nid(1)) == (nid(3),)
    assert result.roles[nid(4)].serves_with is None


def test_the_first_claim_takes_all_and_the_next_is_left_alone_short():
    offers = [offer(0, 2), offer(1, 2), offer(2, 5), offer(3, 5)]
    result = assign([claim(0, 1.0), claim(1, 2.0)], offers)
    assert set(result.workers_of(nid(0))) == {nid(2), nid(3)}
    assert result.alone(nid(1))
    assert "no worker free" in result.roles[nid(1)].why


def test_sharing_workers_serve_both():
    offers = [offer(0, 2), offer(1, 2), offer(2, 9, shares=True), offer(3, 9)]
    result = assign([claim(0, 1.0), claim(1, 2.0)], offers)
    assert result.workers_of(nid(0)) == (nid(2),)
    assert result.workers_of(nid(1)) == (nid(2),)
    assert result.roles[nid(3)].serves_with is None
    role = result.roles[nid(2)]
    assert role.serves_with == nid(0) and "host0" in role.why and "host1" in role.why


def test_serving_members_are_never_workers():
    # host1 serves (its offer says so) but its claim has not arrived; host2 claims without saying so in its offer.
    offers = [offer(0, 2), offer(1, 50, serving=True), offer(2, 50), offer(3, 9)]
    result = assign([claim(0, 1.0, spread=True), claim(2, 2.0, SMALL)], offers)
    assert result.workers_of(nid(0)) == (nid(3),)
    assert result.roles[nid(1)].serves_with == nid(1)
    assert result.alone(nid(2))
    assert nid(1) not in {o.node_id for o in pool_for(nid(0), [claim(0), claim(2)], offers)}


def test_earlier_since_picks_first():
    offers = [offer(0, 2), offer(1, 2), offer(2, 9)]
    assert assign([claim(0, 5.0), claim(1, 4.0)], offers).workers_of(nid(1)) == (nid(2),)
    assert assign([claim(0, 4.0), claim(1, 5.0)], offers).workers_of(nid(0)) == (nid(2),)


def test_equal_since_goes_by_node_id():
    offers = [offer(7, 2), offer(3, 2), offer(2, 9)]
    result = assign([claim(7, 4.0), claim(3, 4.0)], offers)
    assert result.workers_of(nid(3)) == (nid(2),)
    assert result.alone(nid(7))


def test_a_claim_without_an_offer_is_skipped():
    offers = [offer(1, 2), offer(2, 9)]
    result = assign([claim(0, 1.0), claim(1, 2.0)], offers)
    assert nid(0) not in result.workers and not result.alone(nid(0))
    assert result.workers_of(nid(1)) == (nid(2),)
    assert nid(0) not in result.roles


def test_pool_for_a_node_without_a_claim_comes_after_every_claim():
    offers = [offer(0, 2), offer(1, 2), offer(2, 9), offer(3, 1)]
    assert ids(pool_for(nid(1), [claim(0, 1.0)], offers)) == [3]
    assert ids(pool_for(nid(1), [claim(0, 1.0), claim(1, 0.5)], offers)) == [2, 3]


def test_a_node_offering_or_claiming_twice_is_refused():
    with pytest.raises(ValueError, match="offers twice"):
        assign([], [offer(1, 2), offer(1, 3)])
    with pytest.raises(ValueError, match="claims twice"):
        assign([claim(1, 1.0), claim(1, 2.0)], [offer(1, 2)])


# roles


def test_roles_say_why():
    offers = [offer(0, 1), offer(1, 0.5), offer(2, 12), offer(3, 3)]
    result = assign([claim(0, 1.0), claim(1, 2.0, SMALL)], offers)
    assert result.roles[nid(0)].why.startswith("serves gemma with 1 worker")
    assert result.roles[nid(1)].why == "serves SmolLM2 alone: it fits (0.25 of 0.50 GiB free)"
    assert result.roles[nid(2)].why == "holds layers of gemma for host0"
    assert result.roles[nid(3)].why == "not needed: each serving node's model fits on fewer members"
    assert assign([], offers).roles[nid(3)].why == "idle: no member serves a model"


def test_a_claim_running_a_plan_takes_the_members_of_its_plan_still_free():
    offers = [offer(0, 1), offer(1, 1), offer(2, 12), offer(3, 6), offer(4, 6)]
    # host0's plan runs on host3 and host4 (not the fewest by the count of bytes: host2 alone would do),
    # host0 itself holding no layer; host1, later and with no plan yet, picks from what is left.
    ran = Claim(nid(0), 1.0, NEEDS, members=(nid(4), nid(3)))
    result = assign([ran, claim(1, 2.0)], offers)
    assert result.workers_of(nid(0)) == (nid(3), nid(4)) and result.workers_of(nid(1)) == (nid(2),)
    assert result.roles[nid(0)].why == ("serves gemma with 2 workers, those of its plan, holding no layer itself "
                                        "(10.0 of 13.0 GiB free)")
    assert result.roles[nid(3)].why == "holds layers of gemma for host0"
    # Alone in its plan: every worker is free for later claims.
    alone = assign([dataclasses.replace(ran, members=(nid(0),)), claim(1, 2.0)], [offer(0, 11), *offers[1:]])
    assert alone.workers_of(nid(0)) == () and alone.workers_of(nid(1)) == (nid(2),)
    assert alone.roles[nid(0)].why == "serves gemma alone: it fits (10.0 of 11.0 GiB free)"
    # A member of its plan that an earlier claim took is not its.
    earlier = Claim(nid(1), 0.5, NEEDS, members=(nid(3), nid(1)))
    assert assign([ran, earlier], offers).workers == {nid(1): (nid(3),), nid(0): (nid(4),)}


def test_roles_as_another_serving_node_sees_them():
    offers = [offer(0, 1), offer(1, 0.5), offer(2, 12)]
    result = assign([claim(0, 1.0), claim(1, 2.0, SMALL)], offers)
    assert result.seen_by(nid(1))[nid(2)].why == "taken by host0 for gemma"
    assert result.seen_by(nid(0))[nid(2)] == result.roles[nid(2)]
    assert result.seen_by(nid(1))[nid(0)] == result.roles[nid(0)]


# properties


@st.composite
def meshes(draw: st.DrawFn) -> tuple[list[Claim], list[Offer]]:
    """Up to eight members with unique ids; some claim (a few of those not connected, some running a plan
    over members that may be taken or gone since), some share."""
    indices = draw(st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True))
    offers = [Offer(nid(i), f"host{i}", draw(st.integers(0, 24)) * GIB // 2, shares=draw(st.booleans()),
                    serving=draw(st.integers(0, 5)) == 0) for i in indices]
    claimants = draw(st.lists(st.sampled_from(indices + [41, 42]), max_size=4, unique=True))
    plans = st.none() | st.lists(st.sampled_from(indices + [43]), min_size=1, max_size=4, unique=True)
    claims = [Claim(nid(i), float(draw(st.integers(0, 3))),
                    ModelNeeds(f"model{i}", draw(st.integers(0, 40)) * GIB // 2, GIB // 4, GIB // 4),
                    spread=draw(st.integers(0, 4)) == 0,
                    members=None if (plan := draw(plans)) is None else tuple(map(nid, plan))) for i in claimants]
    return claims, offers


def check_invariants(claims: list[Claim], offers: list[Offer], result: Assignment) -> None:
    by_id = {o.node_id: o for o in offers}
    serving = {c.node_id for c in claims} | {o.node_id for o in offers if o.serving}
    held: dict[bytes, int] = {}
    for node_id, workers in result.workers.items():
        assert node_id in by_id
        for worker in workers:
            assert worker not in serving
            held[worker] = held.get(worker, 0) + 1
        sizes = [(-by_id[w].usable_bytes, w) for w in workers]
        assert sizes == sorted(sizes)
    assert all(count == 1 or by_id[worker].shares for worker, count in held.items())
    assert set(result.roles) == set(by_id)
    for node_id, role in result.roles.items():
        assert role.why and role.name == by_id[node_id].name
        if node_id in serving:
            assert role.serves_with == node_id
        elif node_id in held:
            assert node_id in result.workers_of(role.serves_with or b"")
        else:
            assert role.serves_with is None


@settings(max_examples=300, deadline=None)
@given(meshes(), st.data())
def test_the_result_does_not_depend_on_input_order(mesh, data):
    claims, offers = mesh
    result = assign(claims, offers)
    check_invariants(claims, offers, result)
    shuffled = assign(data.draw(st.permutations(claims)), data.draw(st.permutations(offers)))
    assert shuffled == result


@settings(max_examples=300, deadline=None)
@given(meshes())
def test_each_claim_picks_from_what_pool_for_says(mesh):
    claims, offers = mesh
    result = assign(claims, offers)
    by_id = {o.node_id: o for o in offers}
    for c in claims:
        if c.node_id not in by_id:
            continue
        pool = pool_for(c.node_id, claims, offers)
        if c.members is None:
            picked = pick_workers(by_id[c.node_id], pool, c.needs, c.spread)
        else:  # the members of its plan still free
            picked = tuple(o for o in pool if o.node_id in c.members)
        assert tuple(o.node_id for o in picked) == result.workers_of(c.node_id)
        # Nothing in the pool is taken, without sharing, by a claim that picks earlier.
        for other in claims:
            if (other.since, other.node_id) < (c.since, c.node_id):
                taken = {w for w in result.workers_of(other.node_id) if not by_id[w].shares}
                assert taken.isdisjoint(o.node_id for o in pool)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 24), st.lists(st.integers(0, 24), max_size=6), st.integers(0, 40))
def test_no_smaller_set_of_workers_fits(own_halves, pool_halves, need_halves):
    needs = ModelNeeds("m", need_halves * GIB // 2, GIB // 4, GIB // 4)
    own = offer(0, own_halves / 2)
    pool = [offer(i + 1, h / 2) for i, h in enumerate(pool_halves)]
    picked = pick_workers(own, pool, needs, spread=False)
    usable = [o.usable_bytes for o in pool]
    if fits(own.usable_bytes, [o.usable_bytes for o in picked], needs):
        for k in range(len(picked)):
            assert not any(fits(own.usable_bytes, list(some), needs) for some in itertools.combinations(usable, k))
    else:
        assert len(picked) == len(pool)
        assert not any(fits(own.usable_bytes, list(some), needs)
                       for k in range(len(usable) + 1) for some in itertools.combinations(usable, k))


# --- by speed -------------------------------------------------------------------------------


def speedy(index: int, usable: int, speed: float) -> Offer:
    return Offer(bytes([index]) * 32, f"m{index}", usable, decode_bytes_per_s=speed)


def test_by_speed_workers_are_taken_fastest_first_and_much_faster_ones_always():
    needs = ModelNeeds("m", alone_bytes=1000, margin_bytes=10, layer_bytes=10)
    own = speedy(9, 600, 1000.0)
    slow_big, fast_small, same = speedy(1, 900, 250.0), speedy(2, 500, 1000.0), speedy(3, 450, 1100.0)
    pool = [slow_big, fast_small, same]
    # By memory: the largest, the slow one.
    assert pick_workers(own, pool, needs, spread=False) == (slow_big,)
    # By speed: the fast one (the same band as this node's own speed), then by size.
    assert pick_workers(own, pool, needs, spread=False, by_speed=True) == (fast_small,)
    # A worker much faster than this node is taken even when the model fits without it.
    gpu = speedy(4, 300, 8000.0)
    assert pick_workers(own, [*pool, gpu], needs, spread=False, by_speed=True) == (gpu, fast_small)
    fits_alone = speedy(9, 5000, 1000.0)
    assert pick_workers(fits_alone, [*pool, gpu], needs, spread=False, by_speed=True) == (gpu,)
    # One speed unknown: by memory, as before.
    assert pick_workers(own, [*pool, speedy(5, 100, 0.0)], needs, spread=False, by_speed=True) == (slow_big,)
