"""The exchange of one request with its upstreams: ask, relay the answer, and carry out its recovery.

Requests survive a failover. Generation requests get a pinned seed (api_request.py), so when
llama-server dies under a request (a member was lost), the exchange waits for the next
llama-server and asks again: a request whose answer had not started is retried whole; a
stream that had started is continued from the token ids it delivered (continuation.py), or,
where continuation does not cover the request, replayed; either way it goes on on the same
connection with exactly the text that was still missing. A plain request that continuation
covers is streamed from llama-server and assembled here, so it is continued the same way.
Which of these happens is decided by the request's recovery machine (recovery.py, no I/O);
``Exchange.run`` carries out its decisions, for any failover: llama-server dead, or its stream
stalled. A stream that falls far behind a token's expected time (pace.py) is a stall too, once
a worker is found holding it up: the serving loop replans without that worker (``on_slow``)
and the stream continues on the new plan.

A broken connection alone is no failover: llama-server is declared failed only when it is
gone or does not answer its health check; while it does, the request goes on there at once
(retried, continued or replayed as above). When the next llama-server runs another model (a
smaller tier, tiers.py), a stream that already sent text cannot continue: it ends with an
error event saying so, while a plain request is answered whole by the new model. The recovery
works the same for a member's API as for our llama-server: a forwarded stream whose member
died continues on another replica, or ends with ``model_unavailable`` when there is none.

Responses are relayed chunk by chunk, so server-sent events reach the client token by token;
every streamed event feeds ``token_rate`` (the dashboard), and llama-server's speed for each
finished request feeds the metrics and the stall watch's pace.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from aiohttp import web

from ..errors import MeshError, ServiceUnavailableError, UpstreamCutError, UpstreamLostError
from ..net.api_forward import mesh_url
from ..wire.api_forward import HOP_BY_HOP_HEADERS, openai_error_body
from .access import openai_error
from .activity import TokenRate
from .continuation import DETOKENIZE_PATH, TEMPLATE_PATH, Assembly
from .metrics import Metrics
from .pace import Slow
from .receipt import Generation, OutputTap
from .recovery import (
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
from .routing import MeshRouter, Route
from .sse import EventSplitter, sse_event
from .stall_watch import StallWatch
from .tiers import TierView
from .upstream_gate import Upstream, UpstreamGate
from .upstream_http import LlamaServerHttp, UpstreamAnswer, UpstreamClient, post_json

log = logging.getLogger(__name__)

# After a request's connection to llama-server broke: llama-server is declared failed unless /health answers 200 within
# this (it answers at once, busy or not, from its HTTP threads).
HEALTH_CHECK_TIMEOUT_S = 2.0

GenerationHook = Callable[[Generation], None]
ModelCatalog = Callable[[], Sequence[TierView]]  # every tier, the one in service first


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


NO_HOOKS = ServingHooks()  # a node that serves no model (yet): nothing to tell


@dataclass
class ClientSide:
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


class Exchange:
    """Carries out requests' exchanges with this node's llama-server and members' APIs, and their recovery."""

    def __init__(self, metrics: Metrics, hooks: ServingHooks, gate: UpstreamGate, router: MeshRouter,
                 stalls: StallWatch, token_rate: TokenRate,
                 clients: tuple[LlamaServerHttp, UpstreamClient | None]) -> None:
        """``clients``: this node's llama-server's, and the mesh's to members' APIs (None: no mesh)."""
        self.metrics = metrics
        self.hooks = hooks  # replaced when the node starts serving (ApiProxy.attach)
        self._gate = gate
        self._router = router
        self._stalls = stalls
        self._client, self._mesh_client = clients
        self.token_rate = token_rate

    async def next_upstream(self, route: Route, failed: Upstream | None) -> Upstream:
        """The llama-server (or member) to ask: a first one, or another after ``failed`` failed."""
        local_failed = failed is not None and failed.node_id is None
        if route.model is not None:
            node_id = await self._router.replica(route, failed.node_id if failed is not None else None,
                                                 self._gate.in_flight)
            if node_id is not None:
                return Upstream(mesh_url(node_id), 0, route.model, node_id)
        return await self._gate.upstream(failed.epoch if failed is not None and local_failed else None)

    async def run(self, recovery: RequestRecovery, client: ClientSide,
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
                    at = await self.next_upstream(route, at)
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
        with self._router.forwarding(at.node_id) if at.node_id is not None else self._gate.busy():
            yield

    def _client_for(self, at: Upstream) -> UpstreamClient:
        """This node's llama-server's client (it sends llama-server's key), or the mesh's (to a member's API)."""
        if at.node_id is None:
            return self._client
        assert self._mesh_client is not None
        return self._mesh_client

    def _note(self, ask: Ask, client: ClientSide, counted: bool) -> None:
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

    async def _ask(self, ask: Ask, recovery: RequestRecovery, client: ClientSide,
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
                watch = (self._stalls.watch(request.path, links_rtt_s=self.hooks.links_rtt_s,
                                            planned_token_s=self.hooks.planned_token_s,
                                            on_slow=self.hooks.on_slow, on_stall=self.hooks.on_stall)
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
        if at.node_id is not None or isinstance(lost, UpstreamCutError) or at.epoch != self._gate.epoch:
            return False
        try:
            status, _ = await self._client.get(at.url + "/health", timeout_s=HEALTH_CHECK_TIMEOUT_S)
        except UpstreamLostError:
            return False
        return status == 200 and at.epoch == self._gate.epoch

    def _delivered(self, event: bytes, recovery: RequestRecovery, client: ClientSide) -> bytes:
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
        # Its CORS headers are dropped later, in access.cors, with any others.
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
            if self._gate.in_flight <= 1 and self._gate.shared_until < began:
                self.hooks.on_decoded(tokens, decode_ms / 1000)  # alone: its window is its own
