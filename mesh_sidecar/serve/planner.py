"""Which layers each node's rpc-server holds: a pure function of capacities and the model.

Theory of operation. llama-server lists the rpc-servers in ``--rpc`` order and
gives each a contiguous run of layers; the last one also holds the output head,
so the caller puts the serving node last to keep the logits local. Planning has
three steps:

1. **Who takes part.** Walking back from the end, the first member that can
   hold the output head, one layer and its compute margin becomes the last
   participant; the members after it are left out (nothing may follow the
   output holder). Before it, a member takes part if it can hold one layer and
   its margin. "One layer" means the largest one, for the reason in step 2. If
   there are more participants than layers, the smallest (by usable bytes) are
   left out, never the output holder, so everyone keeps at least one layer.
2. **How many layers each.** Every participant starts with one layer; the
   rest go one at a time, by the D'Hondt (highest averages) rule, to the
   participant with the largest ``usable / (count + 1)`` that still has room,
   ties to the earlier one. That is the same as taking the largest quotients
   ``usable / k`` overall, so giving a node more memory can only move its
   quotients up the ranking: it never gets fewer layers (largest-remainder
   methods lack this). "Room" is a count cap: how many of the *largest*
   layers fit next to the margin (and the output head). Counts come before
   positions, and a cap that holds for any run of that length keeps every node
   under its usable bytes wherever its run lands, at the price of some
   pessimism when block sizes differ.
3. **Where.** Runs follow the member order: participant i holds
   ``[sum of earlier counts, + its count)``.

If the caps add up to fewer layers than the model has, :class:`PlanError`
names the shortfall in GiB and the size of a node that would close it.

**By speed.** Steps 1 to 3 are the memory plan (``PlanBy.MEMORY``, llama.cpp's
own default). When every participant's device speed is known
(``decode_bytes_per_s``: measured at start, corrected from traffic) the planner
also minimizes the time of a token. A token crosses every stage in turn, so
that time is the sum over stages of ``run weight bytes / device speed`` plus
each stage's link round trip (``link_s``). For a set of participants the best
counts fill the fastest devices up to their caps, slower ones only with what is
left (each keeps one layer); every subset of the candidates before the output
holder is tried (the greedy order beyond MAX_SUBSET_SEARCH of them), so a member
takes part only when the model needs its memory or it makes tokens faster. With
``spread`` every candidate takes part and the counts go by D'Hondt on speed, so
the stages take about the same time. The speed plan replaces the memory plan
only when it is expected to be SPEED_PLAN_MIN_GAIN faster, and only when the
candidates' speeds differ by more than SAME_SPEED_RATIO: members of about the
same speed (a measurement on a busy machine moves by tens of percent) keep
today's plan.

``Plan.tensor_split`` turns the counts into llama.cpp's ``--tensor-split``
weights; its docstring shows why they reproduce the runs exactly.

**Tiers.** Given several models, :func:`choose_tier` ranks them by what they
need and plans the largest one the members can hold; only when none fits does
it raise, with the smallest tier's shortfall (the nearest to fitting).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..identity import short_id
from ..units import format_gib
from ..wire.gossip import OfferedDevice
from .assignment import ModelNeeds, Role, speeds_differ

if TYPE_CHECKING:
    # Only its interface is used here, so planning needs no GGUF reading.
    from ..llama.estimate import ModelEstimate
    from ..mesh.exclusion import Exclusion

# A speed plan is used only when expected to beat the memory plan by this share: measured speeds
# move by a few percent, and members of about the same speed keep the plan they would get today.
SPEED_PLAN_MIN_GAIN = 0.10
# With more candidates than this before the output holder, they join fastest first instead of every
# subset being tried (2^10 placements of a few dozen layers is still instant).
MAX_SUBSET_SEARCH = 10


class PlanBy(enum.Enum):
    """What ``plan_layers`` weighs."""

    SPEED = "speed"  # the time of a token, within memory; MEMORY when a participant's speed is unknown
    MEMORY = "memory"  # layers in proportion to the memory offered (llama.cpp's own default)


@dataclass(frozen=True)
class NodeCapacity:
    """What one member (or one device of a member that offers several) can give the model."""

    node_id: bytes
    name: str
    usable_bytes: int  # already capped by that node's --max-memory
    device: str = ""  # ggml's name of the device (CPU, Vulkan0); "" when the member did not say
    # Weight bytes a token passes through per second on this device (measured, see PlanBy); 0: unknown.
    decode_bytes_per_s: float = 0.0
    link_s: float = 0.0  # what a stage on this member adds to a token besides compute: its link's round trip
    # False: that speed is one calibration, not yet confirmed by a second or by traffic (serve/speeds.py).
    speed_settled: bool = True


@dataclass(frozen=True)
class PlannedNode:
    """One participant's share: layers ``[start, end)`` and what they cost."""

    node_id: bytes
    name: str
    start: int
    end: int
    weights_bytes: int
    kv_bytes: int
    output_bytes: int  # non-zero only on the last participant
    needed_bytes: int  # weights + KV + compute margin + output
    usable_bytes: int
    device: str = ""  # the device of that member's rpc-server holding them (NodeCapacity.device)
    decode_bytes_per_s: float = 0.0  # NodeCapacity's; 0: unknown
    token_s: float | None = None  # this stage's share of a token's time (compute and link); None: speed unknown
    speed_settled: bool = True  # NodeCapacity's

    @property
    def n_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TierFit:
    """One model of the tier list against the members of one planning round."""

    model: str  # the file's name
    needs_bytes: int  # the whole model on one device: weights, KV cache, one compute margin
    fits: bool
    why: str = ""  # when it does not fit: the planner's reason, with the shortfall in GiB
    offered_bytes: int = 0  # what the members it was weighed over offer together

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "needs_bytes": self.needs_bytes, "fits": self.fits, "why": self.why,
                "offered_bytes": self.offered_bytes}


@dataclass(frozen=True)
class Plan:
    """The layer ranges, in ``--rpc`` device order; the last node holds the output head."""

    nodes: tuple[PlannedNode, ...]
    left_out: tuple[NodeCapacity, ...]  # in member order
    n_layers: int
    # Members not offered to the planner at all, and why (mesh/exclusion.py).
    refused: tuple[tuple[NodeCapacity, Exclusion], ...] = ()
    model: str = ""  # the planned model's file name; "" when planned without a name
    model_name: str = ""  # its hf: name, for a model from the hub's cache (shown to people); "": a file
    tiers: tuple[TierFit, ...] = ()  # every tier considered, largest first
    roles: tuple[Role, ...] = ()  # every member's place in the mesh's assignment of workers, and why
    kv_cache_type: str = ""  # "K/V" element types the KV figures assume (--cache-type-k/-v), e.g. "q8_0/q8_0"
    # Every device offered to the planner, (node id, device) in --rpc order: a node taking part has all of
    # its devices in llama-server's list, those without layers too (weight 0 in tensor_split).
    offered: tuple[tuple[bytes, str], ...] = ()
    by: PlanBy = PlanBy.MEMORY  # the rule the layer counts follow
    memory_token_s: float | None = None  # the memory plan's expected token time, for comparison (None: unknown)
    projector_bytes: int = 0  # a --mmproj projector on the serving node (its llama-server's CPU); 0: none

    @property
    def token_s(self) -> float | None:
        """The expected time of one token (every stage in turn); None when a stage's speed is unknown."""
        stages = [node.token_s for node in self.nodes]
        return None if any(s is None for s in stages) else sum(s for s in stages if s is not None)

    @property
    def alone(self) -> bool:
        """Whether the serving node holds every layer itself (its llama-server runs with no ``--rpc``).

        The serving node is the last member offered (mesh_round.py): a plan whose one node is a worker is
        not alone, llama-server offloads every layer to it and keeps only the input embeddings, which every
        plan already takes off the serving node's offer (``assess_tiers``)."""
        serving = self.offered[-1][0] if self.offered else self.nodes[-1].node_id
        return len(self.nodes) == 1 and self.nodes[0].node_id == serving

    def tensor_split(self) -> tuple[int, ...]:
        """``--tensor-split`` weights for ``-ngl 99`` that reproduce the planned runs exactly.

        With every layer offloaded llama.cpp places N + 1 "layers" (the output
        head is number N) and gives layer ``il`` to the first device whose
        cumulative split fraction is greater than ``il / (N + 1)``. With the
        layer counts as weights and one more on the last device, the fractions
        are ``C_k / (N + 1)`` for the cumulative counts ``C_k``, so layer ``il``
        lands on the first device with ``C_k > il``: the planned run, and the
        output head on the last device. The counts are small integers, so
        llama.cpp's float32 arithmetic keeps the comparison exact. One weight per
        device, in llama-server's order (each ``--rpc`` endpoint's devices in its
        rpc-server's order): a device of a taking-part node that holds no layer
        gets 0, which no layer index passes.
        """
        counts = {(node.node_id, node.device): node.n_layers for node in self.nodes}
        last = (self.nodes[-1].node_id, self.nodes[-1].device)
        counts[last] += 1
        taking_part = set(self.rpc_nodes())
        devices = [entry for entry in self.offered if entry[0] in taking_part] or list(counts)
        return tuple(counts.get(entry, 0) for entry in devices)

    def rpc_nodes(self) -> tuple[bytes, ...]:
        """The members whose rpc-servers llama-server uses, in ``--rpc`` order (each once, whatever
        number of its devices hold layers)."""
        return tuple(dict.fromkeys(node.node_id for node in self.nodes))

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": [
                {
                    "id": node.node_id.hex(),
                    "name": node.name,
                    "device": node.device,
                    "layers": [node.start, node.end],
                    "weights_bytes": node.weights_bytes,
                    "kv_bytes": node.kv_bytes,
                    "output_bytes": node.output_bytes,
                    "needed_bytes": node.needed_bytes,
                    "free_bytes": node.usable_bytes,
                    "decode_bytes_per_s": node.decode_bytes_per_s,
                    "speed_settled": node.speed_settled,
                    "token_ms": None if node.token_s is None else round(node.token_s * 1000, 3),
                }
                for node in self.nodes
            ],
            "left_out": [
                {"id": member.node_id.hex(), "name": member.name, "device": member.device,
                 "free_bytes": member.usable_bytes, "decode_bytes_per_s": member.decode_bytes_per_s,
                 "speed_settled": member.speed_settled}
                for member in self.left_out
            ],
            "refused": [
                {"id": member.node_id.hex(), "name": member.name, "free_bytes": member.usable_bytes,
                 "reason": refusal.reason, "detail": refusal.detail}
                for member, refusal in self.refused
            ],
            "n_layers": self.n_layers,
            "tensor_split": list(self.tensor_split()),
            "by": self.by.value,
            "expected_tokens_per_s": _per_s(self.token_s),
            "memory_plan_tokens_per_s": _per_s(self.memory_token_s),
            "model": self.model,
            "model_name": self.model_name or None,
            "kv_cache_type": self.kv_cache_type,
            "projector_bytes": self.projector_bytes,
            "tiers": [tier.to_json() for tier in self.tiers],
            "assignment": [{"id": role.node_id.hex(), "name": role.name,
                            "serves_with": None if role.serves_with is None else role.serves_with.hex(),
                            "why": role.why} for role in self.roles],
        }


def _per_s(token_s: float | None) -> float | None:
    return None if token_s is None or token_s <= 0 else round(1 / token_s, 2)


def plan_layers(members: Sequence[NodeCapacity], estimate: ModelEstimate, *,
                by: PlanBy = PlanBy.MEMORY, spread: bool = False) -> Plan:
    """Spread ``estimate``'s layers over ``members``, given in preferred device order.

    ``by``: the rule (see the module's docstring); ``spread``: by speed, every member that can
    hold a layer takes part. Raises PlanError when the members cannot hold the model.
    """
    largest_first = _largest_layers_prefix_sums(estimate)
    indices, caps = _participants(members, estimate, largest_first)
    participants = [members[i] for i in indices]
    if sum(caps) < estimate.n_layers:
        left_out = tuple(member for i, member in enumerate(members) if i not in indices)
        raise _shortfall(participants, caps, left_out, estimate, largest_first)

    def plan_of(taking_part: Sequence[NodeCapacity], counts: Sequence[int], rule: PlanBy) -> Plan:
        left_out = tuple(m for m in members if not any(m is p for p in taking_part))
        return Plan(_place(taking_part, counts, estimate), left_out, estimate.n_layers,
                    kv_cache_type=str(estimate.kv_cache), offered=tuple((m.node_id, m.device) for m in members),
                    by=rule)

    memory = plan_of(participants, _dhondt(caps, estimate.n_layers, lambda i: participants[i].usable_bytes),
                     PlanBy.MEMORY)
    memory_s = memory.token_s
    # Every member that could hold a layer: the speed plan may take a fast one the memory plan left out.
    indices, caps_all = _participants(members, estimate, largest_first, prune=False)
    candidates = [members[i] for i in indices]
    if by is PlanBy.MEMORY or memory_s is None or not speeds_differ([c.decode_bytes_per_s for c in candidates]):
        return dataclasses.replace(memory, memory_token_s=memory_s)
    if spread:
        fast = plan_of(participants, _dhondt(caps, estimate.n_layers, lambda i: participants[i].decode_bytes_per_s),
                       PlanBy.SPEED)
    else:
        fast = min((plan_of([candidates[i] for i in chosen], counts, PlanBy.SPEED)
                    for chosen, counts in _speed_candidates(candidates, caps_all, estimate.n_layers)),
                   key=lambda plan: (plan.token_s or 0.0, len(plan.nodes)))
    fast_s = fast.token_s
    assert fast_s is not None  # every candidate's speed is known
    chosen_plan = fast if fast_s <= (1 - SPEED_PLAN_MIN_GAIN) * memory_s else memory
    return dataclasses.replace(chosen_plan, memory_token_s=memory_s)


def _speed_candidates(participants: Sequence[NodeCapacity], caps: Sequence[int],
                      n_layers: int) -> list[tuple[tuple[int, ...], list[int]]]:
    """Each set of participants worth a try (the output holder always in), with its best counts:
    one layer each, the rest to the fastest first, up to their caps."""
    *others, last = range(len(participants))

    def speed(i: int) -> float:
        return participants[i].decode_bytes_per_s

    if len(others) <= MAX_SUBSET_SEARCH:
        subsets = [combo for k in range(len(others) + 1) for combo in itertools.combinations(others, k)]
    else:
        by_speed = sorted(others, key=lambda i: (-speed(i), i))
        subsets = [tuple(sorted(by_speed[:k])) for k in range(len(others) + 1)]
    candidates = []
    for subset in subsets:
        chosen = (*subset, last)
        if sum(caps[i] for i in chosen) < n_layers or len(chosen) > n_layers:
            continue
        counts = [1] * len(chosen)
        left = n_layers - len(chosen)
        for j in sorted(range(len(chosen)), key=lambda j: (-speed(chosen[j]), j)):
            extra = min(caps[chosen[j]] - 1, left)
            counts[j] += extra
            left -= extra
        candidates.append((chosen, counts))
    return candidates


def device_shares(node_id: bytes, name: str, usable_bytes: int, devices: Sequence[OfferedDevice], *,
                  link_s: float = 0.0, speed_factor: float = 1.0, settled: bool = True) -> list[NodeCapacity]:
    """A member's offer as the planner takes it: one entry per device its rpc-server offers (in its order,
    llama-server's), its usable bytes (capped by its --max-memory) shared out by each device's free memory.

    Each device's speed is the one the member announced times ``speed_factor`` (what planning may weigh of
    it and the traffic's correction, mesh_round.py; 0: unknown); ``settled``: whether that speed is confirmed
    (NodeCapacity.speed_settled); ``link_s``: the member's round trip, what each of its stages adds to a token.
    """
    if not devices:
        return [NodeCapacity(node_id, name, usable_bytes, "", link_s=link_s, speed_settled=settled)]
    free = [device.free_bytes for device in devices]
    total = sum(free) or len(devices)
    return [NodeCapacity(node_id, name,
                         usable_bytes if len(devices) == 1 else usable_bytes * (share if sum(free) else 1) // total,
                         device.name, decode_bytes_per_s=device.decode_bytes_per_s * speed_factor, link_s=link_s,
                         speed_settled=settled)
            for device, share in zip(devices, free, strict=True)]


def tier_needs_bytes(estimate: ModelEstimate) -> int:
    """What a tier needs at the least, its rank: the whole model on one device (each more device adds a margin)."""
    return estimate.total_bytes + estimate.compute_margin_bytes


def model_needs(model: str, estimate: ModelEstimate) -> ModelNeeds:
    """What holding ``model`` takes, as gossip carries it for the assignment of workers (assignment.py)."""
    largest_layer = max((estimate.layer_bytes(i) for i in range(estimate.n_layers)), default=0)
    return ModelNeeds(model, tier_needs_bytes(estimate), estimate.compute_margin_bytes, largest_layer)


@dataclass(frozen=True)
class TierAssessment:
    """Every tier of a tier list against one set of members."""

    order: tuple[int, ...]  # indices into the tier list, largest needs first
    plans: dict[int, Plan]  # the plan of each tier that fits
    fits: tuple[TierFit, ...]  # in ``order``
    errors: dict[int, PlanError]  # why each other tier does not fit


def assess_tiers(tiers: Sequence[tuple[str, ModelEstimate]], members: Sequence[NodeCapacity], *,
                 by: PlanBy = PlanBy.MEMORY, spread: bool = False) -> TierAssessment:
    """Plan every tier over ``members`` (``by`` and ``spread``: see plan_layers).

    ``tiers`` are (file name, estimate) pairs in any order; ``members`` end with
    the serving host, whose ``usable_bytes`` still include what each model's
    input embeddings and a projector take there (``serving_host_bytes``, taken off per tier).
    """
    if not tiers:
        raise ValueError("assess_tiers needs at least one tier")
    order = tuple(sorted(range(len(tiers)), key=lambda i: tier_needs_bytes(tiers[i][1]), reverse=True))
    plans: dict[int, Plan] = {}
    errors: dict[int, PlanError] = {}
    *peers, host = members
    for i in order:
        name, estimate = tiers[i]
        own = dataclasses.replace(host, usable_bytes=max(0, host.usable_bytes - estimate.serving_host_bytes))
        try:
            plans[i] = dataclasses.replace(plan_layers([*peers, own], estimate, by=by, spread=spread), model=name,
                                           projector_bytes=estimate.projector_bytes)
        except PlanError as exc:
            errors[i] = exc
    offered = sum(member.usable_bytes for member in members)
    fits = tuple(TierFit(tiers[i][0], tier_needs_bytes(tiers[i][1]), i in plans, str(errors.get(i, "")), offered)
                 for i in order)
    return TierAssessment(order, plans, fits, errors)


def choose_tier(
    tiers: Sequence[tuple[str, ModelEstimate]], members: Sequence[NodeCapacity], *, at_most_bytes: int | None = None,
    by: PlanBy = PlanBy.MEMORY, spread: bool = False,
) -> tuple[int, Plan]:
    """The index in ``tiers`` of the largest model ``members`` can hold, and its plan.

    See ``assess_tiers`` for the other arguments. ``at_most_bytes``: prefer tiers that
    need no more than this (a step up not allowed yet); a bigger one is chosen
    only when none of those fits. Raises the smallest tier's PlanError when no
    tier fits.
    """
    assessed = assess_tiers(tiers, members, by=by, spread=spread)
    fitting = [i for i in assessed.order if i in assessed.plans]
    if not fitting:
        smallest = assessed.order[-1]
        if len(tiers) == 1:
            raise assessed.errors[smallest]
        raise PlanError(f"None of the {len(tiers)} models given with --model fits the mesh now. "
                        f"The smallest, {tiers[smallest][0]}: {assessed.errors[smallest]}")
    allowed = [i for i in fitting if at_most_bytes is None or tier_needs_bytes(tiers[i][1]) <= at_most_bytes]
    chosen = (allowed or fitting)[0]
    return chosen, dataclasses.replace(assessed.plans[chosen], tiers=assessed.fits)


def _largest_layers_prefix_sums(estimate: ModelEstimate) -> list[int]:
    """Entry k: the bytes of the k largest layers, a bound for any run of k layers."""
    sizes = sorted((estimate.layer_bytes(i) for i in range(estimate.n_layers)), reverse=True)
    sums = [0]
    for size in sizes:
        sums.append(sums[-1] + size)
    return sums


def _cap(usable_bytes: int, fixed_bytes: int, largest_first: list[int]) -> int:
    """How many layers surely fit in ``usable_bytes`` next to ``fixed_bytes``."""
    room = usable_bytes - fixed_bytes
    return sum(1 for k in range(1, len(largest_first)) if largest_first[k] <= room)


def _participants(
    members: Sequence[NodeCapacity], estimate: ModelEstimate, largest_first: list[int], *, prune: bool = True
) -> tuple[list[int], list[int]]:
    """The indices of the members that take part, in order, and each one's layer cap.

    ``prune``: leave out the smallest when more could take part than there are layers (the
    speed plan instead tries sets of them).
    """
    margin = estimate.compute_margin_bytes
    chosen: list[tuple[int, int]] = []
    for index in reversed(range(len(members))):
        fixed = margin if chosen else margin + estimate.output_bytes
        cap = _cap(members[index].usable_bytes, fixed, largest_first)
        if cap >= 1:
            chosen.append((index, cap))
    chosen.reverse()
    if prune and len(chosen) > estimate.n_layers:
        # Not every participant could get a layer: keep the output holder and
        # the largest others (earlier first on ties), so more memory never
        # costs a node its place.
        *others, last = chosen
        others.sort(key=lambda pair: (-members[pair[0]].usable_bytes, pair[0]))
        chosen = sorted(others[: estimate.n_layers - 1]) + [last]
    return [index for index, _ in chosen], [cap for _, cap in chosen]


def _dhondt(caps: Sequence[int], n_layers: int, weight: Callable[[int], float]) -> list[int]:
    """Layer counts: one each, then D'Hondt by ``weight(i)`` (usable bytes, or speed) within the caps."""
    counts = [1] * len(caps)
    for _ in range(n_layers - len(caps)):
        open_ = [i for i in range(len(caps)) if counts[i] < caps[i]]
        # max() keeps the first of equal quotients: ties go to the earlier node. Integer weights stay exact.
        best = max(open_, key=lambda i: Fraction(weight(i)) / (counts[i] + 1))
        counts[best] += 1
    return counts


def _place(
    participants: Sequence[NodeCapacity], counts: Sequence[int], estimate: ModelEstimate
) -> tuple[PlannedNode, ...]:
    nodes = []
    start = 0
    for i, (member, count) in enumerate(zip(participants, counts, strict=True)):
        end = start + count
        is_last = i == len(participants) - 1
        computed_bytes = sum(estimate.layer_weight_bytes[start:end]) + (estimate.output_bytes if is_last else 0)
        speed = member.decode_bytes_per_s
        nodes.append(
            PlannedNode(
                node_id=member.node_id,
                name=member.name,
                start=start,
                end=end,
                weights_bytes=sum(estimate.layer_weight_bytes[start:end]),
                kv_bytes=estimate.kv_bytes_per_layer * count,
                output_bytes=estimate.output_bytes if is_last else 0,
                needed_bytes=estimate.range_bytes(start, end, with_output=is_last),
                usable_bytes=member.usable_bytes,
                device=member.device,
                decode_bytes_per_s=speed,
                token_s=computed_bytes / speed + member.link_s if speed > 0 else None,
                speed_settled=member.speed_settled,
            )
        )
        start = end
    return tuple(nodes)


def _shortfall(
    participants: list[NodeCapacity],
    caps: list[int],
    left_out: tuple[NodeCapacity, ...],
    estimate: ModelEstimate,
    largest_first: list[int],
) -> PlanError:
    """The error for a mesh that cannot hold the model, with what would fix it."""
    n_layers = estimate.n_layers
    margin = estimate.compute_margin_bytes
    available = sum(member.usable_bytes for member in participants)
    # Every device the model would use pays a compute margin; with no
    # participant, the model would need one device of its own.
    needed = estimate.range_bytes(0, n_layers, with_output=True) + margin * max(len(participants) - 1, 0)
    if not participants:
        first_run = largest_first[1] + margin + estimate.output_bytes
        largest = max((member.usable_bytes for member in left_out), default=0)
        summary = (
            f"No node can hold the output head with one layer: that takes {format_gib(first_run)} GiB "
            f"and the largest node has {format_gib(largest)} GiB free "
            f"({format_gib(first_run - largest, up=True)} GiB short); "
            f"the whole model needs {format_gib(needed)} GiB."
        )
        add = needed
    else:
        unplaced = n_layers - sum(caps)
        # A node added before the output holder takes the layers the others
        # cannot, next to its own margin.
        add = largest_first[unplaced] + margin
        if needed > available:
            summary = (
                f"The mesh has {format_gib(available)} GiB free for this model "
                f"but needs {format_gib(needed)} GiB ({format_gib(needed - available, up=True)} GiB short)."
            )
        else:
            summary = (
                f"The mesh has {format_gib(available)} GiB free for this model, enough for the "
                f"{format_gib(needed)} GiB it needs in total, but a layer cannot be split between nodes: "
                f"they hold only {n_layers - unplaced} of its {n_layers} layers "
                f"({format_gib(largest_first[unplaced], up=True)} GiB short)."
            )
    advice = (
        f" Add a node with at least {format_gib(add, up=True)} GiB free, raise --max-memory, "
        "or use a smaller model/context (--ctx-size)."
    )
    too_small = ""
    if left_out:
        listed = ", ".join(
            f"{m.name} ({short_id(m.node_id)}, {format_gib(m.usable_bytes)} GiB)" for m in left_out
        )
        too_small = f" Left out as too small: {listed}."
    return PlanError(summary + advice + too_small)

