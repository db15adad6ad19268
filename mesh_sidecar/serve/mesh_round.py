"""A serving node's share of the mesh for one planning round, read from the live mesh: the members it
plans over, the tier it claims workers for (tiers.tier_claim), and every member's place once it runs a plan.

One plan is the truth about who is used: llama-server's ``--rpc`` list is its members, gossip announces
them (``ServedModel.members``), every node's assignment gives a serving node the members its plan
announces (assignment.py, rule 2), and `plan`, `status` and the members table show the roles
:meth:`MeshRound.with_plan` computes from that same plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..identity import NodeIdentity
from ..llama.capacity import Capacity
from ..mesh.exclusion import Exclusion, exclusion_of
from ..mesh.runtime import Mesh
from ..wire.gossip import MAX_SERVED_MEMBERS, OfferedDevice, ServedModel
from .assignment import Claim, ModelNeeds, Offer, assign, pool_for
from .planner import NodeCapacity, Plan, PlanBy, TierFit, device_shares, model_needs
from .replan import Tier, plan_largest
from .speeds import AnnouncedSpeed, ObservedSpeeds, weighable_speeds
from .tiers import model_id, tier_claim


@dataclass(frozen=True)
class MeshRound:
    """The members one planning round may use: this node's share of the mesh's workers (assignment.py)."""

    members: tuple[NodeCapacity, ...]  # to plan over, in device order: peers first (by id), this node last
    refused: tuple[tuple[NodeCapacity, Exclusion], ...]  # connected members left out, and why
    claim: Claim  # this node's: the tier its workers were picked for
    others: tuple[Claim, ...]  # the other serving members' claims, as their gossip says
    offers: tuple[Offer, ...]  # every connected member's and this node's, as the assignment takes them
    tiers: tuple[TierFit, ...]  # every tier, largest first, each weighed over its own claim (tiers.tier_claim)

    @property
    def unplanned(self) -> frozenset[bytes]:
        """The connected members, not refused, that this round does not plan over."""
        return frozenset(offer.node_id for offer in self.offers) - {member.node_id for member in self.members}

    @property
    def needs(self) -> ModelNeeds:
        """What this node claims: the tier its workers were picked for."""
        return self.claim.needs

    def with_plan(self, plan: Plan, model_name: str = "") -> Plan:
        """``plan`` with every member's place once this node runs it (its claim taking the plan's members,
        as its gossip announces them), the members refused now, and every tier as weighed over its own claim:
        a plan in service shows a member refused after it was made. ``model_name``: the model's hf: name."""
        mine = dataclasses.replace(self.claim, members=plan.rpc_nodes())
        roles = assign([*self.others, mine], self.offers).seen_by(self.claim.node_id)
        return dataclasses.replace(plan, roles=tuple(roles.values()), tiers=self.tiers, refused=self.refused,
                                   model_name=model_name)


def announced_members(served: ServedModel) -> tuple[bytes, ...] | None:
    """The members of the plan a serving member runs, as its gossip announces them; None while it has no
    plan, and for a plan of more members than gossip lists (its claim is then counted conservatively)."""
    return served.members if 0 < len(served.members) < MAX_SERVED_MEMBERS else None


def planning_members(mesh: Mesh, identity: NodeIdentity, name: str, own: Capacity, tiers: Sequence[Tier], *,
                     since: float = math.inf, spread: bool = False, by: PlanBy = PlanBy.SPEED,
                     observed: ObservedSpeeds | None = None) -> MeshRound:
    """The members to plan ``tiers`` over, and those refused with the reason.

    Every serving member claims workers in gossip (``MemberInfo.serves``); this node takes, from the
    workers the claims before its own leave free (its pool), the fewest over which the planner holds the
    largest tier the whole pool can hold (all of them with ``spread``): each tier is weighed over the
    pool, not over the workers of the tier in service, so a bigger tier is seen to fit and the step-up
    rules apply (tiers.tier_claim). ``since``: when this node began serving (infinite: it does not
    serve, as `plan` on a worker shows). Peers come first (by id) and this node last: llama.cpp puts
    the output layer on the last device, so the logits (vocabulary x 4 bytes a token) stay on loopback
    instead of crossing the network. ``by``: this node's --plan-by; ``observed``: what the traffic showed
    of each worker (speeds.py): how fast it ran, confirming a speed of one calibration, and how much slower
    than that it runs now, dividing its devices' speeds.
    """
    me = identity.node_id
    offers, refused, claims = [], [], []
    devices = {me: mesh.devices, **{info.node_id: info.devices for info in mesh.connected_members()}}
    observed = observed or ObservedSpeeds()
    links_s = {view.node_id: view.rtt_typical_s or 0.0 for view in mesh.peer_views()}
    factors = speed_factors(devices, observed)

    def speed_of(node_id: bytes) -> float:
        """The member's fastest device, as planning may weigh it."""
        return max((device.decode_bytes_per_s for device in devices[node_id]), default=0) * factors[node_id]

    def shares(node_id: bytes, name: str, usable_bytes: int) -> list[NodeCapacity]:
        return device_shares(node_id, name, usable_bytes, devices[node_id], link_s=links_s.get(node_id, 0.0),
                             speed_factor=factors[node_id], settled=speed_settled(devices[node_id], observed, node_id))

    for info in mesh.connected_members():
        # Less what the member's rpc-server holds for other serving nodes (they run their own models).
        usable = Capacity.from_gossip(dict(info.capacity)).usable_for(me)
        if (served := info.serves) is not None:
            claims.append(Claim(info.node_id, served.since, ModelNeeds(
                served.model, served.alone_bytes, served.margin_bytes, served.layer_bytes), served.spread,
                served.by_speed, announced_members(served)))
        # As if this node served, so `plan` on any node shows what serving there would leave out.
        if (why := exclusion_of(info, mesh.self_info)) is not None:
            refused.append((NodeCapacity(info.node_id, info.name, usable), why))
            continue
        offers.append(Offer(info.node_id, info.name, usable, shares=info.llama_build.b2b,
                            serving=info.serving or served is not None, decode_bytes_per_s=speed_of(info.node_id)))
    # The tier planning takes each tier's input embeddings off this node's share.
    own_offer = Offer(me, name, max(0, own.usable_bytes - mesh.held_for_peers_bytes()), serving=True,
                      decode_bytes_per_s=speed_of(me))
    offers.append(own_offer)
    needs = [model_needs(model_id(tier.path.name), tier.estimate) for tier in tiers]
    # Only the claims before this node's decide its pool; its own claim's needs do not.
    mine = Claim(me, since, needs[0], spread, by is PlanBy.SPEED)
    pool = pool_for(me, [*claims, mine], offers)

    def members_with(workers: Sequence[Offer]) -> list[NodeCapacity]:
        members = [entry for w in sorted(workers, key=lambda w: w.node_id)
                   for entry in shares(w.node_id, w.name, w.usable_bytes)]
        return members + shares(me, name, own_offer.usable_bytes)

    claimed = tier_claim([(tier.path.name, tier.estimate) for tier in tiers], own_offer, pool, members_with,
                         spread=mine.spread, by_speed=mine.by_speed)
    return MeshRound(tuple(members_with(claimed.workers)), tuple(refused),
                     dataclasses.replace(mine, needs=needs[claimed.index]), tuple(claims), tuple(offers),
                     claimed.fits)


def plan_over_mesh(mesh: Mesh, identity: NodeIdentity, name: str, own: Capacity, tiers: Sequence[Tier], *,
                   since: float = math.inf, spread: bool = False, by: PlanBy = PlanBy.SPEED,
                   observed: ObservedSpeeds | None = None) -> Plan:
    """The plan of the largest of ``tiers`` this node's share of the mesh can hold now; PlanError if none."""
    round_ = planning_members(mesh, identity, name, own, tiers, since=since, spread=spread, by=by,
                              observed=observed)
    return round_.with_plan(plan_largest(tiers, round_.members, round_.refused, by=by, spread=spread)[1])



def speed_settled(devices: Sequence[OfferedDevice], observed: ObservedSpeeds, node_id: bytes) -> bool:
    """Whether a member's speed is confirmed: every device it measured settled, or the traffic saw it run."""
    return _devices_settled(devices) or observed.observed_bytes_per_s(node_id) is not None


def speed_factors(devices: Mapping[bytes, Sequence[OfferedDevice]], observed: ObservedSpeeds) -> dict[bytes, float]:
    """What each member's announced device speeds are multiplied by for planning: its fastest device as
    ``weighable_speeds`` lets plans weigh it (0: unknown, an unsettled speed far below another's; raised to
    what the traffic showed), over how much slower than that it runs now (``ObservedSpeeds.slowdown``)."""
    fastest = {node_id: max((device.decode_bytes_per_s for device in offered), default=0)
               for node_id, offered in devices.items()}
    weighable = weighable_speeds({node_id: AnnouncedSpeed(fastest[node_id], _devices_settled(offered),
                                                          observed.observed_bytes_per_s(node_id))
                                  for node_id, offered in devices.items()})
    return {node_id: weighable[node_id] / fastest[node_id] / observed.slowdown(node_id) if fastest[node_id] else 0.0
            for node_id in devices}


def _devices_settled(devices: Sequence[OfferedDevice]) -> bool:
    """Whether every device the member measured announces a settled speed (llama/calibration.py)."""
    return all(device.settled for device in devices if device.decode_bytes_per_s)
