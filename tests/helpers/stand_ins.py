"""Stand-in llama-servers: aiohttp apps on loopback in the test's own event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiohttp import web

from mesh_sidecar.ports import free_tcp_port

STALLED_S = 3600.0  # longer than any test: a stand-in that stalls never sends again


async def start_stand_in(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` (a stand-in llama-server) on a free loopback port: its runner (to clean up) and URL."""
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = free_tcp_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def stream_events(request: web.Request, events: Sequence[bytes], stall_after: int | None) -> web.StreamResponse:
    """A stand-in's server-sent ``events``, then ``[DONE]``; with ``stall_after``, it stops sending after
    that many (the fault a dead worker causes)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i, event in enumerate(events):
        if i == stall_after:
            await asyncio.sleep(STALLED_S)
        await response.write(event)
    await response.write(b"data: [DONE]\n\n")
    return response
