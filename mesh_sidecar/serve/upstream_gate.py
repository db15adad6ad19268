"""The gate in front of this node's llama-server: whether requests are held, served or refused, and which one.

The serving loop drives the gate through three states:

    holding    new requests wait (up to the hold timeout) for llama-server to be ready
    serving    requests go to llama-server's URL
    refusing   requests get an OpenAI-style 503 saying why (e.g. missing capacity)

Every serve or refuse starts a new epoch: "a new llama-server", even on the same port, so a
request that saw one fail waits for a later one. ``drain()`` switches to holding and waits
(bounded) for the requests in flight to end, so a replan never cuts a request short that it
could have let finish; the exchange (exchange.py) counts them in with ``busy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import ServiceUnavailableError
from .routing import MODEL_LOADING_CODE, MODEL_LOADING_MESSAGE

log = logging.getLogger(__name__)

INSUFFICIENT_CAPACITY_CODE = "insufficient_capacity"


@dataclass(frozen=True)
class Upstream:
    """One llama-server as the proxy knows it, or another member's API that serves the model."""

    url: str
    epoch: int  # bumped on every serve/refuse, so a retry can wait for a newer one
    model: str  # the id of the model it serves
    node_id: bytes | None = None  # the member whose API this is (forwarded); None: this node's llama-server


class UpstreamGate:
    """Holds, serves or refuses requests for this node's llama-server; counts those it is answering."""

    def __init__(self, hold_timeout_s: float) -> None:
        self._hold_timeout_s = hold_timeout_s
        self.url: str | None = None  # the llama-server in service (None: holding or refusing)
        self.model = ""  # the id of the model it serves
        self._why_unavailable: str | None = None  # while refusing: the reason clients are told
        self.epoch = 0
        self._settled = asyncio.Event()  # set while serving or refusing
        # Set on every serve/refuse, then replaced: any number of waiters see each change.
        self._changed = asyncio.Event()
        self.in_flight = 0  # requests this node's llama-server is answering now
        self.shared_until = -math.inf  # when two requests or more were last in flight here (monotonic)
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def settled(self) -> bool:
        """Whether the gate serves or refuses (False: it holds requests)."""
        return self._settled.is_set()

    def serve(self, upstream_url: str, model: str = "") -> None:
        """Send requests to ``upstream_url``, a llama-server serving the model ``model`` (its id)."""
        self.model = model
        self._set(upstream_url, None)

    def refuse(self, reason: str) -> None:
        self._set(None, reason)

    def hold(self) -> None:
        self._settled.clear()

    def _set(self, upstream: str | None, why_unavailable: str | None) -> None:
        self.url, self._why_unavailable = upstream, why_unavailable
        self.epoch += 1
        self._settled.set()
        self._changed.set()
        self._changed = asyncio.Event()

    async def drain(self, timeout_s: float) -> None:
        """Hold new requests and wait up to ``timeout_s`` for those in flight to finish."""
        self.hold()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("%d request(s) still running after %.0f s; restarting anyway", self.in_flight, timeout_s)

    async def upstream(self, failed: int | None) -> Upstream:
        """A llama-server newer than the ``failed`` epoch; waits while holding."""
        deadline = time.monotonic() + self._hold_timeout_s
        while not self._settled.is_set() or self.epoch == failed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServiceUnavailableError(MODEL_LOADING_MESSAGE, MODEL_LOADING_CODE)
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass
        if self.url is None:
            raise ServiceUnavailableError(self._why_unavailable or "No llama-server is running.",
                                          INSUFFICIENT_CAPACITY_CODE)
        return Upstream(self.url, self.epoch, self.model)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Count a request in flight at this node's llama-server (a drain waits for those)."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            if self.in_flight > 1:
                self.shared_until = time.monotonic()
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
