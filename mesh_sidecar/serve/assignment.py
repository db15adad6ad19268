"""Which workers each serving node may use: a pure function of the serving nodes' claims and the members' offers.

Some members serve a model: each announces a *claim* (when it began serving, what its model
needs). Every member *offers* its rpc-server's memory. Stock rpc-server serves one client at a
time, so a worker holds layers for one serving node only, unless it *shares* (the b2b build's
rpc-server accepts several clients). The rule:

1. Claims pick in the order (since, node id); a claim from a member not connected is skipped.
2. A claim whose serving node runs a plan takes the workers of that plan (``Claim.members``,
   from the plan's members its gossip announces) that are still free: what llama-server
   uses is what every member counts as taken.
3. A claim with no plan yet takes, from the workers still free, the fewest that hold its model
   together with its own memory, largest offer first (ties by node id): none when it fits
   alone, all of them with ``--spread``, and all of them when even all fall short (the planner
   then names the shortfall).
4. A worker taken is no longer free for later claims, unless it shares. A serving member is
   never a worker.

By speed (a claim's ``by_speed``, the default, every offer's speed known, and the speeds not all
about the same: planner.speeds_differ): workers are taken fastest first instead of largest first
(speeds within SPEED_BAND of each other count as equal, largest first among them), and every free
worker much faster than the serving node itself (FASTER_WORKER) is taken too, even when the model
would fit without it: the planner gives it layers only where that makes tokens faster
(planner.py, "By speed").

Rule 3's test is conservative (:func:`fits`): each device added pays its own compute margin, and
a split by whole layers can leave up to about one layer unused where each device's run ends. So
each worker is counted at its offer less a margin and a layer. It is still a sum of bytes: it
cannot see that a serving node too small for the output head and a layer adds nothing, so only
the serving node itself, which can run the planner over its model (:func:`pick_workers`'
``holds``), knows the workers its plan takes; rule 2 makes every member count those.

Why (since, node id): a serving node that began earlier picks first, so it keeps its workers
when a new one starts; two that start at the same moment are ordered by node id, so they end
up with a plan each instead of both reaching for the same workers. Nothing depends on the order
of the inputs, so every node computes the same assignment from the same gossip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..units import format_gib

# Speeds within this ratio of each other (the fastest over the slowest) are the same speed: a calibration
# on a busy machine moves by tens of percent, and members of about the same speed keep the memory plan.
SAME_SPEED_RATIO = 1.6
# Speeds in the same band of this ratio are equal for the order workers are taken in.
SPEED_BAND = 1.5
# A free worker this many times faster than the serving node is taken even when not needed for memory.
FASTER_WORKER = 2.0


@dataclass(frozen=True)
class ModelNeeds:
    """What holding one model takes, as a serving node announces it (so others need not read its GGUF)."""

    model: str  # the model id, e.g. "SmolLM2-135M-Instruct-Q8_0"
    alone_bytes: int  # the whole model on the serving node alone: weights, KV, output head, a margin, input embeddings
    margin_bytes: int  # what each device added costs (its compute margin)
    layer_bytes: int  # the largest layer (a split can waste up to about one layer per device)


@dataclass(frozen=True)
class Offer:
    """One member's rpc-server as the others see it."""

    node_id: bytes
    name: str
    usable_bytes: int
    shares: bool = False  # its rpc-server accepts several clients (b2b): may be in several assignments
    serving: bool = False  # it serves a model itself: never a worker for another serving node
    decode_bytes_per_s: float = 0.0  # its devices' measured speed, as gossip says (the fastest); 0: unknown


@dataclass(frozen=True)
class Claim:
    """A serving node's claim on workers."""

    node_id: bytes  # the serving node
    since: float  # when it began serving (announced wall time): earlier claims pick first
    needs: ModelNeeds
    spread: bool = False  # --spread: take every free worker, a split over all members
    by_speed: bool = True  # take workers fastest first (see the module's docstring); False: --plan-by memory
    # The members of the plan it runs (rule 2), itself among them when it holds layers, in any order;
    # None: no plan known, so the fewest workers are picked (rule 3).
    members: tuple[bytes, ...] | None = None


@dataclass(frozen=True)
class Role:
    """One member's place in the assignment, for ``plan``: why it is in or out."""

    node_id: bytes
    name: str
    serves_with: bytes | None  # the serving node whose layers it holds (itself for a serving node); None: idle
    why: str  # one sentence, e.g. "holds layers of gemma for nodeB"


@dataclass(frozen=True)
class Assignment:
    """The workers of every serving node whose claim was taken, and every offered member's role."""

    workers: Mapping[bytes, tuple[bytes, ...]]  # serving node id -> its workers, largest offer first (empty: alone)
    roles: Mapping[bytes, Role]  # every member offered, serving or not
    models: Mapping[bytes, str]  # serving node id -> the model it claimed workers for

    def workers_of(self, serving: bytes) -> tuple[bytes, ...]:
        """``serving``'s workers; none for a node whose claim was not taken (or that made none)."""
        return self.workers.get(serving, ())

    def alone(self, serving: bytes) -> bool:
        """Whether ``serving``'s claim was taken with no workers: its model fits on it alone."""
        return serving in self.workers and not self.workers[serving]

    def seen_by(self, serving: bytes) -> dict[bytes, Role]:
        """The roles as ``serving`` tells them: workers of other serving nodes are "taken by" them."""
        seen = dict(self.roles)
        for node_id, role in self.roles.items():
            if node_id in self.workers_of(serving):
                seen[node_id] = Role(node_id, role.name, serving,
                                     f"holds layers of {self.models[serving]} for {self.roles[serving].name}")
            elif (owner := role.serves_with) is not None and owner not in (node_id, serving):
                seen[node_id] = Role(node_id, role.name, owner,
                                     f"taken by {self.roles[owner].name} for {self.models[owner]}")
        return seen


def needed_bytes(n_workers: int, needs: ModelNeeds) -> int:
    """What the serving node and ``n_workers`` workers must offer together to hold the model."""
    return needs.alone_bytes + n_workers * (needs.margin_bytes + needs.layer_bytes)


def fits(own_bytes: int, worker_bytes: Sequence[int], needs: ModelNeeds) -> bool:
    """Conservatively, whether the serving node's ``own_bytes`` and the workers' offers hold the model.

    Alone: ``own_bytes >= alone_bytes``. With k workers, each pays a margin and may waste a layer:
    ``own + sum(workers) >= alone_bytes + k * (margin_bytes + layer_bytes)``.
    """
    return own_bytes + sum(worker_bytes) >= needed_bytes(len(worker_bytes), needs)


def speeds_differ(speeds: Sequence[float]) -> bool:
    """Whether every speed is known and the fastest is more than SAME_SPEED_RATIO times the slowest
    (the planner's rule too)."""
    return bool(speeds) and min(speeds) > 0 and max(speeds) > SAME_SPEED_RATIO * min(speeds)


def largest_first(offers: Sequence[Offer]) -> tuple[Offer, ...]:
    """``offers`` by usable bytes, largest first, ties by node id: the order workers are taken in."""
    return tuple(sorted(offers, key=lambda offer: (-offer.usable_bytes, offer.node_id)))


def _speed_band(offer: Offer) -> int:
    return math.floor(math.log(offer.decode_bytes_per_s, SPEED_BAND))


def pick_workers(own: Offer, pool: Sequence[Offer], needs: ModelNeeds, spread: bool, by_speed: bool = False,
                 holds: Callable[[Sequence[Offer]], bool] | None = None) -> tuple[Offer, ...]:
    """The fewest of ``pool`` that, with ``own``, hold the model, largest offer first (ties by node id).

    None (alone) when ``own`` fits by itself; all of the pool with ``spread``, and when even all
    of it does not fit (the planner then names the shortfall). ``own`` is never its own worker.
    The k largest offers are the best k any pick could have, so the first prefix that holds it is
    the fewest. ``by_speed`` with every speed known: fastest first, and the much faster ones always.
    ``holds``: whether ``own`` with some workers holds the model; the conservative count (:func:`fits`)
    by default, the planner's own test on the serving node (tiers.tier_claim).
    """
    ordered = largest_first([offer for offer in pool if offer.node_id != own.node_id])
    if spread:
        return ordered
    faster: tuple[Offer, ...] = ()
    if by_speed and speeds_differ([own.decode_bytes_per_s, *(offer.decode_bytes_per_s for offer in ordered)]):
        ordered = tuple(sorted(ordered, key=lambda offer: -_speed_band(offer)))  # stable: largest first within
        faster = tuple(o for o in ordered if o.decode_bytes_per_s >= FASTER_WORKER * own.decode_bytes_per_s)
    if holds is None:
        def holds(workers: Sequence[Offer]) -> bool:
            return fits(own.usable_bytes, [offer.usable_bytes for offer in workers], needs)
    for k in range(len(ordered) + 1):
        picked = tuple(o for i, o in enumerate(ordered) if i < k or o in faster)
        if holds(picked):
            return picked
    return ordered


@dataclass(frozen=True)
class _Pick:
    """One claim's turn: the claim, its node's offer, and the workers it took."""

    claim: Claim
    own: Offer
    picked: tuple[Offer, ...]


def _inputs(claims: Sequence[Claim], offers: Sequence[Offer]) -> tuple[list[Claim], dict[bytes, Offer]]:
    """The claims in picking order and the offers by node id; ValueError when a node appears twice in either."""
    offered = {offer.node_id: offer for offer in offers}
    if len(offered) != len(offers):
        raise ValueError("assignment: a node offers twice")
    if len({claim.node_id for claim in claims}) != len(claims):
        raise ValueError("assignment: a node claims twice")
    return sorted(claims, key=_order), offered


def _order(claim: Claim) -> tuple[float, bytes]:
    return claim.since, claim.node_id


def _turns(ordered: Sequence[Claim], offered: Mapping[bytes, Offer],
           serving: frozenset[bytes]) -> tuple[list[_Pick], tuple[Offer, ...]]:
    """Each claim of ``ordered`` whose node is offered, picking from what the ones before it left;
    and what is left after the last, largest first. ``serving``: the members that are never workers."""
    free = largest_first([offer for offer in offered.values() if offer.node_id not in serving])
    picks = []
    for claim in ordered:
        own = offered.get(claim.node_id)
        if own is None:
            continue  # not connected: it cannot use workers through this mesh
        if claim.members is None:
            picked = pick_workers(own, free, claim.needs, claim.spread, claim.by_speed)
        else:
            picked = tuple(offer for offer in free if offer.node_id in claim.members)
        picks.append(_Pick(claim, own, picked))
        taken = {offer.node_id for offer in picked if not offer.shares}
        free = tuple(offer for offer in free if offer.node_id not in taken)
    return picks, free


def _serving(claims: Sequence[Claim], offered: Mapping[bytes, Offer]) -> frozenset[bytes]:
    """Who serves: a member that says so in its offer, or that claims."""
    return frozenset(claim.node_id for claim in claims) | {o.node_id for o in offered.values() if o.serving}


def pool_for(serving: bytes, claims: Sequence[Claim], offers: Sequence[Offer]) -> tuple[Offer, ...]:
    """The workers free for ``serving``, largest offer first: the offers of members that do not
    serve, less those taken (not sharing) by the claims that pick before it (earlier ``since``,
    ties by node id). A node with no claim picks after every claim. Every node computes the same.
    """
    ordered, offered = _inputs(claims, offers)
    mine = next((claim for claim in ordered if claim.node_id == serving), None)
    before = [claim for claim in ordered if mine is None or _order(claim) < _order(mine)]
    return _turns(before, offered, _serving(claims, offered) | {serving})[1]


def assign(claims: Sequence[Claim], offers: Sequence[Offer]) -> Assignment:
    """Every claim's workers and every offered member's role.

    Claims pick in the order (since, node id), each with :func:`pick_workers` from what the
    earlier ones left; a claim whose node has no offer (not connected) is skipped. Sharing
    workers stay free for later claims. ValueError when a node offers or claims twice.
    """
    ordered, offered = _inputs(claims, offers)
    serving = _serving(claims, offered)
    picks, _ = _turns(ordered, offered, serving)
    workers = {pick.claim.node_id: tuple(offer.node_id for offer in pick.picked) for pick in picks}
    models = {pick.claim.node_id: pick.claim.needs.model for pick in picks}
    roles = {pick.own.node_id: Role(pick.own.node_id, pick.own.name, pick.own.node_id, _serving_why(pick))
             for pick in picks}
    for node_id, offer in offered.items():
        if node_id in roles:
            continue
        if node_id in serving:
            roles[node_id] = Role(node_id, offer.name, node_id, "serves its own model")
            continue
        held_for = [pick for pick in picks if node_id in workers[pick.claim.node_id]]
        if held_for:
            roles[node_id] = Role(node_id, offer.name, held_for[0].claim.node_id, _worker_why(held_for))
        else:
            roles[node_id] = Role(node_id, offer.name, None, _idle_why(picks))
    return Assignment(workers, roles, models)


def _serving_why(pick: _Pick) -> str:
    claim, own, picked = pick.claim, pick.own.usable_bytes, pick.picked
    model, planned = claim.needs.model, claim.members is not None
    have = own + sum(offer.usable_bytes for offer in picked)
    # A plan held the model (the planner's count); without one, the conservative count's figure.
    need = claim.needs.alone_bytes if planned else needed_bytes(len(picked), claim.needs)
    amounts = f"{format_gib(need, up=True)} of {format_gib(have)} GiB free"
    if not picked:
        if planned or fits(own, [], claim.needs):
            return f"serves {model} alone: it fits ({amounts})"
        return f"serves {model} alone, with no worker free: it needs {amounts}"
    count = f"{len(picked)} worker{'s' if len(picked) > 1 else ''}"
    # The planner leaves out a serving node too small for the output head and a layer.
    itself = ", holding no layer itself" if planned and claim.node_id not in (claim.members or ()) else ""
    if claim.spread:
        return f"serves {model} over every free worker (--spread): {count}{itself}, {amounts}"
    if planned:
        return f"serves {model} with {count}, those of its plan{itself} ({amounts})"
    if not fits(own, [offer.usable_bytes for offer in picked], claim.needs):
        return f"serves {model} with every free worker ({count}), still short: it needs {amounts}"
    return f"serves {model} with {count}, the fewest that hold it ({amounts})"


def _worker_why(held_for: Sequence[_Pick]) -> str:
    models = " and ".join(f"{pick.claim.needs.model} for {pick.own.name}" for pick in held_for)
    return f"holds layers of {models}" + (" (its rpc-server takes several clients)" if len(held_for) > 1 else "")


def _idle_why(picks: Sequence[_Pick]) -> str:
    if not picks:
        return "idle: no member serves a model"
    if len(picks) == 1:
        return f"not needed: {picks[0].claim.needs.model} fits on fewer members"
    return "not needed: each serving node's model fits on fewer members"
