"""The layer planner: shape of every plan, D'Hondt counts, capacity, errors, --tensor-split."""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mesh_sidecar.errors import PlanError, SetupError
from mesh_sidecar.llama.estimate import ModelEstimate, assign_layers
from mesh_sidecar.mesh.exclusion import Exclusion
from mesh_sidecar.serve.assignment import speeds_differ
from mesh_sidecar.serve.planner import (
    SPEED_PLAN_MIN_GAIN,
    NodeCapacity,
    Plan,
    PlanBy,
    _largest_layers_prefix_sums,
    _participants,
    device_shares,
    plan_layers,
)
from mesh_sidecar.units import GIB
from mesh_sidecar.wire.gossip import OfferedDevice

N_CTX = 4096


def estimate(
    n_layers: int, layer: int = 1, *, output: int = 0, margin: int = 0, kv: int = 0
) -> ModelEstimate:
    """Uniform blocks of ``layer`` weight bytes each."""
    return ModelEstimate(n_layers, (layer,) * n_layers, 0, output, kv, N_CTX, margin)


def node(index: int, usable: int) -> NodeCapacity:
    return NodeCapacity(bytes([index]) * 32, f"host{index}", usable)


def nodes(*usable: int) -> list[NodeCapacity]:
    return [node(i, u) for i, u in enumerate(usable)]


def counts(plan: Plan) -> list[int]:
    return [n.end - n.start for n in plan.nodes]


def layers_of(plan: Plan, member: NodeCapacity) -> int:
    return sum(n.end - n.start for n in plan.nodes if n.node_id == member.node_id)


@st.composite
def estimates(draw: st.DrawFn, max_layers: int = 100) -> ModelEstimate:
    n_layers = draw(st.integers(1, max_layers))
    if draw(st.booleans()):
        weights = (draw(st.integers(1, 1000)),) * n_layers
    else:
        weights = tuple(draw(st.lists(st.integers(1, 1000), min_size=n_layers, max_size=n_layers)))
    return ModelEstimate(
        n_layers=n_layers,
        layer_weight_bytes=weights,
        host_bytes=draw(st.integers(0, 10_000)),
        output_bytes=draw(st.integers(0, 3000)),
        kv_bytes_per_layer=draw(st.integers(0, 300)),
        n_ctx=N_CTX,
        compute_margin_bytes=draw(st.integers(0, 2000)),
    )


@st.composite
def meshes(
    draw: st.DrawFn, max_nodes: int = 8, max_layers: int = 100, tight: bool = False
) -> tuple[list[NodeCapacity], ModelEstimate]:
    """Members with unique ids, sized so that plans both fit and fail (mostly fail if tight)."""
    est = draw(estimates(max_layers))
    whole = est.range_bytes(0, est.n_layers, with_output=True)
    n_nodes = draw(st.integers(1, max_nodes))
    layers = est.range_bytes(0, est.n_layers, with_output=False) - est.compute_margin_bytes
    if tight:
        sizes = st.integers(0, 100).map(lambda p: whole // 2 * p // 100)
    else:
        # Mostly room for a margin, an output head and a share of the layers;
        # sometimes anything up to that, so nodes get left out.
        fixed = est.compute_margin_bytes + est.output_bytes
        share = 3 * layers // n_nodes
        percent = st.integers(0, 100)
        sizes = st.one_of(
            percent.map(lambda p: fixed + share * p // 100), percent.map(lambda p: (fixed + share) * p // 100)
        )
    usable = draw(st.lists(sizes, min_size=n_nodes, max_size=n_nodes))
    return nodes(*usable), est


def plan_or_none(members: list[NodeCapacity], est: ModelEstimate) -> Plan | None:
    try:
        return plan_layers(members, est)
    except PlanError:
        return None


# --- the shape of every plan -------------------------------------------------


@settings(max_examples=400)
@given(meshes())
def test_ranges_are_contiguous_disjoint_cover_all_layers_in_member_order(mesh):
    members, est = mesh
    plan = plan_or_none(members, est)
    assume(plan is not None)
    assert plan.n_layers == est.n_layers
    assert plan.nodes[0].start == 0
    assert plan.nodes[-1].end == est.n_layers
    for before, after in zip(plan.nodes, plan.nodes[1:], strict=False):
        assert before.end == after.start
    assert all(n.end - n.start >= 1 for n in plan.nodes)
    order = [m.node_id for m in members]
    positions = [order.index(n.node_id) for n in plan.nodes]
    assert positions == sorted(positions)
    # Every member is either a participant or left out, exactly once.
    assert sorted([n.node_id for n in plan.nodes] + [m.node_id for m in plan.left_out]) == sorted(order)
    left_out_positions = [order.index(m.node_id) for m in plan.left_out]
    assert left_out_positions == sorted(left_out_positions)


@settings(max_examples=400)
@given(meshes())
def test_no_node_needs_more_than_it_can_give(mesh):
    members, est = mesh
    plan = plan_or_none(members, est)
    assume(plan is not None)
    for i, n in enumerate(plan.nodes):
        last = i == len(plan.nodes) - 1
        assert n.output_bytes == (est.output_bytes if last else 0)
        assert n.weights_bytes == sum(est.layer_weight_bytes[n.start:n.end])
        assert n.kv_bytes == est.kv_bytes_per_layer * (n.end - n.start)
        assert n.needed_bytes == est.range_bytes(n.start, n.end, with_output=last)
        assert n.needed_bytes == n.weights_bytes + n.kv_bytes + n.output_bytes + est.compute_margin_bytes
        assert n.needed_bytes <= n.usable_bytes
        assert n.usable_bytes == next(m.usable_bytes for m in members if m.node_id == n.node_id)


@settings(max_examples=400)
@given(meshes(), st.data())
def test_more_capacity_never_means_fewer_layers(mesh, data):
    members, est = mesh
    j = data.draw(st.integers(0, len(members) - 1))
    extra = data.draw(st.integers(1, 2 * est.range_bytes(0, est.n_layers, with_output=True)))
    grown = list(members)
    grown[j] = replace(members[j], usable_bytes=members[j].usable_bytes + extra)
    before = plan_or_none(members, est)
    assume(before is not None)
    after = plan_or_none(grown, est)
    assert after is not None, "more capacity turned a plan into an error"
    assert layers_of(after, grown[j]) >= layers_of(before, members[j])


@settings(max_examples=200)
@given(meshes())
def test_plans_are_deterministic(mesh):
    members, est = mesh
    first = plan_or_none(members, est)
    assert plan_or_none(list(members), est) == first


# --- how many layers each ----------------------------------------------------


def test_equal_nodes_split_evenly_earlier_ones_take_the_remainder():
    assert counts(plan_layers(nodes(100, 100, 100, 100), estimate(80))) == [20, 20, 20, 20]
    assert counts(plan_layers(nodes(100, 100, 100, 100), estimate(82))) == [21, 21, 20, 20]
    assert counts(plan_layers(nodes(100, 100, 100, 100), estimate(83))) == [21, 21, 21, 20]


def test_seed_example_ranges():
    plan = plan_layers(nodes(100, 100, 100, 100), estimate(82))
    assert [(n.start, n.end) for n in plan.nodes] == [(0, 21), (21, 42), (42, 62), (62, 82)]


def test_layers_follow_capacity():
    assert counts(plan_layers(nodes(200, 100), estimate(90))) == [60, 30]
    assert counts(plan_layers(nodes(10 * GIB, 20 * GIB, 10 * GIB), estimate(80, GIB // 100))) == [20, 40, 20]


@settings(max_examples=300)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=8), st.integers(1, 200))
def test_unconstrained_counts_are_close_to_proportional(weights, n_layers):
    assume(n_layers >= len(weights))
    # Scale so that every node could hold the whole model: only the weights matter.
    members = nodes(*(w * 10**6 for w in weights))
    got = counts(plan_layers(members, estimate(n_layers)))
    for count, w in zip(got, weights, strict=True):
        quota = n_layers * w / sum(weights)
        assert abs(count - quota) <= len(weights)
    # D'Hondt: every layer past a node's first went at an average (weight / count)
    # no lower than any node's next one, weight / (count + 1); ties to the earlier node.
    for i, (count_i, w_i) in enumerate(zip(got, weights, strict=True)):
        for j, (count_j, w_j) in enumerate(zip(got, weights, strict=True)):
            if count_i >= 2:
                taken, passed_over = Fraction(w_i, count_i), Fraction(w_j, count_j + 1)
                assert taken > passed_over or (taken == passed_over and i < j)


def test_a_node_too_small_for_one_layer_is_left_out():
    est = estimate(10, 100, margin=50, output=30)
    members = nodes(1000, 149, 1000)  # one layer and its margin take 150
    plan = plan_layers(members, est)
    assert plan.left_out == (members[1],)
    assert [n.node_id for n in plan.nodes] == [members[0].node_id, members[2].node_id]
    assert counts(plan) == [5, 5]


def test_a_last_node_that_cannot_hold_the_output_hands_it_to_the_previous_one():
    est = estimate(10, 100, margin=50, output=30)
    members = nodes(1000, 1000, 179)  # fits a layer, but not a layer with the output head (180)
    plan = plan_layers(members, est)
    assert plan.left_out == (members[2],)
    assert plan.nodes[-1].node_id == members[1].node_id
    assert plan.nodes[-1].output_bytes == 30
    assert plan.nodes[0].output_bytes == 0


def test_more_nodes_than_layers_keeps_the_output_holder_and_the_largest():
    members = nodes(100, 300, 200, 300, 50)
    plan = plan_layers(members, estimate(3))
    assert [n.node_id for n in plan.nodes] == [members[1].node_id, members[3].node_id, members[4].node_id]
    assert counts(plan) == [1, 1, 1]
    assert plan.left_out == (members[0], members[2])


def _fits_somehow(members: list[NodeCapacity], est: ModelEstimate) -> bool:
    """Brute force: any ordered subset and any contiguous split that fits."""
    for size in range(1, min(len(members), est.n_layers) + 1):
        for chosen in itertools.combinations(members, size):
            for cuts in itertools.combinations(range(1, est.n_layers), size - 1):
                bounds = (0, *cuts, est.n_layers)
                if all(
                    est.range_bytes(bounds[i], bounds[i + 1], with_output=i == size - 1) <= m.usable_bytes
                    for i, m in enumerate(chosen)
                ):
                    return True
    return False


@settings(max_examples=300)
@given(
    st.lists(st.integers(0, 60), min_size=1, max_size=4),
    st.integers(1, 8),
    st.integers(1, 9),
    st.integers(0, 9),
    st.integers(0, 9),
)
def test_with_equal_blocks_a_plan_exists_exactly_when_any_layout_fits(
    usable, n_layers, layer, margin, output
):
    members, est = nodes(*usable), estimate(n_layers, layer, margin=margin, output=output)
    assert (plan_or_none(members, est) is not None) == _fits_somehow(members, est)


# --- when the mesh is too small ------------------------------------------------


def test_too_small_mesh_names_the_shortfall_and_the_fix():
    est = estimate(10, GIB, margin=GIB // 2, output=GIB // 2)
    # Each node fits two layers: 4 of 10 placed; 11.5 GiB needed, 6 GiB free.
    with pytest.raises(PlanError) as caught:
        plan_layers(nodes(3 * GIB, 3 * GIB), est)
    message = str(caught.value)
    assert isinstance(caught.value, SetupError)
    assert "has 6.0 GiB free" in message
    assert "needs 11.5 GiB (5.5 GiB short)" in message
    assert "Add a node with at least 6.5 GiB free" in message  # six layers and its own margin
    assert "--max-memory" in message and "--ctx-size" in message


def test_fragmented_mesh_names_the_layers_that_do_not_fit():
    est = estimate(3, GIB)
    # 1.5 + 1.5 GiB hold the 3 GiB in total, but only one whole layer each.
    with pytest.raises(PlanError) as caught:
        plan_layers(nodes(3 * GIB // 2, 3 * GIB // 2), est)
    message = str(caught.value)
    assert "2 of its 3 layers" in message
    assert "(1.0 GiB short)" in message
    assert "at least 1.0 GiB free" in message


def test_no_node_can_hold_the_output_head():
    est = estimate(4, GIB, output=2 * GIB)
    members = nodes(2 * GIB, 2 * GIB)
    with pytest.raises(PlanError) as caught:
        plan_layers(members, est)
    message = str(caught.value)
    assert "takes 3.0 GiB and the largest node has 2.0 GiB free (1.0 GiB short)" in message
    assert "host0 (node_00000000, 2.0 GiB)" in message


@settings(max_examples=400)
@given(meshes(max_nodes=3, tight=True))
def test_following_the_advice_makes_the_model_fit(mesh):
    members, est = mesh
    assume(plan_or_none(members, est) is None)
    with pytest.raises(PlanError) as caught:
        plan_layers(members, est)
    message = str(caught.value)
    assert re.search(r"\(\d+\.\d+ GiB short\)", message)
    advised = float(re.search(r"at least (\d+\.\d+) GiB free", message)[1])
    newcomer = NodeCapacity(b"\xff" * 32, "new", round(advised * GIB))
    plan_layers([newcomer, *members], est)


# --- llama.cpp's --tensor-split ------------------------------------------------


def llama_cpp_devices(split: tuple[int, ...], n_layers: int) -> list[int]:
    """The device of each of the n_layers + 1 offloaded layers, computed as llama.cpp does.

    llama_model::load_tensors: cumulative split sums in float32, normalised, and
    ``upper_bound(splits, float(il) / act_gpu_layers)`` with act_gpu_layers = n_layers + 1.
    """
    cumulative = np.cumsum(np.array(split, dtype=np.float32), dtype=np.float32)
    fractions = cumulative / cumulative[-1]
    act = n_layers + 1
    positions = [np.float32(il) / np.float32(act) for il in range(act)]
    return [int(np.searchsorted(fractions, position, side="right")) for position in positions]


@settings(max_examples=400)
@given(meshes())
def test_tensor_split_reproduces_the_planned_ranges_in_llama_cpp(mesh):
    members, est = mesh
    plan = plan_or_none(members, est)
    assume(plan is not None)
    split = plan.tensor_split()
    assert sum(split) == est.n_layers + 1
    expected = [d for d, n in enumerate(plan.nodes) for _ in range(n.start, n.end)]
    expected.append(len(plan.nodes) - 1)  # the output head
    assert llama_cpp_devices(split, est.n_layers) == expected
    assert list(assign_layers(est.n_layers, split)) == expected


def test_to_json():
    members = nodes(2000, 1000)
    plan = plan_layers([*members, node(9, 1)], estimate(3, 100, margin=10, output=5, kv=20))
    excluded = Exclusion("weights_mismatch", "host7 holds another file", "")
    plan = dataclasses.replace(plan, refused=((node(7, 50), excluded),))
    assert plan.to_json() == {
        "nodes": [
            {"id": members[0].node_id.hex(), "name": "host0", "device": "", "layers": [0, 2], "weights_bytes": 200,
             "kv_bytes": 40, "output_bytes": 0, "needed_bytes": 250, "free_bytes": 2000,
             "decode_bytes_per_s": 0.0, "speed_settled": True, "token_ms": None},
            {"id": members[1].node_id.hex(), "name": "host1", "device": "", "layers": [2, 3], "weights_bytes": 100,
             "kv_bytes": 20, "output_bytes": 5, "needed_bytes": 135, "free_bytes": 1000,
             "decode_bytes_per_s": 0.0, "speed_settled": True, "token_ms": None},
        ],
        "left_out": [{"id": (bytes([9]) * 32).hex(), "name": "host9", "device": "", "free_bytes": 1,
                      "decode_bytes_per_s": 0.0, "speed_settled": True}],
        "refused": [{"id": (bytes([7]) * 32).hex(), "name": "host7", "free_bytes": 50,
                     "reason": "weights_mismatch", "detail": "host7 holds another file"}],
        "n_layers": 3,
        "tensor_split": [2, 2],
        "by": "memory",
        "expected_tokens_per_s": None,
        "memory_plan_tokens_per_s": None,
        "model": "",
        "model_name": None,
        "kv_cache_type": "f16/f16",
        "projector_bytes": 0,
        "tiers": [],
        "assignment": [],
    }


def test_alone_means_the_serving_node_holds_the_model_not_that_one_node_does():
    worker, serving = node(1, 1000), node(2, 1000)
    est = estimate(3, 100, margin=10, output=5)
    assert plan_layers([serving], est).alone
    # The serving node too small for a layer: the one node is the worker, reached over --rpc.
    on_worker = plan_layers([worker, node(2, 1)], est)
    assert [n.name for n in on_worker.nodes] == ["host1"] and not on_worker.alone
    assert on_worker.tensor_split() == (4,)
    two_devices = plan_layers([worker, *device_shares(serving.node_id, "s", 2000, (OfferedDevice("GPU0", 1, 1),
                                                                                  OfferedDevice("GPU1", 1, 1)))],
                              estimate(6, 100, margin=10, output=5))
    assert not two_devices.alone  # two devices of the serving node: its own rpc-server, over --rpc


def test_a_member_with_two_devices_is_planned_as_two_and_the_split_follows_llama_servers_devices():
    worker, serving = bytes([1]) * 32, bytes([2]) * 32
    # The worker's GPU is too small for a layer and its margin: left out, but llama-server still lists it.
    members = [*device_shares(worker, "w", 650, (OfferedDevice("Vulkan0", 100, 50), OfferedDevice("CPU", 900, 600))),
               *device_shares(serving, "s", 600, (OfferedDevice("CPU", 900, 600),))]
    assert [(m.device, m.usable_bytes) for m in members] == [("Vulkan0", 50), ("CPU", 600), ("CPU", 600)]
    plan = plan_layers(members, estimate(10, 100, margin=10, output=5))
    assert [(n.name, n.device) for n in plan.nodes] == [("w", "CPU"), ("s", "CPU")]
    assert [m.device for m in plan.left_out] == ["Vulkan0"]
    assert plan.rpc_nodes() == (worker, serving)  # each rpc-server once in --rpc
    split = plan.tensor_split()
    assert split[0] == 0 and len(split) == 3  # one weight per device llama-server lists
    expected = [1 + d for d, n in enumerate(plan.nodes) for _ in range(n.start, n.end)] + [2]
    assert llama_cpp_devices(split, 10) == expected
    # Both devices big enough: both hold layers, shared by their free memory.
    both = device_shares(worker, "w", 1200, (OfferedDevice("Vulkan0", 800, 600), OfferedDevice("CPU", 900, 600)))
    plan = plan_layers([*both, *device_shares(serving, "s", 600, ())], estimate(10, 100, margin=10, output=5))
    assert [(n.name, n.device) for n in plan.nodes] == [("w", "Vulkan0"), ("w", "CPU"), ("s", "")]
    assert llama_cpp_devices(plan.tensor_split(), 10) == [
        d for d, n in enumerate(plan.nodes) for _ in range(n.start, n.end)] + [2]


# --- plans by speed -------------------------------------------------------------------------


def fast_and_slow(usable: int, speed: float, link_s: float = 0.0, index: int = 0) -> NodeCapacity:
    return NodeCapacity(bytes([index]) * 32, f"host{index}", usable, decode_bytes_per_s=speed, link_s=link_s)


def brute_force_best_s(members: list[NodeCapacity], model: ModelEstimate) -> float:
    """The least token time over every split of the layers into contiguous runs that fits (output last)."""
    best = float("inf")
    n = model.n_layers
    for cuts in itertools.product(range(n + 1), repeat=len(members) - 1):
        bounds = [0, *cuts, n]
        if any(a > b for a, b in itertools.pairwise(bounds)) or bounds[-2] == n:
            continue  # runs must be in order, and the output holder holds a layer
        total = 0.0
        fits = True
        for i, member in enumerate(members):
            start, end = bounds[i], bounds[i + 1]
            if start == end:
                continue
            last = i == len(members) - 1
            if model.range_bytes(start, end, with_output=last) > member.usable_bytes:
                fits = False
                break
            total += (sum(model.layer_weight_bytes[start:end]) + (model.output_bytes if last else 0)) \
                / member.decode_bytes_per_s + member.link_s
        if fits:
            best = min(best, total)
    return best


def test_a_fast_device_takes_what_it_can_hold_and_the_slow_one_the_rest():
    # A GPU box with 24 units before a laptop (serving, the output holder) with 64: by memory the
    # laptop gets most layers; by speed the GPU box fills up first.
    gpu = fast_and_slow(2400, 8000.0, link_s=0.001, index=1)
    laptop = fast_and_slow(6400, 1000.0, index=2)
    model = estimate(30, 100, margin=10, output=5)
    memory = plan_layers([gpu, laptop], model)
    speed = plan_layers([gpu, laptop], model, by=PlanBy.SPEED)
    assert counts(memory) == [8, 22] and memory.by is PlanBy.MEMORY
    assert speed.by is PlanBy.SPEED and counts(speed) == [23, 7]  # the GPU box's cap: 23 layers and its margin
    assert speed.token_s is not None and memory.token_s is not None and speed.token_s < 0.5 * memory.token_s
    assert speed.memory_token_s == memory.token_s
    assert speed.to_json()["expected_tokens_per_s"] > speed.to_json()["memory_plan_tokens_per_s"]
    assert llama_cpp_devices(speed.tensor_split(), 30) == [0] * 23 + [1] * 8


def test_a_member_joins_only_when_it_makes_tokens_faster_or_the_model_needs_it():
    model = estimate(10, 100, margin=10, output=5)
    slow_worker = fast_and_slow(5000, 500.0, link_s=0.01, index=1)
    serving = fast_and_slow(5000, 1000.0, index=2)
    plan = plan_layers([slow_worker, serving], model, by=PlanBy.SPEED)
    assert [n.name for n in plan.nodes] == ["host2"] and [m.name for m in plan.left_out] == ["host1"]
    # The serving node cannot hold it all: the slow worker takes only what is left.
    small = fast_and_slow(700, 1000.0, index=2)
    plan = plan_layers([slow_worker, small], model, by=PlanBy.SPEED)
    assert counts(plan) == [4, 6]


def test_equal_speeds_keep_the_memory_plan():
    members = [fast_and_slow(u, 1000.0, index=i) for i, u in enumerate((3000, 2000, 1500))]
    model = estimate(20, 100, margin=10, output=5)
    assert layouts(plan_layers(members, model, by=PlanBy.SPEED)) == layouts(plan_layers(members, model))
    # Within the gain that makes a speed plan worth it, too: measured speeds move a little.
    near = [replace(m, decode_bytes_per_s=1000.0 * (1 + 0.05 * i)) for i, m in enumerate(members)]
    assert plan_layers(near, model, by=PlanBy.SPEED).by is PlanBy.MEMORY


def test_an_unknown_speed_plans_by_memory():
    members = [fast_and_slow(3000, 1000.0, index=0), fast_and_slow(2000, 0.0, index=1)]
    plan = plan_layers(members, estimate(20, 100, margin=10), by=PlanBy.SPEED)
    assert plan.by is PlanBy.MEMORY and plan.token_s is None


def test_spread_by_speed_balances_the_stages():
    members = [fast_and_slow(5000, s, index=i) for i, s in enumerate((4000.0, 1000.0, 3000.0))]
    plan = plan_layers(members, estimate(16, 100, margin=10), by=PlanBy.SPEED, spread=True)
    assert counts(plan) == [8, 2, 6]
    assert plan.by is PlanBy.SPEED


def layouts(plan: Plan) -> list[tuple[str, int, int]]:
    return [(n.name, n.start, n.end) for n in plan.nodes]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(100, 2000), st.sampled_from([250.0, 1000.0, 4000.0]),
                          st.sampled_from([0.0, 0.01])), min_size=1, max_size=3),
       st.integers(1, 8))
def test_the_speed_plan_is_never_slower_than_memory_and_near_the_best_split(specs, n_layers):
    members = [fast_and_slow(u, s, link_s=link, index=i) for i, (u, s, link) in enumerate(specs)]
    model = estimate(n_layers, 100, margin=10, output=5)
    try:
        memory = plan_layers(members, model)
    except PlanError:
        return
    speed = plan_layers(members, model, by=PlanBy.SPEED)
    assert speed.token_s is not None and memory.token_s is not None
    # The speeds compared are those of the members that could hold a layer: one that cannot is in no plan
    # (hypothesis found a slow member too small for a layer beside two of the same speed).
    could_hold, _ = _participants(members, model, _largest_layers_prefix_sums(model), prune=False)
    if not speeds_differ([members[i].decode_bytes_per_s for i in could_hold]):
        assert speed == memory  # about the same speed: today's plan
        return
    assert speed.token_s <= memory.token_s * (1 + 1e-9)
    if speed.by is PlanBy.SPEED:
        assert speed.token_s <= (1 - SPEED_PLAN_MIN_GAIN) * memory.token_s * (1 + 1e-9)
    # Uniform layers and conservative caps: the speed plan's choice is the brute force's best, or
    # within the gain it needs to replace the memory plan.
    best = brute_force_best_s(members, model)
    assert speed.token_s <= best / (1 - SPEED_PLAN_MIN_GAIN) * (1 + 1e-9)
