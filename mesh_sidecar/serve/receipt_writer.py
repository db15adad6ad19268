"""A serving node's --receipt DIR: one signed receipt (receipt.py) per finished generation request, with
the tiers, the plan, the draft and the shards it was answered with; readable by this user only."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ..home import write_private_file
from ..identity import NodeIdentity
from ..llama.model import model_sha256, model_shards
from ..mesh.runtime import Mesh
from . import receipt
from .options import ServeOptions
from .planner import Plan
from .receipt import Generation
from .speculation import Speculation


class ReceiptWriter:
    """Writes the receipts of one serving node into ``options.receipts``."""

    def __init__(self, options: ServeOptions, identity: NodeIdentity, name: str, mesh: Mesh) -> None:
        assert options.receipts is not None
        self._options = options
        self._directory = options.receipts
        self._identity = identity
        self._name = name
        self._mesh = mesh
        self._draft_sha256: str | None = None  # hashed once by ready()
        # A split tier's shards: read once, not on every request.
        self._shards = {sha256: model_shards(path, sha256) for path, sha256 in options.models}

    async def ready(self) -> None:
        """The draft model's identity, hashed off the event loop before the first receipt names it."""
        if self._options.draft_model is not None:
            self._draft_sha256 = await asyncio.to_thread(model_sha256, self._options.draft_model, lambda *_: None)

    def write(self, generation: Generation, in_service: Path, plan: Plan, speculation: Speculation | None) -> None:
        """One signed JSON for a finished generation request, answered by ``in_service`` on ``plan``."""
        draft = self._options.draft_model
        name, text = receipt.signed_receipt(
            self._identity, self._name, path=generation.path, request=generation.request,
            output=generation.output, answered_by=generation.model, tiers=self._options.models,
            in_service=in_service, plan=plan, draft=(draft, self._draft_sha256) if draft is not None else None,
            speculation=speculation.to_json() if speculation else None,
            peer_views=self._mesh.peer_views(), now=time.time(), continued_at=generation.continued_at,
            shards=self._shards, projectors={sha256: (projector.path, projector.sha256)
                                             for i, (_, sha256) in enumerate(self._options.models)
                                             if (projector := self._options.projector(i)) is not None})
        self._directory.mkdir(parents=True, exist_ok=True)
        # Receipts hold the prompt: readable by this user only.
        write_private_file(self._directory / name, text)
