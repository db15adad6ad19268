"""The user's API port: a streaming reverse proxy in front of llama-server.

The port (``--serve``, e.g. 8080) belongs to the sidecar, not to llama-server,
so llama-server can be restarted (new plan, lost peer) while clients keep one
address. Responses are relayed chunk by chunk, so server-sent events reach the
client token by token.

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
the same way. ``_exchange`` does this for any failover: llama-server dead, or
its stream stalled. A stream that falls far behind a token's expected time (pace.py)
is a stall too, once a worker is found holding it up: the serving loop replans
without that worker (``on_slow``) and the stream continues on the new plan.
When the next llama-server runs another model (a smaller tier, tiers.py), a
stream that already sent text cannot continue: it ends with an error event
saying so, while a plain request is answered whole by the new model.

With a model catalog (the serving node's tiers) the proxy answers
``/v1/models`` itself, and a generation request naming a tier that is not in
service gets an OpenAI-style 503 saying which one is and why.

aiohttp serves (it embeds in our event loop without taking over signals and
streams responses); httpx is the client to the internal llama-server.

Who may use the port (an API key, a CORS origin, a body limit) is access.py's.

The dashboard (``/mesh``, dashboard.py) shares the port: its page and files are
keyless, its state is not. The proxy feeds it ``token_rate``: every streamed event
it relays, and llama-server's speed for each finished request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import httpx
from aiohttp import web

from .dashboard import TokenRate
from .. import environment
from ..errors import MeshError, ServiceUnavailableError
from .access import CLIENT_ONLY_HEADERS, MAX_REQUEST_BODY_BYTES, OPEN_ACCESS, ApiAccess, cors, guard, openai_error
from .metrics import Metrics
from .pace import Slow, StreamPace, TokenPace
from ..ports import LOOPBACK
from .continuation import (CONTINUE_PATH, DETOKENIZE_PATH, TEMPLATE_PATH, Assembly, Continuation, streamed,
                           uncovered)
from .receipt import OutputTap, ask_for_token_ids
from .replay import GENERATION_PATHS, EventSplitter, Replay, StreamLedger, pin_seed
from .tiers import DEFAULT_MODEL_NAMES, TierView, models_list, refusal_for

log = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 300.0  # a restart includes loading the model over the mesh
MAX_FAILOVERS_PER_REQUEST = 2
# A stream with no byte for this long is stuck (a member stopped answering without being lost
# yet): llama-server is restarted and the stream continued. Most stalls are judged sooner,
# against a token's expected time (pace.py); this covers prompts and a node's first request.
STALL_TIMEOUT_S = 60.0
PACE_CHECK_S = 0.5  # how often a stream with no new byte is judged against its pace (pace.py)
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
# Generation can pause for long between tokens on a slow mesh: no read timeout.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=UPSTREAM_CONNECT_TIMEOUT_S, read=None, write=60.0, pool=None)
# Headers that describe one hop, not the message (RFC 9110 section 7.6.1), plus
# those aiohttp/httpx recompute for their own hop.
HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length",
})
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SHUTDOWN_GRACE_S = 5.0  # running responses get this long to finish when the node stops
MODEL_LOADING_MESSAGE = "The model is still being loaded on the mesh; retry in a moment."
MODEL_LOADING_CODE = "model_loading"
MODELS_PATH = "/v1/models"


@dataclass(frozen=True)
class Generation:
    """One finished generation request, for receipts: the request as sent (seed pinned) and what came back."""

    path: str
    request: dict
    output: OutputTap
    model: str  # the id of the model that answered


GenerationHook = Callable[[Generation], None]
ModelCatalog = Callable[[], Sequence[TierView]]  # every tier, the one in service first


@dataclass(frozen=True)
class Upstream:
    """One llama-server as the proxy knows it."""

    url: str
    epoch: int  # bumped on every serve/refuse, so a retry can wait for a newer one
    model: str  # the id of the model it serves


def _requested_model(body: bytes) -> str:
    """The ``model`` a generation request names ("" for none, or a body we cannot read)."""
    try:
        request = json.loads(body)
    except ValueError:
        return ""
    model = request.get("model") if isinstance(request, dict) else None
    return model if isinstance(model, str) else ""


@dataclass(frozen=True)
class Tapped:
    """A generation request made to return token ids (for receipts and continuation)."""

    body: bytes  # as sent to llama-server
    meant: dict  # the request as the client meant it
    sent: dict  # the request as sent to llama-server
    tap: OutputTap  # reads the ids, strips them unless the client asked


def _tapped(body: bytes, path: str) -> Tapped | None:
    """The request asking for token ids too (None: not a JSON object; llama-server will answer it)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    meant = json.loads(body)
    added = ask_for_token_ids(request, path)
    return Tapped(json.dumps(request).encode(), meant, request, OutputTap(strip=added))


def _streamed(tapped: Tapped, path: str) -> Tapped:
    """A plain request sent as a stream, to be assembled (and continued after a failover)."""
    sent = streamed(path, tapped.sent)
    return Tapped(json.dumps(sent).encode(), tapped.meant, sent, tapped.tap)


def _sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class ApiProxy:
    """Forwards ``/v1/*`` and ``/health`` to whichever llama-server is current; serves /metrics."""

    def __init__(self, metrics: Metrics, on_stall: Callable[[str], None],
                 stall_timeout_s: float = STALL_TIMEOUT_S, access: ApiAccess = OPEN_ACCESS,
                 upstream_key: str | None = None, on_generation: GenerationHook | None = None,
                 catalog: ModelCatalog | None = None, on_slow: Callable[[Slow], bool] = lambda slow: False,
                 links_rtt_s: Callable[[], float] = lambda: 0.0) -> None:
        self.metrics = metrics
        self._catalog = catalog
        self._access = access
        self._on_generation = on_generation
        self._on_stall = on_stall
        self._stall_timeout_s = stall_timeout_s
        # A stream far behind the expected token time: True when a worker was found to blame
        # (the serving loop replans without it), False to go on waiting.
        self._on_slow = on_slow
        self._links_rtt_s = links_rtt_s  # the plan's workers' round trips, summed
        self._pace = TokenPace()
        self._prompts_waiting = 0  # upstream requests that have not yet sent their first byte
        self._continue_streams = not environment.resume_by_replay()
        self._client = httpx.AsyncClient(
            timeout=UPSTREAM_TIMEOUT,
            headers={"Authorization": f"Bearer {upstream_key}"} if upstream_key else None)
        self._runner: web.AppRunner | None = None
        self._upstream: str | None = None
        self._model = ""  # the id of the model self._upstream serves
        self._refusal: str | None = None
        # Bumped on every serve/refuse: "a new llama-server" even on the same port, so a request
        # that saw one fail waits for a later one.
        self._upstream_epoch = 0
        self._settled = asyncio.Event()  # set while serving or refusing
        self._changed = asyncio.Condition()  # notified on every serve/refuse
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.token_rate = TokenRate()
        self.app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES, middlewares=[guard(access)])
        self.app.on_response_prepare.append(cors(access))
        self.app.router.add_route("*", "/v1/{tail:.*}", self._forward)
        self.app.router.add_route("GET", "/health", self._forward)
        self.app.router.add_route("GET", "/metrics", self._metrics)

    # --- states, driven by the serving loop -----------------------------------------

    def serve(self, upstream_url: str, model: str = "") -> None:
        """Send requests to ``upstream_url``, a llama-server serving the model ``model`` (its id)."""
        self._model = model
        self._set(upstream_url, None)

    def refuse(self, reason: str) -> None:
        self._set(None, reason)

    def hold(self) -> None:
        self._settled.clear()

    def _set(self, upstream: str | None, refusal: str | None) -> None:
        self._upstream, self._refusal = upstream, refusal
        self._upstream_epoch += 1
        self._settled.set()
        asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def drain(self, timeout_s: float) -> None:
        """Hold new requests and wait up to ``timeout_s`` for those in flight to finish."""
        self.hold()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("%d request(s) still running after %.0f s; restarting anyway", self._in_flight, timeout_s)

    async def start(self, port: int, host: str = LOOPBACK) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self._client.aclose()

    # --- choosing an upstream ---------------------------------------------------------

    async def _upstream_for(self, failed: int | None) -> Upstream:
        """A llama-server newer than the ``failed`` epoch; waits while holding."""
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        async with self._changed:
            while not self._settled.is_set() or self._upstream_epoch == failed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServiceUnavailableError(MODEL_LOADING_MESSAGE, MODEL_LOADING_CODE)
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    pass
        if self._upstream is None:
            raise ServiceUnavailableError(self._refusal or "No llama-server is running.", "insufficient_capacity")
        return Upstream(self._upstream, self._upstream_epoch, self._model)

    # --- access: key, CORS, body size -------------------------------------------------

    # --- request handling -------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.metrics.exposition()
        if self._upstream is not None:
            try:
                upstream = await self._client.get(self._upstream + "/metrics", timeout=5.0)
                if upstream.status_code == 200:
                    text += upstream.content
            except httpx.HTTPError:
                pass  # our own figures still count
        return web.Response(body=text, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health" and not self._settled.is_set():
            # Health checks want an answer now, not a held request.
            return self._count(request, openai_error(503, MODEL_LOADING_MESSAGE, "unavailable", MODEL_LOADING_CODE))
        if request.path == MODELS_PATH and request.method == "GET" and self._catalog is not None:
            return self._count(request, web.json_response(models_list(self._catalog(), int(time.time()))))
        body = await request.read()
        streaming = False
        tapped: Tapped | None = None
        continuation: Continuation | None = None
        assembly: Assembly | None = None
        if request.method == "POST" and request.path in GENERATION_PATHS:
            # The catalog plans every tier: asked for only when a request names a model.
            requested = _requested_model(body)
            if (self._catalog is not None and requested not in DEFAULT_MODEL_NAMES
                    and (why := refusal_for(requested, self._catalog()))):
                return self._count(request, openai_error(503, why, "unavailable", "model_not_loaded"))
            body, streaming = pin_seed(body)
            if self._on_generation is not None or self._continue_streams:
                tapped = _tapped(body, request.path)
            if tapped is not None and self._continue_streams and uncovered(request.path, tapped.sent) is None:
                if not streaming:
                    tapped, assembly = _streamed(tapped, request.path), Assembly(request.path)
                continuation = Continuation(request.path, tapped.sent)
            elif self._on_generation is None:
                tapped = None  # neither receipts nor a continuation need token ids: none asked for
            if tapped is not None:
                body = tapped.body
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_HEADERS and k.lower() not in CLIENT_ONLY_HEADERS}
        try:
            upstream = await self._upstream_for(None)
        except ServiceUnavailableError as exc:
            return self._count(request, openai_error(503, str(exc), "unavailable", exc.code))
        self._in_flight += 1
        self._idle.clear()
        try:
            response, answered_by = await self._exchange(request, upstream, headers, body, streaming,
                                                         tapped.tap if tapped else None, continuation, assembly)
            if self._on_generation is not None and tapped is not None and response.status == 200:
                self._report(Generation(request.path, tapped.meant, tapped.tap, answered_by.model))
            return self._count(request, response)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def _count(self, request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(request.path, str(response.status)).inc()
        return response

    def _report(self, generation: Generation) -> None:
        assert self._on_generation is not None
        try:
            self._on_generation(generation)
        except Exception:  # a receipt must never cost the client its answer
            log.exception("could not record the generation for %s", generation.path)

    async def _exchange(self, request: web.Request, at: Upstream, headers: dict[str, str], body: bytes,
                        streaming: bool, tap: OutputTap | None = None, continuation: Continuation | None = None,
                        assembly: Assembly | None = None) -> tuple[web.StreamResponse, Upstream]:
        """Send to llama-server; on any failure (death, stall) wait for the next one and retry,
        continue or replay. With an ``assembly``, llama-server streams what the client gets whole.

        Also returns the llama-server that answered last.
        """
        started = time.monotonic()
        first_text_seen = False
        response: web.StreamResponse | None = None
        ledger = StreamLedger()
        replay: Replay | None = None
        target, asked = request.rel_url.path_qs, body  # what goes to llama-server: the request, or its continuation
        continuing = False
        failovers = 0
        while True:
            try:
                upstream = await self._client.send(self._client.build_request(
                    request.method, at.url + target, headers=headers, content=asked), stream=True)
                try:
                    if continuing and upstream.status_code != 200:
                        log.warning("llama-server refused a continuation (%d: %s); replaying instead",
                                    upstream.status_code, (await upstream.aread())[:200])
                        target, asked, continuing, replay = request.rel_url.path_qs, body, False, self._replay(ledger)
                        continue
                    if (assembly is None and not streaming) or (assembly is not None and upstream.status_code != 200):
                        # Read it all before answering: a failure then can still be retried whole.
                        content = await self._read_whole(upstream)
                        self._observe_timings(content)
                        if tap is not None and upstream.status_code == 200:
                            content = tap.content(content)
                        return web.Response(status=upstream.status_code, body=content,
                                            headers=self._headers(upstream)), at
                    if response is None and assembly is None:
                        response = web.StreamResponse(status=upstream.status_code, headers=self._headers(upstream))
                        await response.prepare(request)
                    splitter = EventSplitter()
                    async for chunk in self._unless_stalled(upstream.aiter_raw(), request.path):
                        for event in self._reshaped(splitter.feed(chunk), continuation if continuing else None):
                            out = event if replay is None else replay.filter(event)
                            if out is None:
                                continue
                            if replay is None:
                                ledger.record(event)
                                if continuation is not None:
                                    continuation.record(event)
                            if not first_text_seen and ledger.delivered and response is not None:
                                first_text_seen = True
                                self.metrics.first_token.observe(time.monotonic() - started)
                            self._observe_timings(out)
                            if assembly is not None:
                                assembly.add(tap.event(out) if tap is not None else out)
                            else:
                                assert response is not None
                                await response.write(tap.event(out) if tap is not None else out)
                            self.token_rate.streamed(out, time.monotonic())
                    if assembly is not None:
                        return self._assembled(assembly), at
                    assert response is not None
                    await response.write_eof()
                    return response, at
                finally:
                    await upstream.aclose()
            except httpx.TransportError as exc:
                failovers += 1
                if failovers > MAX_FAILOVERS_PER_REQUEST:
                    return await self._give_up(response, f"llama-server failed again ({exc!r})"), at
                log.warning("llama-server failed under %s (%r); waiting for the next one", request.path, exc)
                self.metrics.retries.inc()
                try:
                    next_at = await self._wait_elsewhere(at.epoch)
                except ServiceUnavailableError as unavailable:
                    return await self._give_up(response, str(unavailable), unavailable.code), at
                if assembly is not None and ledger.delivered and next_at.model != at.model:
                    # Nothing reached the client: the new model answers it whole, as any plain request.
                    ledger, assembly = StreamLedger(), Assembly(request.path)
                    continuation = Continuation(request.path, continuation.sent) if continuation else None
                    if tap is not None:
                        tap.forget()
                    target, asked, continuing, replay = request.rel_url.path_qs, body, False, None
                elif ledger.delivered and next_at.model != at.model:
                    return await self._give_up(response, (
                        f"The mesh lost capacity and now serves {next_at.model!r} instead of {at.model!r}; "
                        "a stream cannot continue on another model. Send the request again."),
                        "model_switched"), at
                at = next_at
                if response is not None or ledger.delivered:
                    # Once replayed, the continuation's record of token ids stops: replay again.
                    if (replay is None and continuation is not None
                            and (resumed := await self._continuation(continuation, at))):
                        target, asked, continuing = CONTINUE_PATH, resumed, True
                        self.metrics.resumed.labels("continued").inc()
                    else:
                        target, asked, continuing, replay = request.rel_url.path_qs, body, False, self._replay(ledger)
            except MeshError as exc:  # ReplayMismatchError, an oversized event
                return await self._give_up(response, str(exc)), at
            except ConnectionResetError:
                # The client went away (often right after [DONE]): nothing left to deliver.
                assert response is not None
                return response, at

    async def _read_whole(self, upstream: httpx.Response) -> bytes:
        # Its prompt and tokens pass unseen: while it runs, other streams' pauses may be its prompt.
        self._prompts_waiting += 1
        try:
            return await upstream.aread()
        finally:
            self._prompts_waiting -= 1

    @staticmethod
    def _assembled(assembly: Assembly) -> web.Response:
        if assembly.error is not None:
            return web.json_response(assembly.error, status=500)
        return web.json_response(assembly.response())

    def _replay(self, ledger: StreamLedger) -> Replay:
        self.metrics.resumed.labels("replayed").inc()
        return Replay(ledger)

    @staticmethod
    def _reshaped(events: list[bytes], continuation: Continuation | None) -> list[bytes]:
        """A continuation's events in the client's endpoint's format; others as they are."""
        return events if continuation is None else [out for event in events for out in continuation.reshape(event)]

    async def _continuation(self, continuation: Continuation, at: Upstream) -> bytes | None:
        """The body that asks ``at`` to go on from the tokens delivered (None: replay instead)."""
        if not continuation.resumable():
            log.info("replaying a stream: %s", continuation.why_not or "no token to continue from")
            return None
        try:
            prompt = None
            if (template := continuation.template_request()) is not None:
                rendered = await self._client.post(at.url + TEMPLATE_PATH, json=template)
                rendered.raise_for_status()
                answer = rendered.json()
                prompt = answer.get("prompt") if isinstance(answer, dict) else None
                if not isinstance(prompt, str):
                    raise ValueError(f"{TEMPLATE_PATH} answered without a prompt")
            spelled = await self._client.post(at.url + DETOKENIZE_PATH, json=continuation.detokenize_request())
            spelled.raise_for_status()
            if not continuation.spells_delivered(spelled.json()):
                log.info("replaying a stream: its token ids do not spell the text delivered")
                return None
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("replaying a stream: cannot prepare its continuation (%r)", exc)
            return None
        log.info("continuing a stream from %d delivered tokens", len(continuation.resume_ids))
        return json.dumps(continuation.request(prompt)).encode()

    async def _unless_stalled(self, chunks: AsyncIterator[bytes], path: str) -> AsyncIterator[bytes]:
        """The chunks, until the stream falls far behind a token's expected time and a worker is found
        holding it up (pace.py; the serving loop then replans without it), or until nothing comes for the
        stall timeout (llama-server is restarted). Either way the request fails over."""
        began = judge_at = time.monotonic()
        pace = StreamPace()
        pending: asyncio.Future[bytes] | None = None
        self._prompts_waiting += 1
        waiting = True  # for this stream's first byte: its prompt is being processed
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(chunks))
                done, _ = await asyncio.wait((pending,), timeout=PACE_CHECK_S)
                now = time.monotonic()
                if done:
                    try:
                        chunk = pending.result()
                    except StopAsyncIteration:
                        return
                    pending = None
                    if waiting:
                        waiting = False
                        self._prompts_waiting -= 1
                    pace.arrived(now)
                    yield chunk
                    if now < judge_at:  # judged at most every PACE_CHECK_S: tokens come far faster
                        continue
                judge_at = now + PACE_CHECK_S
                expected_s = self._pace.expected_s(self._links_rtt_s())
                if (slow := pace.judge(now, expected_s, self._prompts_waiting > 0)) is not None:
                    if self._on_slow(slow):
                        raise httpx.ReadTimeout(f"a worker held the stream up ({slow.describe()})")
                    pace.excuse(now)
                elif now - pace.last_progress(began) >= self._stall_timeout_s:
                    self._on_stall(f"No progress on a {path} stream for {self._stall_timeout_s:.0f} s")
                    raise httpx.ReadTimeout("llama-server stalled")
        finally:
            if waiting:
                self._prompts_waiting -= 1
            if pending is not None:
                pending.cancel()
                await asyncio.wait((pending,))  # the stream is closed next: its read must have ended

    async def _wait_elsewhere(self, failed: int) -> Upstream:
        """The next llama-server; while waiting this request does not count as in flight,
        so it cannot hold up the very replan it waits for."""
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()
        try:
            return await self._upstream_for(failed)
        finally:
            self._in_flight += 1
            self._idle.clear()

    @staticmethod
    def _headers(upstream: httpx.Response) -> dict[str, str]:
        # Its CORS headers are dropped later, in _cors, with any others.
        return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}

    async def _give_up(self, response: web.StreamResponse | None, message: str,
                       code: str = "upstream_failed") -> web.StreamResponse:
        """An OpenAI-style error, or an error event ending a stream that had begun."""
        if response is None:
            return openai_error(503 if code != "upstream_failed" else 502, message, "server_error", code)
        await response.write(_sse_error(message, code))
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
            speed = json.loads(text)["timings"]["predicted_per_second"]
        except (ValueError, KeyError, TypeError):
            return
        if isinstance(speed, (int, float)) and speed > 0:
            self.metrics.tokens_per_second.observe(speed)
            self.token_rate.finished(speed)
            self._pace.finished(speed)
