"""Which member answers an API request: routing by model over the mesh's catalog (catalog.py).

The proxy (proxy.py) asks the router two things:

    route(request, ...)         where a request goes, by the model it names: this node's llama-server,
                                the replicas of a model in the mesh, or a refusal (404, 503)
    replica(route, failed)      the replica to ask now (None: this node's own llama-server); after a
                                failure, another one, waiting (bounded) while the model loads, or
                                ServiceUnavailableError (``model_unavailable``) when nobody serves it

A request a member forwarded to this node (it carries the forwarding token) is never routed on:
this node answers it with its own llama-server, or says it no longer serves that model.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import httpx

from ..errors import ServiceUnavailableError
from .api_request import ApiRequest
from .catalog import MeshCatalog, choose_replica

MODEL_UNAVAILABLE_CODE = "model_unavailable"
MODEL_NOT_FOUND_CODE = "model_not_found"
NO_IMAGES_CODE = "model_takes_no_images"
MODEL_LOADING_MESSAGE = "The model is still being loaded on the mesh; retry in a moment."
MODEL_LOADING_CODE = "model_loading"
# Conversations remembered for routing to the replica that holds their prompt (least recently used go).
MAX_REMEMBERED_CONVERSATIONS = 4096


@dataclass(frozen=True)
class MeshRoutes:
    """What the API needs of the mesh to route requests to the members that serve their model."""

    catalog: Callable[[int], MeshCatalog]  # the models served now (given this node's requests in flight)
    version: Callable[[], int]  # the mesh's change count (mesh/changes.py)
    wait_after: Callable[[int], Awaitable[int]]  # wait for a change after a version
    transport: httpx.AsyncBaseTransport  # requests to mesh_url(node) go to that member's API (net/api_forward.py)
    name_of: Callable[[bytes], str]


@dataclass
class Route:
    """Where one request goes: this node's llama-server (``model`` None), or the replicas of ``model``
    in the mesh, this node's own among them."""

    model: str | None
    key: str | None = None  # its conversation, kept with one replica (catalog.conversation_key)
    replicas: int = 1  # how many members served the model when it was routed
    avoid: set[bytes] = field(default_factory=set)  # members that failed under it
    images: bool = False  # it holds images: only replicas with a projector answer it


LOCAL = Route(None)  # never changed: a local route has nothing to avoid


@dataclass(frozen=True)
class Refusal:
    """A request routed nowhere: the OpenAI error the client gets."""

    status: int
    message: str
    error_type: str
    code: str


class MeshRouter:
    """Routes requests by model; counts what this node has in flight at each member."""

    def __init__(self, routes: MeshRoutes | None, hold_timeout_s: float) -> None:
        self._routes = routes
        self._hold_timeout_s = hold_timeout_s
        self.forwarded_in_flight: Counter[bytes] = Counter()  # requests this node sent to each member now
        self._conversations: OrderedDict[str, bytes] = OrderedDict()  # conversation -> the replica it went to

    def catalog(self, own_in_flight: int) -> MeshCatalog:
        return self._routes.catalog(own_in_flight) if self._routes is not None else MeshCatalog((), None)

    def name_of(self, node_id: bytes) -> str:
        return self._routes.name_of(node_id) if self._routes is not None else node_id.hex()[:12]

    def route(self, request: ApiRequest, *, forwarded: bool, ours: Callable[[str], bool] | None,
              own_in_flight: int) -> Route | Refusal:
        """Where ``request`` goes, by the model it names. ``ours``: whether a name is this node's model or one
        of its tiers (None: this node serves none). A request holding images is refused (400) for a model no
        member runs with a projector."""
        requested, images = request.model, request.images
        if forwarded or self._routes is None:
            # A member forwarded it here because we serve it (or said so a moment ago).
            if ours is None or (forwarded and not ours(requested)):
                return Refusal(503, f"This member does not serve {requested or 'a model'} now; retry: the mesh "
                               "routes it to the member that does.", "unavailable", MODEL_UNAVAILABLE_CODE)
            return LOCAL
        catalog = self.catalog(own_in_flight)
        model = catalog.find(requested)
        if model is None:
            if ours is not None and ours(requested):
                return LOCAL  # one of our tiers, not in service: the proxy says why
            return Refusal(404, catalog.not_found(requested), "invalid_request_error", MODEL_NOT_FOUND_CODE)
        if images and not model.takes_images:
            return Refusal(400, f"The model {model.id!r} does not take images: its serving node runs it without a "
                           "projector. Send text only, or start that node with --mmproj FILE (the mmproj-*.gguf "
                           "published beside the model).", "invalid_request_error", NO_IMAGES_CODE)
        if model.local() is not None and len(model.replicas) == 1:
            return LOCAL
        return Route(model.id, request.conversation, len(model.replicas), images=images)

    async def replica(self, route: Route, failed: bytes | None, own_in_flight: int) -> bytes | None:
        """The member to ask for ``route`` now: a ready replica (None: this node's own llama-server),
        waiting (bounded) while the model loads. ``failed``: the member that just failed under the
        request, never asked again by it."""
        assert self._routes is not None and route.model is not None
        if failed is not None:
            route.avoid.add(failed)
        deadline = time.monotonic() + self._hold_timeout_s
        while True:
            seen = self._routes.version()
            model = self.catalog(own_in_flight).find(route.model)
            if model is not None:
                sticky = self._conversations.get(route.key) if route.key is not None else None
                chosen = choose_replica(model, self.forwarded_in_flight, avoid=frozenset(route.avoid), sticky=sticky,
                                        images=route.images)
                if chosen is not None:
                    self._remember(route.key, chosen.node_id)
                    return None if chosen.local else chosen.node_id
            if model is None or all(r.node_id in route.avoid for r in model.replicas):
                gone = ", ".join(sorted(self.name_of(node_id) for node_id in route.avoid))
                raise ServiceUnavailableError(
                    f"No member serves {route.model!r} now" + (f": {gone} stopped answering" if gone else "")
                    + ". Retry later, or ask for another model (GET /v1/models lists them).", MODEL_UNAVAILABLE_CODE)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServiceUnavailableError(MODEL_LOADING_MESSAGE, MODEL_LOADING_CODE)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._routes.wait_after(seen), remaining)

    @contextlib.contextmanager
    def forwarding(self, node_id: bytes) -> Iterator[None]:
        """Count a request in flight at member ``node_id``: routing spreads requests over replicas by it."""
        self.forwarded_in_flight[node_id] += 1
        try:
            yield
        finally:
            self.forwarded_in_flight[node_id] -= 1

    def _remember(self, key: str | None, node_id: bytes) -> None:
        if key is None:
            return
        self._conversations[key] = node_id
        self._conversations.move_to_end(key)
        while len(self._conversations) > MAX_REMEMBERED_CONVERSATIONS:
            self._conversations.popitem(last=False)
