"""What the user asked of a serving node (``ServeOptions``): its model tiers and their projectors, the
context size, and the rules it plans and serves by; the one owner of each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..llama.estimate import ModelEstimate
from ..llama.hub_models import hub_name_of
from ..llama.kv_cache import DEFAULT_KV_CACHE, KvCacheTypes
from ..llama.projector import Projector
from .planner import PlanBy
from .step_up import StepUpRules


@dataclass(frozen=True)
class ServeOptions:
    """What the user asked of the serving node: ``--serve`` and the options that go with it."""

    models: tuple[tuple[Path, str], ...]  # (path, sha256) of every --model, in the order given: the tiers
    ctx_size: int
    min_peers: int = 0  # wait for this many peers before loading the model
    step_up: StepUpRules = StepUpRules()  # with several tiers: when a bigger one may replace the one in service
    spread: bool = False  # --spread: split over every free worker, even when the model fits on fewer
    plan_by: PlanBy = PlanBy.SPEED  # --plan-by: what the layer counts follow
    draft_model: Path | None = None  # a draft model (same tokenizer) for speculative decoding on this node's CPU
    receipts: Path | None = None  # write a signed run receipt per generation request here
    speculate: bool = True  # let the node choose speculative decoding (False: never)
    kv_cache: KvCacheTypes = DEFAULT_KV_CACHE  # --cache-type-k/-v, for llama-server and the estimate
    # Each tier's --mmproj projector, in the order of ``models`` (None, or no entry: that tier takes no images).
    projectors: tuple[Projector | None, ...] = ()

    def model_name(self, tier: int) -> str:
        """Tier ``tier``'s hf: name, for a model from the hub's cache ("" for a file elsewhere)."""
        return hub_name_of(self.models[tier][0]) or ""

    def projector(self, tier: int) -> Projector | None:
        return self.projectors[tier] if tier < len(self.projectors) else None

    def tier_estimate(self, tier: int, estimate: ModelEstimate) -> ModelEstimate:
        """``estimate`` of tier ``tier``'s model with its projector's memory on the serving node."""
        projector = self.projector(tier)
        return estimate if projector is None else dataclasses.replace(estimate,
                                                                      projector_bytes=projector.memory_bytes)
