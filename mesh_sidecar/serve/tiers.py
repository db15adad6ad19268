"""Model tiers over time: when a bigger tier may replace the one in service, and what clients are told.

A step down is never delayed: the model in service no longer fits, and
waiting only lengthens the outage. A step up costs every client a pause (the
new model loads over the mesh), so it waits until the bigger tier has fitted
for ``after_s`` without a break, and comes at most once per ``interval_s``
after any switch: a member that joins and leaves every few seconds never
moves the API off the tier it can rely on.

Which tier a serving node claims workers for (:func:`tier_claim`) is weighed
over every worker the assignment could give it, not over the workers of the
tier in service: those are the fewest for that tier (none when it runs
alone), and a bigger one never fits them, so it could never be seen to fit
long enough to step up. Each tier takes the fewest workers over which the
planner itself holds it: the assignment's conservative count is a sum of
bytes, and says one worker where the planner needs two when the serving node
is too small for the output head beside a layer.

Clients name models by their file's stem (what llama-server's ``--alias``
makes it answer with). A request naming a tier that is not in service gets an
error saying which one is and why the other is not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..llama.model_files import model_stem
from ..units import format_gib
from .assignment import Offer, pick_workers
from .planner import NodeCapacity, TierFit, assess_tiers, model_needs, tier_needs_bytes

if TYPE_CHECKING:
    from ..llama.estimate import ModelEstimate

# What OpenAI clients send when they mean "whatever this server runs".
DEFAULT_MODEL_NAMES = frozenset({"", "default"})
OWNER = "mesh-inference"


@dataclass(frozen=True)
class TierClaim:
    """The tier a serving node claims workers for, those workers, and how every tier weighed."""

    index: int  # into the tier list
    workers: tuple[Offer, ...]
    fits: tuple[TierFit, ...]  # every tier, largest first, over its fewest workers (the whole pool if none)


def tier_claim(tiers: Sequence[tuple[str, ModelEstimate]], own: Offer, pool: Sequence[Offer],
               members_of: Callable[[Sequence[Offer]], Sequence[NodeCapacity]], *,
               spread: bool = False, by_speed: bool = False) -> TierClaim:
    """The tier a serving node claims workers for, and those workers.

    ``tiers``: (file name, estimate) pairs; ``own``: the serving node's offer; ``pool``: every worker
    the assignment leaves free for it (assignment.pool_for); ``members_of``: what the planner plans
    over with some of them (workers first, the serving node last); ``spread``, ``by_speed``: its claim's.
    Each tier gets the fewest workers, in the assignment's order (pick_workers), over which the planner
    holds it (all of the pool with ``spread``, and where even the whole pool falls short), and the
    largest tier held is claimed. So whether the tier in service runs alone, on some workers or on all,
    a bigger one is claimed as soon as the pool holds it. None fits: the smallest, with the whole pool
    (the planner then names the shortfall).
    """
    order = sorted(range(len(tiers)), key=lambda i: tier_needs_bytes(tiers[i][1]), reverse=True)
    fits, claimed = [], None
    for index in order:
        name, estimate = tiers[index]
        workers = pick_workers(own, pool, model_needs(model_id(name), estimate), spread, by_speed,
                               holds=functools.partial(_held, tiers[index], members_of))
        assessed = assess_tiers([tiers[index]], members_of(workers))
        fits.append(assessed.fits[0])
        if claimed is None and assessed.plans:
            claimed = index, workers
    index, workers = claimed or (order[-1], tuple(pool))
    return TierClaim(index, workers, tuple(fits))


def _held(tier: tuple[str, ModelEstimate], members_of: Callable[[Sequence[Offer]], Sequence[NodeCapacity]],
          workers: Sequence[Offer]) -> bool:
    """Whether the planner holds ``tier`` over the serving node and ``workers``."""
    return bool(assess_tiers([tier], members_of(workers)).plans)


def model_id(file_name: str) -> str:
    """The name clients see and send for a model file: its stem (a split model's, without the shard
    suffix), as llama-server's --alias."""
    return model_stem(file_name)


@dataclass(frozen=True)
class TierView:
    """One tier as clients see it (``/v1/models``)."""

    file_name: str
    needs_bytes: int
    state: str  # IN_SERVICE, FITS or TOO_LARGE
    why: str = ""  # for TOO_LARGE: the planner's reason, with the shortfall

    @property
    def id(self) -> str:
        return model_id(self.file_name)


IN_SERVICE = "in_service"
FITS = "fits"  # fits now but is not the one in service (waiting to step up, or a smaller tier)
TOO_LARGE = "too_large"


def tier_views(fits: Sequence[TierFit], in_service: str | None) -> list[TierView]:
    """Every tier, the one in service first, then the others largest first."""
    views = [TierView(fit.model, fit.needs_bytes,
                      IN_SERVICE if fit.model == in_service else FITS if fit.fits else TOO_LARGE, fit.why)
             for fit in fits]
    return sorted(views, key=lambda view: view.state != IN_SERVICE)


def models_list(views: Sequence[TierView], created: int) -> dict[str, Any]:
    """The ``/v1/models`` body: OpenAI's list, each entry with its tier state."""
    return {"object": "list", "data": [
        {"id": view.id, "object": "model", "created": created, "owned_by": OWNER, "file": view.file_name,
         "state": view.state, "needs_bytes": view.needs_bytes, **({"why": view.why} if view.why else {})}
        for view in views]}


def why_not_served(requested: str, views: Sequence[TierView]) -> str | None:
    """Why a request naming ``requested`` cannot be served now, or None when it goes to the model in service.

    Only names of this node's tiers come here (routing.py answers a name no member serves with 404).
    """
    if requested in DEFAULT_MODEL_NAMES:
        return None
    named = next((view for view in views if requested in (view.id, view.file_name)), None)
    if named is None or named.state == IN_SERVICE:
        return None
    serving = next((view for view in views if view.state == IN_SERVICE), None)
    now = (f"The model in service is {serving.id!r}; send that name, 'default' or none."
           if serving else "No model is in service now.")
    if named.state == TOO_LARGE:
        because = named.why or f"it needs {format_gib(named.needs_bytes)} GiB"
        return f"Model {named.id!r} is not loaded: the mesh cannot hold it now. {because} {now}"
    if serving is not None and named.needs_bytes > serving.needs_bytes:
        reason = "it fits the mesh now, and the node switches to it once it has fitted for a while"
    else:
        reason = "the node serves the largest model that fits the mesh"
    return f"Model {named.id!r} is not loaded: {reason}. {now}"
