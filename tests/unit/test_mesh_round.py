"""One plan is the truth about who is used (issue 50): llama-server's --rpc list, the members table and
`plan --json`, and what gossip announces (so the assignment every other member computes) all come from
the plan a serving node runs: alone, over the fewest workers, with --spread, with tiers, beside another
serving node. The sizes are issue 50's: members offering 300 MiB, a 0.50 GiB model whose input embeddings
leave the serving node no room for the head beside a layer, and SmolLM2-135M (0.24 GiB)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import PurePath
from types import SimpleNamespace

import pytest
from rich.console import Console

from mesh_sidecar.cli.views import plan_view
from mesh_sidecar.llama.capacity import Capacity
from mesh_sidecar.llama.estimate import ModelEstimate
from mesh_sidecar.mesh.exclusion import WEIGHTS_MISMATCH
from mesh_sidecar.serve.mesh_round import MeshRound, planning_members
from mesh_sidecar.serve.planner import Plan, PlanBy, model_needs
from mesh_sidecar.serve.replan import Tier, plan_largest
from mesh_sidecar.serve.speeds import ObservedSpeeds
from mesh_sidecar.serve.tiers import model_id
from mesh_sidecar.wire.gossip import MemberInfo, OfferedDevice, ServedModel
from tests.unit.test_gossip import info

MIB = 1 << 20
CAP = 300 * MIB


def mib_estimate(n_layers: int, layer_mib: float, margin_mib: float, embeddings_mib: float) -> ModelEstimate:
    """A model by its sizes: tied embeddings (on the serving node, and a copy as the head on the last device)."""
    return ModelEstimate(n_layers, (int(layer_mib * MIB),) * n_layers, int(embeddings_mib * MIB),
                         int(embeddings_mib * MIB), 0, 4096, int(margin_mib * MIB))


SMOL = Tier(PurePath("/models/SmolLM2-135M-Instruct.Q4_1.gguf"), mib_estimate(30, 5.1, 33.9, 28.7))
REACH = Tier(PurePath("/models/reach-test.gguf"), mib_estimate(18, 11.5, 33.5, 144.0))


def nid(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def member(name: str) -> MemberInfo:
    return info(nid(name), name, capacity=(("usable_bytes", CAP),))


@dataclasses.dataclass
class MeshSeen:
    """What planning_members reads of the mesh, as one member sees it."""

    self_info: MemberInfo
    members: list[MemberInfo]

    @property
    def devices(self) -> tuple[OfferedDevice, ...]:
        return self.self_info.devices

    def connected_members(self) -> list[MemberInfo]:
        return sorted((m for m in self.members if m.node_id != self.self_info.node_id), key=lambda m: m.node_id)

    def peer_views(self) -> tuple[()]:
        return ()

    def held_for_peers_bytes(self) -> int:
        return 0


def share(name: str, members: list[MemberInfo], tiers: tuple[Tier, ...], *, since: float = 0.0,
          spread: bool = False, by: PlanBy = PlanBy.MEMORY, own_bytes: int = CAP,
          observed: ObservedSpeeds | None = None) -> MeshRound:
    """``name``'s round, as planning_members reads it from the mesh (``own_bytes``: what it offers itself)."""
    me = next(m for m in members if m.name == name)
    return planning_members(MeshSeen(me, members), SimpleNamespace(node_id=me.node_id), name,
                            Capacity(own_bytes, own_bytes, own_bytes), tiers, since=since, spread=spread, by=by,
                            observed=observed)


def run(name: str, members: list[MemberInfo], tiers: tuple[Tier, ...], **options) -> Plan:
    """The plan ``name`` runs, as the serving loop makes it: the largest tier over its round, and the round's roles."""
    round_ = share(name, members, tiers, **options)
    return round_.with_plan(plan_largest(tiers, round_.members, round_.refused, by=options.get("by", PlanBy.MEMORY),
                                         spread=options.get("spread", False))[1])


def announced(plan: Plan, tiers: tuple[Tier, ...], since: float, spread: bool = False) -> ServedModel:
    """What the serving node says in gossip of the plan it runs (supervisor.served)."""
    tier = next(t for t in tiers if t.path.name == plan.model)
    needs = model_needs(model_id(plan.model), tier.estimate)
    return ServedModel(needs.model, "ready", since, 0, needs.alone_bytes, needs.margin_bytes, needs.layer_bytes,
                       spread, plan.rpc_nodes())


def names(node_ids: Iterable[bytes]) -> set[str]:
    return {node_id.rstrip(b"\0").decode() for node_id in node_ids}


def check_agreement(serving: str, plan: Plan) -> None:
    """--rpc (rpc_nodes), the plan's layers, its JSON's assignment and the members table name the same members."""
    rpc = names(plan.rpc_nodes())
    assert rpc == {node.name for node in plan.nodes}
    body = plan.to_json()
    roles = {role["name"]: role for role in body["assignment"]}
    workers = {name for name, role in roles.items() if role["serves_with"] == nid(serving).hex() and name != serving}
    assert workers == rpc - {serving}, (workers, rpc, roles)
    for name, role in roles.items():
        if name in workers:
            assert role["why"] == f"holds layers of {model_id(plan.model)} for {serving}", role
        elif name != serving:
            assert "holds layers" not in role["why"] and role["serves_with"] != nid(serving).hex(), role
    console = Console(width=100, record=True)
    console.print(plan_view(body))
    table = console.export_text().split("Members", 1)[1]
    rows = {line.split()[0]: line for line in table.splitlines() if line.strip() and line.split()[0] in roles}
    assert {name for name, line in rows.items() if "holds layers" in line} == workers


def check_others_see_it(serving: str, plan: Plan, members: list[MemberInfo]) -> None:
    """Every other member's assignment, from the plan's announcement, gives the serving node exactly its
    plan's workers: none is free for another serving node (`plan` on any member shows them taken)."""
    workers = names(plan.rpc_nodes()) - {serving}
    for other in members:
        if other.name == serving:
            continue
        # `plan` there plans as if that member began serving now (it is then no worker itself).
        seen = run(other.name, members, (SMOL,), since=1e12)
        taken = {role.name for role in seen.roles if role.serves_with == nid(serving)} - {serving}
        assert taken == workers - {other.name}, (other.name, taken, workers)


def serving_with(members: list[MemberInfo], name: str, plan: Plan, tiers: tuple[Tier, ...], since: float = 0.0,
                 spread: bool = False) -> list[MemberInfo]:
    """``members`` once ``name`` announces ``plan``."""
    return [dataclasses.replace(m, serving=True, serves=announced(plan, tiers, since, spread)) if m.name == name
            else m for m in members]


def three() -> list[MemberInfo]:
    return [member("a"), member("b"), member("c")]


def test_alone():
    plan = run("c", three(), (SMOL,))
    assert plan.alone and names(plan.rpc_nodes()) == {"c"}
    check_agreement("c", plan)
    assert next(r for r in plan.roles if r.name == "c").why.startswith(f"serves {model_id(SMOL.path.name)} alone")
    check_others_see_it("c", plan, serving_with(three(), "c", plan, (SMOL,)))


def test_the_fewest_workers_the_planner_needs():
    # Issue 50 (2): the plan gave a and b layers and left c out, the members table said one worker and
    # "b not needed".
    plan = run("c", three(), (REACH,))
    assert names(plan.rpc_nodes()) == {"a", "b"} and [m.name for m in plan.left_out] == ["c"]
    check_agreement("c", plan)
    role = next(r for r in plan.roles if r.name == "c")
    assert role.why.startswith("serves reach-test with 2 workers, those of its plan, holding no layer itself")
    check_others_see_it("c", plan, serving_with(three(), "c", plan, (REACH,)))


def test_spread():
    plan = run("c", three(), (SMOL,), spread=True)
    assert names(plan.rpc_nodes()) == {"a", "b", "c"}
    check_agreement("c", plan)
    check_others_see_it("c", plan, serving_with(three(), "c", plan, (SMOL,), spread=True))


def test_tiers():
    tiers = (REACH, SMOL)
    plan = run("c", three(), tiers)
    # Issue 50 (1): the small tier fits c alone, the big one over both workers; the pool holds it.
    assert plan.model == REACH.path.name and names(plan.rpc_nodes()) == {"a", "b"}
    assert [(t.model, t.fits, t.offered_bytes) for t in plan.tiers] == [(REACH.path.name, True, 3 * CAP),
                                                                        (SMOL.path.name, True, CAP)]
    check_agreement("c", plan)
    two = [member("a"), member("c")]
    smaller = run("c", two, tiers)
    assert smaller.model == SMOL.path.name and smaller.alone
    # The big tier is weighed, and refused, over every member c could use.
    assert [(t.fits, t.offered_bytes) for t in smaller.tiers] == [(False, 2 * CAP), (True, CAP)]
    check_agreement("c", smaller)
    console = Console(width=100, record=True)
    console.print(plan_view(smaller.to_json()))
    caption = " ".join(console.export_text().split())  # the caption wraps
    assert "reach-test.gguf needs 0.52 GiB (does not fit in the 0.59 GiB offered)" in caption


def test_two_serving_nodes():
    # c began serving first and takes the two workers its plan needs; d, later, gets what is left (e).
    members = [member("a"), member("b"), member("c"), member("d"), member("e")]
    plan_c = run("c", members, (REACH,), since=1.0)
    assert names(plan_c.rpc_nodes()) == {"a", "b"}
    members = serving_with(members, "c", plan_c, (REACH,), since=1.0)
    plan_d = run("d", members, (SMOL,), since=2.0, spread=True)
    assert names(plan_d.rpc_nodes()) == {"e", "d"}
    members = serving_with(members, "d", plan_d, (SMOL,), since=2.0, spread=True)
    for name, plan, tiers, since, spread in (("c", plan_c, (REACH,), 1.0, False), ("d", plan_d, (SMOL,), 2.0, True)):
        again = run(name, members, tiers, since=since, spread=spread)
        assert again.rpc_nodes() == plan.rpc_nodes()  # the announcements change no one's plan
        check_agreement(name, again)
        roles = {role.name: role for role in again.roles}
        other, their = ("d", {"e"}) if name == "c" else ("c", {"a", "b"})
        assert {n for n, r in roles.items() if r.serves_with == nid(other)} == their | {other}


def test_a_plan_on_one_worker_is_not_alone():
    # The test engineer's case: c offers too little for any layer, so a holds the model; c's llama-server
    # must run with --rpc to a (not alone, which would load the whole model on c against --max-memory).
    plan = run("c", [member("a"), member("c")], (SMOL,), own_bytes=60 * MIB)
    assert names(plan.rpc_nodes()) == {"a"} and not plan.alone
    assert plan.tensor_split() == (SMOL.estimate.n_layers + 1,)  # every layer and the head on a's device
    check_agreement("c", plan)


def test_a_plan_in_service_shows_a_member_refused_after_it_was_made():
    # CI caught it: `plan` on a serving node showed the plan in service with the refused members of
    # its own round, so a member joining later with other weights was in neither list.
    plan = run("c", three(), (SMOL,))
    assert plan.refused == ()
    other = dataclasses.replace(member("e"), model_sha256="ee" * 32)
    members = [dataclasses.replace(m, model_sha256="cc" * 32) for m in three()] + [other]
    shown = share("c", members, (SMOL,)).with_plan(plan)
    assert [(m.name, why.reason) for m, why in shown.refused] == [("e", WEIGHTS_MISMATCH)]
    assert shown.rpc_nodes() == plan.rpc_nodes()


GIB = 1 << 30


def measured(m: MemberInfo, gib_per_s: float, settled: bool) -> MemberInfo:
    """``m`` announcing one CPU measured at ``gib_per_s``, settled or after one calibration."""
    return dataclasses.replace(m, devices=(OfferedDevice("CPU", 8 * GIB, 8 * GIB, int(gib_per_s * GIB), 0, settled),))


def by_speed(members: list[MemberInfo], observed: object = None) -> Plan:
    """c's plan of SMOL over every member, by speed (--spread: each takes part)."""
    return run("c", members, (SMOL,), by=PlanBy.SPEED, spread=True, observed=observed)


def layer_counts(plan: Plan) -> dict[str, int]:
    return {node.name: node.n_layers for node in plan.nodes}


def test_a_member_measured_once_under_load_is_not_weighed_below_the_others():
    # Issue 50 (3): identical members measured 14.7 and 2.7 GiB/s, the slow one while its machine was busy.
    once = [measured(member("a"), 14.7, True), measured(member("b"), 2.7, False), measured(member("c"), 14.7, True)]
    plan = by_speed(once)
    counts = layer_counts(plan)
    assert plan.by is PlanBy.MEMORY and abs(counts["a"] - counts["b"]) <= 1  # alike: its speed is unknown yet
    b = next(node for node in plan.nodes if node.name == "b")
    assert b.decode_bytes_per_s == 0 and not b.speed_settled
    console = Console(width=120, record=True)
    console.print(plan_view(plan.to_json()))
    text = console.export_text()
    row = next(line for line in text.splitlines() if line.startswith("b "))
    assert row.split()[-2] == "?" and "?: one measurement of that device so far" in " ".join(text.split())
    # Settled at that speed (two calibrations agreed), b is slow indeed: it gets fewer layers.
    settled = by_speed([once[0], measured(member("b"), 2.7, True), once[2]])
    assert settled.by is PlanBy.SPEED and layer_counts(settled)["b"] < layer_counts(settled)["a"]
    # Unsettled but within SAME_SPEED_RATIO of the fastest: counted, and marked.
    near = by_speed([once[0], measured(member("b"), 12.0, False), once[2]])
    b = next(node for node in near.nodes if node.name == "b")
    assert b.decode_bytes_per_s == pytest.approx(12.0 * GIB) and not b.speed_settled
    # The traffic confirms it: b ran at 3 GiB/s on its share, so it counts at that (the larger).
    traffic = SimpleNamespace(observed_bytes_per_s=lambda node_id: 3.0 * GIB if node_id == nid("b") else None,
                              slowdown=lambda node_id: 1.0)
    confirmed = by_speed(once, traffic)
    b = next(node for node in confirmed.nodes if node.name == "b")
    assert b.decode_bytes_per_s == pytest.approx(3.0 * GIB) and b.speed_settled and confirmed.by is PlanBy.SPEED
