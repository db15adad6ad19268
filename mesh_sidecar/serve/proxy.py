"""The user's API port: the aiohttp application and its routes, in front of the mesh's llama-servers.

Every node has one (``--api-port``, 8080 by default). A request goes where its
``model`` is served (routing.py): to this node's own llama-server, or over the
mesh to the API of a member that serves it (net/api_forward.py; that member's
proxy answers it as its own, with the forwarding token in place of the key).
The port belongs to the sidecar, not to llama-server, so llama-server can be
restarted (new plan, lost peer) while clients keep one address.

Its body is read and parsed once, here (api_request.py); routing, preparation,
recovery and receipts take the parsed request. The serving loop holds, serves
or refuses requests through the gate (upstream_gate.py: ``serve``, ``refuse``,
``hold``, ``drain``); each request's exchange with llama-server or a member,
failovers included, is exchange.py's.

The proxy answers ``/v1/models`` itself: every model served in the mesh, and a
serving node's tiers (tiers.py); a generation request naming a tier that is not
in service gets an OpenAI-style 503 saying which one is and why.

aiohttp serves (it embeds in our event loop without taking over signals and
streams responses); upstream_http.py is the client, to our llama-server and to
members' APIs.

Who may use the port (an API key, a CORS origin, a body limit) is access.py's.

The dashboard (``/mesh``, dashboard.py) and the chat page (``/``, chat_page.py) share
the port: their pages and files are keyless, their data is not. The proxy feeds the
dashboard ``token_rate``: every streamed event it relays, and llama-server's speed for
each finished request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from .. import environment
from ..errors import ServiceUnavailableError, UpstreamLostError
from ..ports import LOOPBACK
from ..wire.api_forward import FORWARDED_TOKEN_HEADER, HOP_BY_HOP_HEADERS
from . import chat_page
from .access import CLIENT_ONLY_HEADERS, MAX_REQUEST_BODY_BYTES, OPEN_ACCESS, ApiAccess, cors, guard, openai_error
from .activity import TokenRate
from .api_request import ApiRequest, forwarded_as_is, prepare
from .catalog import MeshCatalog, mesh_models_list
from .continuation import DETOKENIZE_PATH, TEMPLATE_PATH
from .exchange import NO_HOOKS, ClientSide, Exchange, ServingHooks
from .metrics import Metrics
from .receipt import CONTINUE_AT_HEADER, Generation, parse_continue_at
from .recovery import MAX_FAILOVERS_PER_REQUEST, RequestRecovery
from .routing import MODEL_LOADING_CODE, MODEL_LOADING_MESSAGE, MeshRouter, MeshRoutes, Refusal, Route
from .stall_watch import STALL_TIMEOUT_S, StallWatch
from .tiers import DEFAULT_MODEL_NAMES, why_not_served
from .upstream_gate import UpstreamGate
from .upstream_http import LlamaServerHttp, MemberApiHttp

log = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 300.0  # a restart includes loading the model over the mesh
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SHUTDOWN_GRACE_S = 5.0  # running responses get this long to finish when the node stops
MODELS_PATH = "/v1/models"


@dataclass(frozen=True)
class ProxyOptions:
    """How the API port behaves."""

    access: ApiAccess = OPEN_ACCESS
    upstream_key: str | None = field(default=None, repr=False)  # llama-server's own key
    stall_timeout_s: float = STALL_TIMEOUT_S
    hold_timeout_s: float = HOLD_TIMEOUT_S
    max_failovers: int = MAX_FAILOVERS_PER_REQUEST
    # False: a stream begun is replayed after a failover, never continued (MESH_RESUME=replay).
    continue_streams: bool = field(default_factory=lambda: not environment.resume_by_replay())
    public: bool = True  # False (--no-api): only members' forwarded requests are served


class ApiProxy:
    """Forwards ``/v1/*`` and ``/health`` to whichever llama-server is current; serves /metrics."""

    def __init__(self, metrics: Metrics, options: ProxyOptions = ProxyOptions(),
                 hooks: ServingHooks = NO_HOOKS, *, mesh: MeshRoutes | None = None,
                 forward_token: str | None = None) -> None:
        """``mesh``: route requests for models other members serve to them (None: this node's llama-server
        only). ``forward_token``: the secret this node's forwarding streams present (net/api_forward.py):
        such requests come from an admitted member, which checked the client's key, and are served here."""
        self.metrics = metrics
        self._options = options
        self._hooks = hooks
        self._router = MeshRouter(mesh, options.hold_timeout_s)
        self._forward_token = forward_token
        # Whether this node has a llama-server of its own (a serving node): always, without a mesh.
        self._serving_here = mesh is None
        self._mesh_client = MemberApiHttp(mesh.transport) if mesh is not None else None
        self._client = LlamaServerHttp(options.upstream_key)
        self._runner: web.AppRunner | None = None
        self._gate = UpstreamGate(options.hold_timeout_s)
        self.token_rate = TokenRate()
        self._exchange = Exchange(metrics, hooks, self._gate, self._router, StallWatch(options.stall_timeout_s),
                                  self.token_rate, (self._client, self._mesh_client))
        self.app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES,
                                   middlewares=[guard(options.access, self.is_forwarded, options.public)])
        self.app.on_response_prepare.append(cors(options.access))
        self.app.router.add_route("*", "/v1/{tail:.*}", self._forward)
        self.app.router.add_route("GET", "/health", self._forward)
        self.app.router.add_route("GET", "/metrics", self._metrics)
        # A member continuing a stream it forwarded here renders and spells it on this llama-server.
        for path in (TEMPLATE_PATH, DETOKENIZE_PATH):
            self.app.router.add_route("POST", path, self._forward_from_member)
        # The chat page (chat_page.py) asks the serving llama-server's /props, filtered where the page is served.
        self.app.router.add_route("GET", chat_page.PROPS_PATH, self._forward_from_member)
        chat_page.add_routes(self.app, self._forward)

    def is_forwarded(self, request: web.Request) -> bool:
        """Whether a request came from an admitted member's forwarding stream (it carries our secret)."""
        token = request.headers.get(FORWARDED_TOKEN_HEADER)
        return (self._forward_token is not None and token is not None
                and hmac.compare_digest(token.encode(errors="replace"), self._forward_token.encode()))

    def attach(self, hooks: ServingHooks, upstream_key: str) -> None:
        """This node serves a model from now on: its llama-server (which needs ``upstream_key``) answers
        the requests routed here."""
        self._hooks = self._exchange.hooks = hooks
        self._client.authorize(upstream_key)
        self._serving_here = True

    @property
    def in_flight(self) -> int:
        """Requests this node's llama-server is answering now (gossip tells members, for routing)."""
        return self._gate.in_flight

    # --- states, driven by the serving loop (upstream_gate.py) --------------------------

    def serve(self, upstream_url: str, model: str = "") -> None:
        """Send requests to ``upstream_url``, a llama-server serving the model ``model`` (its id)."""
        self._gate.serve(upstream_url, model)

    def refuse(self, reason: str) -> None:
        self._gate.refuse(reason)

    def hold(self) -> None:
        self._gate.hold()

    async def drain(self, timeout_s: float) -> None:
        """Hold new requests and wait up to ``timeout_s`` for those in flight to finish."""
        await self._gate.drain(timeout_s)

    # --- the server ----------------------------------------------------------------------

    async def start(self, port: int, host: str = LOOPBACK) -> None:
        """Listen on ``port``; OSError (the port is taken) leaves the proxy as it was, to try another."""
        if self._runner is None:
            self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                         shutdown_timeout=SHUTDOWN_GRACE_S)
            await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()

    def connection_factory(self) -> Callable[[], asyncio.Protocol] | None:
        """The API server's new connection, for members' forwarded requests (net/api_forward.py) to reach
        it without a socket; None before ``start``."""
        return self._runner.server if self._runner is not None else None

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self._client.aclose()
        if self._mesh_client is not None:
            await self._mesh_client.aclose()

    # --- the routes ----------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.metrics.exposition()
        if self._gate.url is not None:
            try:
                status, content = await self._client.get(self._gate.url + "/metrics", timeout_s=5.0)
                if status == 200:
                    text += content
            except UpstreamLostError:
                pass  # our own figures still count
        return web.Response(body=text, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def _forward(self, request: web.Request, body: bytes | None = None) -> web.StreamResponse:
        """Answer an API request; ``body`` in place of the request's own (the chat page's, chat_page.py)."""
        forwarded = self.is_forwarded(request)
        if request.path == "/health" and not self._serving_here:
            return self._count(request, web.json_response({"status": "ok", "models": self._catalog().ids()}))
        if request.path == "/health" and not self._gate.settled:
            # Health checks want an answer now, not a held request.
            return self._count(request, openai_error(503, MODEL_LOADING_MESSAGE, "unavailable", MODEL_LOADING_CODE))
        if request.path == MODELS_PATH and request.method == "GET":
            return self._count(request, web.json_response(self._models_list()))
        try:
            continue_at = parse_continue_at(request.headers.get(CONTINUE_AT_HEADER))
        except ValueError as exc:
            return self._count(request, openai_error(400, str(exc), "invalid_request_error", "invalid_header"))
        api = ApiRequest.parse(request.method, request.path, await request.read() if body is None else body,
                               request.rel_url.path_qs)
        if api.generation and api.parsed is None:
            # Refused here, where the client called: a member serving the model never sees it.
            return self._count(request, openai_error(400, "The request body is not a JSON object.",
                                                     "invalid_request_error", "invalid_json"))
        ours = self._names_ours if self._serving_here else None
        route = self._router.route(api, forwarded=forwarded, ours=ours, own_in_flight=self._gate.in_flight)
        if isinstance(route, Refusal):
            return self._count(request, openai_error(route.status, route.message, route.error_type, route.code))
        local = route.model is None
        # The catalog plans every tier: asked for only when a request names a model.
        if (api.generation and local and self._hooks.catalog is not None and api.model not in DEFAULT_MODEL_NAMES
                and (why := why_not_served(api.model, self._hooks.catalog()))):
            return self._count(request, openai_error(503, why, "unavailable", "model_not_loaded"))
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_BY_HOP_HEADERS and k.lower() not in CLIENT_ONLY_HEADERS}
        try:
            upstream = await self._exchange.next_upstream(route, None)
        except ServiceUnavailableError as exc:
            return self._count(request, openai_error(503, str(exc), "unavailable", exc.code))
        # Prepared once its upstream is known: whether it could fail over depends on the plan in service.
        # Planned resume points (a receipt's replay) are continuations too, failover or not.
        continues = self._options.continue_streams and (bool(continue_at) or self._may_fail_over(route))
        prepared = (prepare(api, receipts=local and self._hooks.on_generation is not None, continues=continues)
                    if api.generation else forwarded_as_is(api))
        recovery = RequestRecovery(api.path_qs, prepared.body, prepared.shape, upstream.model,
                                   prepared.continuation, continue_at, self._options.max_failovers)
        client = ClientSide(request, headers, prepared.tap, prepared.assembly, time.monotonic())
        response, answered_by = await self._exchange.run(recovery, client, upstream, route)
        if (self._hooks.on_generation is not None and prepared.meant is not None and prepared.tap is not None
                and response.status == 200 and answered_by.node_id is None):
            self._report(Generation(api.path, prepared.meant, prepared.tap, answered_by.model,
                                    tuple(recovery.continued_at)))
        return self._count(request, response)

    async def _forward_from_member(self, request: web.Request) -> web.StreamResponse:
        """llama-server's own endpoints a continuation needs: for members' forwarding streams only."""
        if not self.is_forwarded(request):
            raise web.HTTPNotFound()
        return await self._forward(request)

    # --- routing by model (routing.py) ---------------------------------------------------

    def _catalog(self) -> MeshCatalog:
        return self._router.catalog(self._gate.in_flight)

    def _models_list(self) -> dict[str, object]:
        tiers = self._hooks.catalog() if self._serving_here and self._hooks.catalog is not None else ()
        return mesh_models_list(self._catalog(), tiers, int(time.time()))

    def _names_ours(self, requested: str) -> bool:
        """Whether ``requested`` names the model this node serves, or one of its tiers."""
        model = self._gate.model
        if requested in DEFAULT_MODEL_NAMES or requested in (model, f"{model}.gguf"):
            return True
        return self._hooks.catalog is not None and any(
            requested in (view.id, view.file_name) for view in self._hooks.catalog())

    def _may_fail_over(self, route: Route) -> bool:
        """Whether a request on ``route`` could go on elsewhere if its upstream died: another replica of its
        model, or this node's llama-server restarted without a member it lost. Else a stream begun is
        replayed: a model alone on its one node fails over only when that node's llama-server crashes."""
        return route.replicas > 1 if route.model is not None else self._hooks.split()

    def _count(self, request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(request.path, str(response.status)).inc()
        return response

    def _report(self, generation: Generation) -> None:
        assert self._hooks.on_generation is not None
        try:
            self._hooks.on_generation(generation)
        except Exception:  # a receipt must never cost the client its answer
            log.exception("could not record the generation for %s", generation.path)
