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

aiohttp serves (it embeds in our event loop without taking over signals and
streams responses); httpx is the client to the internal llama-server.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from aiohttp import web

from .ports import LOOPBACK

log = logging.getLogger(__name__)

MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
HOLD_TIMEOUT_S = 300.0  # a restart includes loading the model over the mesh
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
# Generation can pause for long between tokens on a slow mesh: no read timeout.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=UPSTREAM_CONNECT_TIMEOUT_S, read=None, write=60.0, pool=None)
# Headers that describe one hop, not the message (RFC 9110 section 7.6.1), plus
# those aiohttp/httpx recompute for their own hop.
HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length",
})


def openai_error(status: int, message: str, error_type: str, code: str) -> web.Response:
    """An error body in the shape OpenAI clients parse."""
    return web.json_response(
        {"error": {"message": message, "type": error_type, "code": code}}, status=status
    )


class ApiProxy:
    """Forwards ``/v1/*`` and ``/health`` to whichever llama-server is current."""

    def __init__(self) -> None:
        self._client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT)
        self._runner: web.AppRunner | None = None
        self._upstream: str | None = None
        self._refusal: str | None = None
        self._settled = asyncio.Event()  # set while serving or refusing
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES)
        self.app.router.add_route("*", "/v1/{tail:.*}", self._forward)
        self.app.router.add_route("GET", "/health", self._forward)

    def serve(self, upstream_url: str) -> None:
        self._upstream, self._refusal = upstream_url, None
        self._settled.set()

    def refuse(self, reason: str) -> None:
        self._upstream, self._refusal = None, reason
        self._settled.set()

    def hold(self) -> None:
        self._settled.clear()

    async def drain(self, timeout_s: float) -> None:
        """Hold new requests and wait up to ``timeout_s`` for those in flight to finish."""
        self.hold()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("%d request(s) still running after %.0f s; restarting anyway", self._in_flight, timeout_s)

    async def start(self, port: int, host: str = LOOPBACK) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self._client.aclose()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        loading = openai_error(503, "The model is still being loaded on the mesh; retry in a moment.",
                               "unavailable", "model_loading")
        if not self._settled.is_set():
            if request.path == "/health":
                return loading  # health checks want an answer now, not a held request
            try:
                await asyncio.wait_for(self._settled.wait(), HOLD_TIMEOUT_S)
            except TimeoutError:
                return loading
        if self._upstream is None:
            return openai_error(503, self._refusal or "No llama-server is running.",
                                "unavailable", "insufficient_capacity")
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._relay(request, self._upstream)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _relay(self, request: web.Request, base: str) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream_request = self._client.build_request(
            request.method, base + request.rel_url.path_qs, headers=headers, content=await request.read()
        )
        try:
            upstream = await self._client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            log.warning("llama-server unreachable for %s: %s", request.rel_url.path, exc)
            return openai_error(502, f"llama-server did not answer ({type(exc).__name__}); "
                                "see `mesh-inference status`.", "server_error", "upstream_unreachable")
        try:
            response = web.StreamResponse(status=upstream.status_code, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS
            })
            await response.prepare(request)
            async for chunk in upstream.aiter_raw():
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            await upstream.aclose()
