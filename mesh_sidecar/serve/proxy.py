"""The user's API port: a streaming reverse proxy in front of the mesh's llama-servers.

Every node has one (``--api-port``, 8080 by default). A request goes where its
``model`` is served (routing.py): to this node's own llama-server, or over the
mesh to the API of a member that serves it (net/api_forward.py; that member's
proxy answers it as its own, with the forwarding token in place of the key).
The port belongs to the sidecar, not to llama-server, so llama-server can be
restarted (new plan, lost peer) while clients keep one address. Responses are
relayed chunk by chunk, so server-sent events reach the client token by token.

The node drives the proxy through three states:

    holding    new requests wait (up to HOLD_TIMEOUT_S) for llama-server to be ready
    serving    requests go to llama-server's URL
    refusing   requests get an OpenAI-style 503 saying why (e.g. missing capacity)

``drain()`` switches to holding and waits (bounded) for in-flight requests to end,
so a replan never cuts a request short that it could have let finish.

Requests survive a failover. Generation requests get a pinned seed (see
replay.py), so when llama-server dies under a request (a member was lost), the
proxy waits for the next llama-server and asks again: a request whose answer
had not started is retried whole; a stream that had started is continued from
the token ids it delivered (continuation.py), or, where continuation does not
cover the request, replayed; either way it goes on on the same connection with
exactly the text that was still missing. A plain request that continuation
covers is streamed from llama-server and assembled here, so it is continued
the same way. Which of these happens is decided by the request's recovery
machine (recovery.py, no I/O); ``_exchange`` carries out its decisions, for any
failover: llama-server dead, or its stream stalled. A stream that falls far behind a token's expected time (pace.py)
is a stall too, once a worker is found holding it up: the serving loop replans
without that worker (``on_slow``) and the stream continues on the new plan.
A broken connection alone is no failover: llama-server is declared failed only
when it is gone or does not answer its health check; while it does, the request
goes on there at once (retried, continued or replayed as above).
When the next llama-server runs another model (a smaller tier, tiers.py), a
stream that already sent text cannot continue: it ends with an error event
saying so, while a plain request is answered whole by the new model.

The proxy answers ``/v1/models`` itself: every model served in the mesh, and a
serving node's tiers (tiers.py); a generation request naming a tier that is not
in service gets an OpenAI-style 503 saying which one is and why. The recovery
below works the same for a member's API as for our llama-server: a forwarded
stream whose member died continues on another replica, or ends with
``model_unavailable`` when there is none.

aiohttp serves (it embeds in our event loop without taking over signals and
streams responses); upstream_http.py is the client, to our llama-server and to
members' APIs.

Who may use the port (an API key, a CORS origin, a body limit) is access.py's.

The dashboard (``/mesh``, dashboard.py) shares the port: its page and files are
keyless, its state is not. The proxy feeds it ``token_rate``: every streamed event
it relays, and llama-server's speed for each finished request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from aiohttp import web

from .. import environment
from ..errors import MeshError, ServiceUnavailableError, UpstreamCutError, UpstreamLostError
from ..net.api_forward import mesh_url
from ..ports import LOOPBACK
from ..wire.api_forward import FORWARDED_TOKEN_HEADER, HOP_BY_HOP_HEADERS, openai_error_body
from .access import CLIENT_ONLY_HEADERS, MAX_REQUEST_BODY_BYTES, OPEN_ACCESS, ApiAccess, cors, guard, openai_error
from .activity import TokenRate
from .catalog import MeshCatalog, mesh_models_list
from .continuation import DETOKENIZE_PATH, TEMPLATE_PATH, Assembly
from .generation import Generation, PreparedRequest, has_images, is_json_object, prepare, requested_model
from .metrics import Metrics
from .pace import Slow
from .receipt import CONTINUE_AT_HEADER, OutputTap, parse_continue_at
from .recovery import (
    MAX_FAILOVERS_PER_REQUEST,
    Ask,
    Broken,
    Cut,
    Decision,
    Failed,
    GiveUp,
    Prepare,
    Prepared,
    PrepareFailed,
    Refused,
    RequestRecovery,
    Shape,
    Step,
    Unavailable,
    UpstreamReady,
    WaitForUpstream,
)
from .routing import MODEL_LOADING_CODE, MODEL_LOADING_MESSAGE, MeshRouter, MeshRoutes, Refusal, Route
from .sse import GENERATION_PATHS, EventSplitter, sse_event
from .stall_watch import STALL_TIMEOUT_S, StallWatch
from .tiers import DEFAULT_MODEL_NAMES, TierView, why_not_served
from .upstream_http import LlamaServerHttp, MemberApiHttp, UpstreamAnswer, UpstreamClient, post_json

log = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 300.0  # a restart includes loading the model over the mesh
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SHUTDOWN_GRACE_S = 5.0  # running responses get this long to finish when the node stops
# After a request's connection to llama-server broke: llama-server is declared failed unless /health answers 200 within
# this (it answers at once, busy or not, from its HTTP threads).
HEALTH_CHECK_TIMEOUT_S = 2.0
MODELS_PATH = "/v1/models"


GenerationHook = Callable[[Generation], None]
ModelCatalog = Callable[[], Sequence[TierView]]  # every tier, the one in service first


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


@dataclass(frozen=True)
class ServingHooks:
    """What the proxy tells the serving loop, and asks it."""

    on_stall: Callable[[str], None] = lambda reason: None  # no byte for the stall timeout: restart
    # A stream far behind the expected token time: True when a worker was found to blame
    # (the serving loop replans without it), False to go on waiting.
    on_slow: Callable[[Slow], bool] = lambda slow: False
    links_rtt_s: Callable[[], float] = lambda: 0.0  # the plan's workers' round trips, summed
    planned_token_s: Callable[[], float | None] = lambda: None  # the plan's expected token time (None: unknown)
    # A request that ran alone ended its decode now: its tokens and llama-server's decode seconds
    # (the workers' speeds, speeds.py).
    on_decoded: Callable[[int, float], None] = lambda tokens, decode_s: None
    # Whether llama-server's layers are on other members, whose loss fails its requests over. Only then
    # are a stream's token ids asked for, to continue it: they cost llama-server time on every token.
    split: Callable[[], bool] = lambda: True
    on_generation: GenerationHook | None = None  # each generation answered with 200 (receipts)
    catalog: ModelCatalog | None = None  # the tiers: /v1/models, and requests naming a model


@dataclass(frozen=True)
class Upstream:
    """One llama-server as the proxy knows it, or another member's API that serves the model."""

    url: str
    epoch: int  # bumped on every serve/refuse, so a retry can wait for a newer one
    model: str  # the id of the model it serves
    node_id: bytes | None = None  # the member whose API this is (forwarded); None: this node's llama-server


@dataclass
class _ClientSide:
    """The client's side of one request: what it was sent so far, and what reads the answer on its way."""

    request: web.Request
    headers: dict[str, str]  # forwarded to llama-server
    tap: OutputTap | None  # token ids and timings, logprobs the client did not ask for stripped
    assembly: Assembly | None  # a plain answer made from llama-server's stream
    started: float  # monotonic time the request arrived
    response: web.StreamResponse | None = None  # a stream's response, once begun
    first_text_seen: bool = False
    continued_at: float | None = None  # monotonic time a continuation was asked, until its first new token

    async def write(self, pieces: list[bytes]) -> None:
        """Events for the stream's response in one write: one send (or QUIC packet), not one per event."""
        if data := b"".join(pieces):
            assert self.response is not None
            await self.response.write(data)


class ApiProxy:
    """Forwards ``/v1/*`` and ``/health`` to whichever llama-server is current; serves /metrics."""

    def __init__(self, metrics: Metrics, options: ProxyOptions = ProxyOptions(),
                 hooks: ServingHooks = ServingHooks(), *, mesh: MeshRoutes | None = None,
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
        self._stalls = StallWatch(options.stall_timeout_s)
        self._client = LlamaServerHttp(options.upstream_key)
        self._runner: web.AppRunner | None = None
        self._upstream: str | None = None
        self._model = ""  # the id of the model self._upstream serves
        self._why_unavailable: str | None = None  # while refusing: the reason clients are told
        # Bumped on every serve/refuse: "a new llama-server" even on the same port, so a request
        # that saw one fail waits for a later one.
        self._upstream_epoch = 0
        self._settled = asyncio.Event()  # set while serving or refusing
        # Set on every serve/refuse, then replaced: any number of waiters see each change.
        self._changed = asyncio.Event()
        self._in_flight = 0
        self._shared_until = -math.inf  # when two requests or more were last in flight here (monotonic)
        self._idle = asyncio.Event()
        self._idle.set()
        self.token_rate = TokenRate()
        self.app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES,
                                   middlewares=[guard(options.access, self.is_forwarded, options.public)])
        self.app.on_response_prepare.append(cors(options.access))
        self.app.router.add_route("*", "/v1/{tail:.*}", self._forward)
        self.app.router.add_route("GET", "/health", self._forward)
        self.app.router.add_route("GET", "/metrics", self._metrics)
        # A member continuing a stream it forwarded here renders and spells it on this llama-server.
        for path in (TEMPLATE_PATH, DETOKENIZE_PATH):
            self.app.router.add_route("POST", path, self._forward_from_member)

    def is_forwarded(self, request: web.Request) -> bool:
        """Whether a request came from an admitted member's forwarding stream (it carries our secret)."""
        token = request.headers.get(FORWARDED_TOKEN_HEADER)
        return (self._forward_token is not None and token is not None
                and hmac.compare_digest(token.encode(errors="replace"), self._forward_token.encode()))

    def attach(self, hooks: ServingHooks, upstream_key: str) -> None:
        """This node serves a model from now on: its llama-server (which needs ``upstream_key``) answers
        the requests routed here."""
        self._hooks = hooks
        self._client.authorize(upstream_key)
        self._serving_here = True

    @property
    def in_flight(self) -> int:
        """Requests this node's llama-server is answering now (gossip tells members, for routing)."""
        return self._in_flight

    # --- states, driven by the serving loop -----------------------------------------

    def serve(self, upstream_url: str, model: str = "") -> None:
        """Send requests to ``upstream_url``, a llama-server serving the model ``model`` (its id)."""
        self._model = model
        self._set(upstream_url, None)

    def refuse(self, reason: str) -> None:
        self._set(None, reason)

    def hold(self) -> None:
        self._settled.clear()

    def _set(self, upstream: str | None, why_unavailable: str | None) -> None:
        self._upstream, self._why_unavailable = upstream, why_unavailable
        self._upstream_epoch += 1
        self._settled.set()
        self._changed.set()
        self._changed = asyncio.Event()

    async def drain(self, timeout_s: float) -> None:
        """Hold new requests and wait up to ``timeout_s`` for those in flight to finish."""
        self.hold()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("%d request(s) still running after %.0f s; restarting anyway", self._in_flight, timeout_s)

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

    # --- choosing an upstream ---------------------------------------------------------

    async def _upstream_for(self, failed: int | None) -> Upstream:
        """A llama-server newer than the ``failed`` epoch; waits while holding."""
        deadline = time.monotonic() + self._options.hold_timeout_s
        while not self._settled.is_set() or self._upstream_epoch == failed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServiceUnavailableError(MODEL_LOADING_MESSAGE, MODEL_LOADING_CODE)
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass
        if self._upstream is None:
            raise ServiceUnavailableError(self._why_unavailable or "No llama-server is running.",
                                          "insufficient_capacity")
        return Upstream(self._upstream, self._upstream_epoch, self._model)

    # --- request handling -------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.metrics.exposition()
        if self._upstream is not None:
            try:
                status, content = await self._client.get(self._upstream + "/metrics", timeout_s=5.0)
                if status == 200:
                    text += content
            except UpstreamLostError:
                pass  # our own figures still count
        return web.Response(body=text, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        forwarded = self.is_forwarded(request)
        if request.path == "/health" and not self._serving_here:
            return self._count(request, web.json_response({"status": "ok", "models": self._catalog().ids()}))
        if request.path == "/health" and not self._settled.is_set():
            # Health checks want an answer now, not a held request.
            return self._count(request, openai_error(503, MODEL_LOADING_MESSAGE, "unavailable", MODEL_LOADING_CODE))
        if request.path == MODELS_PATH and request.method == "GET":
            return self._count(request, web.json_response(self._models_list()))
        try:
            continue_at = parse_continue_at(request.headers.get(CONTINUE_AT_HEADER))
        except ValueError as exc:
            return self._count(request, openai_error(400, str(exc), "invalid_request_error", "invalid_header"))
        body = await request.read()
        if request.method == "POST" and request.path in GENERATION_PATHS and not is_json_object(body):
            # Refused here, where the client called: a member serving the model never sees it.
            return self._count(request, openai_error(400, "The request body is not a JSON object.",
                                                     "invalid_request_error", "invalid_json"))
        requested = requested_model(body)
        ours = self._names_ours if self._serving_here else None
        route = self._router.route(requested, forwarded=forwarded, ours=ours, own_in_flight=self._in_flight,
                                   path=request.path, body=body, images=has_images(body))
        if isinstance(route, Refusal):
            return self._count(request, openai_error(route.status, route.message, route.error_type, route.code))
        local = route.model is None
        generation = request.method == "POST" and request.path in GENERATION_PATHS
        # The catalog plans every tier: asked for only when a request names a model.
        if (generation and local and self._hooks.catalog is not None and requested not in DEFAULT_MODEL_NAMES
                and (why := why_not_served(requested, self._hooks.catalog()))):
            return self._count(request, openai_error(503, why, "unavailable", "model_not_loaded"))
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_BY_HOP_HEADERS and k.lower() not in CLIENT_ONLY_HEADERS}
        try:
            upstream = await self._next_upstream(route, None)
        except ServiceUnavailableError as exc:
            return self._count(request, openai_error(503, str(exc), "unavailable", exc.code))
        # Prepared once its upstream is known: whether it could fail over depends on the plan in service.
        # Planned resume points (a receipt's replay) are continuations too, failover or not.
        continues = self._options.continue_streams and (bool(continue_at) or self._may_fail_over(route))
        prepared = (prepare(request.path, body, receipts=local and self._hooks.on_generation is not None,
                            continues=continues)
                    if generation else PreparedRequest(body, Shape.WHOLE))
        recovery = RequestRecovery(request.rel_url.path_qs, prepared.body, prepared.shape, upstream.model,
                                   prepared.continuation, continue_at, self._options.max_failovers)
        client = _ClientSide(request, headers, prepared.tap, prepared.assembly, time.monotonic())
        response, answered_by = await self._exchange(recovery, client, upstream, route)
        if (self._hooks.on_generation is not None and prepared.meant is not None and prepared.tap is not None
                and response.status == 200 and answered_by.node_id is None):
            self._report(Generation(request.path, prepared.meant, prepared.tap, answered_by.model,
                                    tuple(recovery.continued_at)))
        return self._count(request, response)

    async def _forward_from_member(self, request: web.Request) -> web.StreamResponse:
        """llama-server's own endpoints a continuation needs: for members' forwarding streams only."""
        if not self.is_forwarded(request):
            raise web.HTTPNotFound()
        return await self._forward(request)

    # --- routing by model (routing.py) ---------------------------------------------------

    def _catalog(self) -> MeshCatalog:
        return self._router.catalog(self._in_flight)

    def _models_list(self) -> dict[str, object]:
        tiers = self._hooks.catalog() if self._serving_here and self._hooks.catalog is not None else ()
        return mesh_models_list(self._catalog(), tiers, int(time.time()))

    def _names_ours(self, requested: str) -> bool:
        """Whether ``requested`` names the model this node serves, or one of its tiers."""
        if requested in DEFAULT_MODEL_NAMES or requested in (self._model, f"{self._model}.gguf"):
            return True
        return self._hooks.catalog is not None and any(
            requested in (view.id, view.file_name) for view in self._hooks.catalog())

    def _may_fail_over(self, route: Route) -> bool:
        """Whether a request on ``route`` could go on elsewhere if its upstream died: another replica of its
        model, or this node's llama-server restarted without a member it lost. Else a stream begun is
        replayed: a model alone on its one node fails over only when that node's llama-server crashes."""
        return route.replicas > 1 if route.model is not None else self._hooks.split()

    async def _next_upstream(self, route: Route, failed: Upstream | None) -> Upstream:
        """The llama-server (or member) to ask: a first one, or another after ``failed`` failed."""
        local_failed = failed is not None and failed.node_id is None
        if route.model is not None:
            node_id = await self._router.replica(route, failed.node_id if failed is not None else None,
                                                 self._in_flight)
            if node_id is not None:
                return Upstream(mesh_url(node_id), 0, route.model, node_id)
        return await self._upstream_for(failed.epoch if failed is not None and local_failed else None)

    def _count(self, request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(request.path, str(response.status)).inc()
        return response

    def _report(self, generation: Generation) -> None:
        assert self._hooks.on_generation is not None
        try:
            self._hooks.on_generation(generation)
        except Exception:  # a receipt must never cost the client its answer
            log.exception("could not record the generation for %s", generation.path)

    async def _exchange(self, recovery: RequestRecovery, client: _ClientSide,
                        at: Upstream, route: Route) -> tuple[web.StreamResponse, Upstream]:
        """Carry out the request's recovery (recovery.py): ask llama-server, and after a failover wait for
        the next one, prepare a continuation, retry, replay or give up, as the machine decides.

        Also returns the llama-server that answered last.
        """
        decision: Decision = recovery.start()
        planned_cut = False  # the next continuation reproduces a receipt's, it is no failover
        while True:
            if isinstance(decision, GiveUp):
                return await self._give_up(client.response, decision), at
            if isinstance(decision, WaitForUpstream):
                try:
                    at = await self._next_upstream(route, at)
                except ServiceUnavailableError as unavailable:
                    decision = recovery.handle(Unavailable(str(unavailable), unavailable.code))
                else:
                    decision = recovery.handle(UpstreamReady(at.model))
                continue
            if isinstance(decision, Prepare):
                with self._busy(at):
                    decision = recovery.handle(await self._prepare(decision, at))
                continue
            self._note(decision, client, counted=not planned_cut)
            with self._busy(at):
                outcome = await self._ask(decision, recovery, client, at)
            if isinstance(outcome, Failed) and at.node_id is not None:
                self.metrics.forward_errors.labels(at.model, self._router.name_of(at.node_id)).inc()
            if isinstance(outcome, web.StreamResponse):
                return outcome, at
            planned_cut = isinstance(outcome, Cut)
            decision = recovery.handle(outcome)

    @contextlib.contextmanager
    def _busy(self, at: Upstream) -> Iterator[None]:
        """Count a request in flight while it is at ``at``: this node's llama-server (a replan's drain waits
        for those), or a member (routing spreads requests over replicas by it)."""
        if at.node_id is not None:
            with self._router.forwarding(at.node_id):
                yield
            return
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            if self._in_flight > 1:
                self._shared_until = time.monotonic()
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def _client_for(self, at: Upstream) -> UpstreamClient:
        """This node's llama-server's client (it sends llama-server's key), or the mesh's (to a member's API)."""
        if at.node_id is None:
            return self._client
        assert self._mesh_client is not None
        return self._mesh_client

    def _note(self, ask: Ask, client: _ClientSide, counted: bool) -> None:
        """What a step means for the client's side: metrics, logs, the token ids and assembly kept."""
        path = client.request.path
        if ask.step is Step.CONTINUED:
            log.info("continuing a stream from %d delivered tokens", ask.resume_tokens)
            client.continued_at = time.monotonic()
            if client.tap is not None:
                client.tap.keep(ask.resume_tokens)  # the rest, held back, is generated again
            if counted:
                self.metrics.resumed.labels("continued").inc()
        elif ask.step is Step.REPLAYED:
            log.info("replaying a stream: %s", ask.why)
            self.metrics.resumed.labels("replayed").inc()
        elif ask.step is Step.SWITCHED:
            client.assembly = Assembly(path)
            if client.tap is not None:
                client.tap.forget()

    async def _ask(self, ask: Ask, recovery: RequestRecovery, client: _ClientSide,
                   at: Upstream) -> web.StreamResponse | Failed | Refused | Cut | Broken:
        """Send one ask and relay its answer: the client's response once done, or what went wrong."""
        request = client.request
        http = self._client_for(at)
        if at.node_id is not None:
            self.metrics.forwarded.labels(at.model, self._router.name_of(at.node_id)).inc()
        try:
            upstream = await http.send(request.method, at.url + ask.target, client.headers, ask.body)
            try:
                if ask.step is Step.CONTINUED and upstream.status_code != 200:
                    detail = (await upstream.aread())[:200].decode(errors="replace")
                    log.warning("llama-server refused a continuation (%d: %s)", upstream.status_code, detail)
                    return Refused(upstream.status_code, detail)
                if recovery.shape is Shape.WHOLE or (upstream.status_code != 200 and client.assembly is not None):
                    # Read it all before answering: a failure then can still be retried whole.
                    content = await self._read_whole(upstream)
                    self._observe_timings(content)
                    if client.tap is not None and upstream.status_code == 200:
                        content = client.tap.content(content)
                    return web.Response(status=upstream.status_code, body=content, headers=self._headers(upstream))
                if client.response is None and client.assembly is None:
                    client.response = web.StreamResponse(status=upstream.status_code, headers=self._headers(upstream))
                    await client.response.prepare(request)
                    recovery.began()
                splitter = EventSplitter()
                # A member's API judges its own llama-server's pace; here only its connection can fail.
                watch = (self._stalls.watch(request.path, links_rtt_s=self._hooks.links_rtt_s,
                                            planned_token_s=self._hooks.planned_token_s,
                                            on_slow=self._hooks.on_slow, on_stall=self._hooks.on_stall)
                         if at.node_id is None else contextlib.nullcontext(None))
                async with watch as watched:
                    async for chunk in upstream.aiter_raw():
                        events = splitter.feed(chunk)
                        if watched is not None:
                            watched.arrived(len(events))
                        pieces: list[bytes] = []
                        cut = False
                        for event in events:
                            pieces += (self._delivered(out, recovery, client) for out in recovery.relay(event))
                            if cut := recovery.cut_due():
                                break
                        await client.write(pieces)
                        if cut:
                            return Cut()
                if client.assembly is not None:
                    return self._assembled(client.assembly)
                assert client.response is not None
                await client.response.write_eof()
                return client.response
            finally:
                await upstream.aclose()
        except UpstreamLostError as exc:
            self.metrics.retries.inc()
            if await self._still_answers(at, exc):
                log.info("the connection to llama-server broke under %s (%r), but llama-server answers its health "
                         "check: the request goes on there", request.path, exc)
                return Failed(repr(exc), upstream_alive=True)
            log.warning("%s failed under %s (%r); waiting for the next one",
                        "llama-server" if at.node_id is None else self._router.name_of(at.node_id), request.path, exc)
            return Failed(repr(exc))
        except MeshError as exc:  # ReplayMismatchError, an oversized event
            return Broken(str(exc))
        except ConnectionResetError:
            # The client went away (often right after [DONE]): nothing left to deliver.
            if client.response is None:
                raise
            return client.response

    async def _still_answers(self, at: Upstream, lost: UpstreamLostError) -> bool:
        """Whether ``lost`` lost only the connection: ``at`` is this node's llama-server, still in service and not
        cut by the node (UpstreamCutError), and it answers its health check. Else it is declared failed."""
        if at.node_id is not None or isinstance(lost, UpstreamCutError) or at.epoch != self._upstream_epoch:
            return False
        try:
            status, _ = await self._client.get(at.url + "/health", timeout_s=HEALTH_CHECK_TIMEOUT_S)
        except UpstreamLostError:
            return False
        return status == 200 and at.epoch == self._upstream_epoch

    def _delivered(self, event: bytes, recovery: RequestRecovery, client: _ClientSide) -> bytes:
        """One event as the client is to get it (added to the assembly of a plain answer instead: b"")."""
        if not client.first_text_seen and recovery.delivered and client.response is not None:
            client.first_text_seen = True
            self.metrics.first_token.observe(time.monotonic() - client.started)
        if client.continued_at is not None and recovery.delivered:
            resumed_s = time.monotonic() - client.continued_at
            client.continued_at = None
            self.metrics.failover_phases.labels("resume").observe(resumed_s)
            log.info("the continued stream's first new token came %.2f s after it was asked", resumed_s)
        self._observe_timings(event)
        self.token_rate.streamed(event, time.monotonic())
        data = client.tap.event(event) if client.tap is not None else event
        if client.assembly is not None:
            client.assembly.add(data)
            return b""
        return data

    async def _read_whole(self, upstream: UpstreamAnswer) -> bytes:
        with self._stalls.prompt():
            return await upstream.aread()

    @staticmethod
    def _assembled(assembly: Assembly) -> web.Response:
        if assembly.error is not None:
            return web.json_response(assembly.error, status=500)
        return web.json_response(assembly.response())

    async def _prepare(self, prepare: Prepare, at: Upstream) -> Prepared | PrepareFailed:
        """Ask ``at`` to render the chat prompt and spell the resume ids, for a continuation."""
        try:
            prompt = None
            http = self._client_for(at)
            if prepare.template is not None:
                answer = await post_json(http, at.url + TEMPLATE_PATH, prepare.template)
                prompt = answer.get("prompt") if isinstance(answer, dict) else None
            return Prepared(prompt, await post_json(http, at.url + DETOKENIZE_PATH, prepare.detokenize))
        except UpstreamLostError as exc:
            return PrepareFailed(repr(exc))

    @staticmethod
    def _headers(upstream: UpstreamAnswer) -> dict[str, str]:
        # Its CORS headers are dropped later, in _cors, with any others.
        return {k: v for k, v in upstream.header_items() if k.lower() not in HOP_BY_HOP_HEADERS}

    @staticmethod
    async def _give_up(response: web.StreamResponse | None, give_up: GiveUp) -> web.StreamResponse:
        """An OpenAI-style error, or an error event ending a stream that had begun."""
        if response is None:
            return openai_error(give_up.status, give_up.message, "server_error", give_up.code)
        await response.write(sse_event(openai_error_body(give_up.message, "server_error", give_up.code)))
        await response.write_eof()
        return response

    def _observe_timings(self, content: bytes) -> None:
        """Record llama-server's decode speed from a response or final stream chunk."""
        if b'"timings"' not in content:
            return
        text = content.strip()
        if text.startswith(b"data: "):
            text = text[len(b"data: "):]
        try:
            timings = json.loads(text)["timings"]
            speed, tokens, decode_ms = (timings.get(key) for key in ("predicted_per_second", "predicted_n",
                                                                      "predicted_ms"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return
        if isinstance(speed, (int, float)) and speed > 0:
            self.metrics.tokens_per_second.observe(speed)
            self.token_rate.finished(speed)
            self._stalls.token_pace.finished(speed)
        if isinstance(tokens, int) and isinstance(decode_ms, (int, float)) and tokens > 0 and decode_ms > 0:
            began = time.monotonic() - decode_ms / 1000
            if self._in_flight <= 1 and self._shared_until < began:
                self._hooks.on_decoded(tokens, decode_ms / 1000)  # alone: its window is its own
