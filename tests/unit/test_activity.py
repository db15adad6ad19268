"""What a node did just now: tokens streamed per second, and the lines it said lately."""

from __future__ import annotations

import time

import httpx
import pytest
from aiohttp import web

from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve import activity
from mesh_sidecar.serve.activity import TICKET_PLACEHOLDER, RecentEvents, TokenRate
from mesh_sidecar.serve.metrics import Metrics
from mesh_sidecar.serve.plan_start import PlanAnnouncement
from mesh_sidecar.serve.proxy import ApiProxy

TICKET = "meshinfabcdefghijklmnopqrstuvwxyz234567"


def test_token_rate_follows_the_stream_and_falls_to_zero_after_it():
    rate = TokenRate(window_s=2.0)
    assert rate.per_second(100.0) == 0.0
    for i in range(20):  # 20 tokens a second for one second
        rate.streamed(b'data: {"choices": [{"text": "a"}]}\n\n', 100.0 + i * 0.05)
    rate.streamed(b"data: [DONE]\n\n", 101.0)  # not a token
    rate.streamed(b": keep-alive comment\n\n", 101.0)  # nor is this
    assert rate.per_second(101.0) == pytest.approx(20.0)
    assert 0 < rate.per_second(102.5) < 20.0  # fading: the window still holds part of the stream
    assert rate.per_second(103.0) == 0.0
    rate.finished(18.7)
    assert rate.to_json(103.0) == {"tokens_per_second_now": 0.0, "last_request_tokens_per_second": 18.7}


def test_recent_events_are_bounded_show_a_plan_in_one_line_and_never_hold_a_ticket():
    events = RecentEvents(kept=3)
    events.add(1.0, f"On another machine, run: mesh-inference --join {TICKET}")
    events.add(2.0, PlanAnnouncement({"model": "model.gguf", "n_layers": 30,
                                      "nodes": [{"name": "w", "layers": [0, 14]}, {"name": "s", "layers": [14, 30]}]}))
    events.add(3.0, "Connected to peer b")
    events.add(4.0, "Connected to peer c")
    assert events.to_json() == [
        {"time": 2.0, "message": "Plan for model.gguf: 30 layers over w [0, 14), s [14, 30)"},
        {"time": 3.0, "message": "Connected to peer b"},
        {"time": 4.0, "message": "Connected to peer c"},
    ]
    events.add(5.0, f"Node ticket: {TICKET}")
    assert events.to_json()[-1]["message"] == f"Node ticket: {TICKET_PLACEHOLDER}"


async def test_the_proxy_feeds_the_token_rate_from_a_relayed_stream():
    """A stand-in llama-server streams five tokens and its timings; the proxy counts and keeps them."""
    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(5):
            await response.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        await response.write(b'data: {"choices": [], "timings": {"predicted_per_second": 42.5}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    upstream = web.Application()
    upstream.router.add_post("/v1/completions", stream)
    runner = web.AppRunner(upstream, shutdown_timeout=0.5)
    await runner.setup()
    upstream_port, port = free_tcp_port(), free_tcp_port()
    await web.TCPSite(runner, "127.0.0.1", upstream_port).start()
    proxy = ApiProxy(Metrics(lambda: ()))
    await proxy.start(port)
    proxy.serve(f"http://127.0.0.1:{upstream_port}")
    try:
        async with httpx.AsyncClient() as client:
            response = await client.post(f"http://127.0.0.1:{port}/v1/completions",
                                         json={"prompt": "x", "stream": True})
        assert response.text.count("data: ") == 7
        live = proxy.token_rate.to_json(time.monotonic())
        # Six data events (five tokens, then the timings) over the minimum span.
        assert live["tokens_per_second_now"] == pytest.approx(6 / activity.TOKEN_RATE_MIN_SPAN_S)
        assert live["last_request_tokens_per_second"] == 42.5
    finally:
        await proxy.close()
        await runner.cleanup()
