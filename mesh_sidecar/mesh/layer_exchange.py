"""Layer shares and their reports as the mesh receives them (wire/layer_share.py): a worker takes the latest
share a serving node sent it (node/lifecycle.py fetches it) and is told which serving node uses it now
(``on_used_by``: what was fetched for another leaves its cache); a serving node reads what each worker
reported (serve/layer_share.py waits on ``changes``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..wire.layer_share import LayersFetched, LayerShare
from .changes import Changes


class LayerExchange:
    """What members asked of this node, and told it, about fetching layers from the hub."""

    def __init__(self, changes: Changes) -> None:
        self._changes = changes
        # Only the latest share matters: a replan's share replaces one not yet fetched.
        self._pending: tuple[bytes, LayerShare] | None = None
        self._arrived = asyncio.Event()
        self._reports: dict[bytes, LayersFetched] = {}  # by worker: its last report
        # Told of each --rpc order naming this node, at once (the node's own fetches follow it).
        self.on_used_by: Callable[[bytes], object] = lambda node_id: None

    def used_by(self, node_id: bytes) -> None:
        self.on_used_by(node_id)

    def shared(self, node_id: bytes, share: LayerShare) -> None:
        self._pending = (node_id, share)
        self._arrived.set()

    async def next_share(self) -> tuple[bytes, LayerShare]:
        """The next share to fetch, and the serving node that sent it."""
        while self._pending is None:
            self._arrived.clear()
            await self._arrived.wait()
        pending, self._pending = self._pending, None
        return pending

    def reported(self, node_id: bytes, report: LayersFetched) -> None:
        self._reports[node_id] = report
        self._changes.notify()

    def report_of(self, node_id: bytes, model_sha256: str) -> LayersFetched | None:
        """What ``node_id`` last reported of its fetch of ``model_sha256``'s layers, if it did."""
        report = self._reports.get(node_id)
        return report if report is not None and report.model_sha256 == model_sha256 else None

    def forget(self, node_id: bytes) -> None:
        """Before a new share to ``node_id``: an older report is not the answer to it."""
        self._reports.pop(node_id, None)
