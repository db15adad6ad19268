"""The user's API port: a streaming reverse proxy in front of llama-server.

The port (``--serve``, e.g. 8080) belongs to the sidecar, not to llama-server,
so llama-server can be restarted (new plan, lost peer) while clients keep one
address. Responses are relayed chunk by chunk, so server-sent events reach the
client token by token.

aiohttp serves (it embeds in our event loop without taking over signals and
streams responses); httpx is the client to the internal llama-server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
from aiohttp import web

from .ports import LOOPBACK

log = logging.getLogger(__name__)

MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
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

    def __init__(self, upstream_url: Callable[[], str | None]) -> None:
        # A callable, not a fixed URL: the serving node swaps llama-server on replans.
        self._upstream_url = upstream_url
        self._client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT)
        self._runner: web.AppRunner | None = None
        self.app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES)
        self.app.router.add_route("*", "/v1/{tail:.*}", self._forward)
        self.app.router.add_route("GET", "/health", self._forward)

    async def start(self, port: int, host: str = LOOPBACK) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self._client.aclose()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        base = self._upstream_url()
        if base is None:
            return openai_error(503, "The model is still loading on the mesh; retry in a moment.",
                                "unavailable", "model_loading")
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
