"""The API proxy against stand-in upstreams on real sockets: stalls, failover, refusal.

The stand-ins replace llama-server only to produce faults on cue (a stream that
stops mid-way); the real end-to-end failover runs in test_failover.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from aiohttp import web

from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve.exchange import ServingHooks
from mesh_sidecar.serve.metrics import Metrics
from mesh_sidecar.serve.pace import STALL_FLOOR_S, Slow
from mesh_sidecar.serve.proxy import ApiProxy, ProxyOptions
from tests.helpers.stand_ins import start_stand_in, stream_events

PIECES = ["The", " keeper", " lit", " the", " lamp", "."]


def event(text: str, id_: str) -> bytes:
    return b"data: " + json.dumps({"id": id_, "choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


async def upstream(stall_after: int | None, id_: str, seeds: list[int],
                   tokens_per_second: float | None = None) -> tuple[web.AppRunner, str]:
    """A stand-in llama-server streaming PIECES; it stops sending after ``stall_after`` pieces. With
    ``tokens_per_second``, the last piece carries that speed as llama-server's ``timings``."""

    async def completions(request: web.Request) -> web.StreamResponse:
        seeds.append((await request.json())["seed"])
        events = [event(piece, id_) for piece in PIECES]
        if tokens_per_second is not None:
            events[-1] = events[-1].replace(b'}]}', b'}], "timings": {"predicted_per_second": %f}}' % tokens_per_second)
        return await stream_events(request, events, stall_after)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return await start_stand_in(app)


@pytest.fixture
async def proxy_port():
    stalls: list[str] = []
    proxy = ApiProxy(Metrics(lambda: ()), ProxyOptions(stall_timeout_s=0.5), ServingHooks(on_stall=stalls.append))
    port = free_tcp_port()
    await proxy.start(port)
    yield proxy, port, stalls
    await proxy.close()


async def test_a_stalled_stream_is_restarted_and_replayed_exactly(proxy_port):
    proxy, port, stalls = proxy_port
    seeds: list[int] = []
    stuck, stuck_url = await upstream(stall_after=3, id_="first", seeds=seeds)
    fresh, fresh_url = await upstream(stall_after=None, id_="second", seeds=seeds)
    proxy.serve(stuck_url)

    async def restart_when_asked() -> None:
        while not stalls:
            await asyncio.sleep(0.05)
        proxy.serve(fresh_url)  # what the serving loop does after restarting llama-server

    restarter = asyncio.create_task(restart_when_asked())
    text, ids = "", set()
    async with httpx.AsyncClient(timeout=30) as client, client.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                body = json.loads(line[6:])
                text += body["choices"][0]["text"]
                ids.add(body["id"])
    await restarter
    assert text == "".join(PIECES)
    assert ids == {"first"}
    assert len(stalls) == 1 and len(seeds) == 2 and seeds[0] == seeds[1]  # the same seed, pinned by the proxy
    assert proxy.metrics.registry.get_sample_value("mesh_retries_total") == 1
    await stuck.cleanup()
    await fresh.cleanup()


async def stream_text(port: int) -> str:
    text = ""
    async with httpx.AsyncClient(timeout=30) as client, client.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


async def test_a_stream_far_behind_its_pace_fails_over_once_a_worker_is_blamed():
    verdicts: list[Slow] = []
    blame = asyncio.Event()

    def on_slow(slow: Slow) -> bool:
        verdicts.append(slow)
        if len(verdicts) == 1:
            return False  # nobody held it up: the proxy goes on waiting
        blame.set()
        return True

    stalls: list[str] = []
    # The 60 s stall timer: only the pace judges this stream.
    proxy = ApiProxy(Metrics(lambda: ()), hooks=ServingHooks(on_stall=stalls.append, on_slow=on_slow))
    port = free_tcp_port()
    await proxy.start(port)
    seeds: list[int] = []
    fast, fast_url = await upstream(stall_after=None, id_="first", seeds=seeds, tokens_per_second=20.0)
    stuck, stuck_url = await upstream(stall_after=3, id_="second", seeds=seeds)
    fresh, fresh_url = await upstream(stall_after=None, id_="third", seeds=seeds)
    try:
        proxy.serve(fast_url)
        assert await stream_text(port) == "".join(PIECES)  # a token takes 50 ms, llama-server says
        proxy.serve(stuck_url)

        async def replan_when_blamed() -> None:
            await blame.wait()
            proxy.serve(fresh_url)  # what the serving loop does once it left the slow worker out

        replanner = asyncio.create_task(replan_when_blamed())
        assert await stream_text(port) == "".join(PIECES)
        await replanner
        assert len(verdicts) == 2 and stalls == []
        assert verdicts[0].tokens == 0 and verdicts[0].window_s == STALL_FLOOR_S
        assert proxy.metrics.registry.get_sample_value("mesh_retries_total") == 1
    finally:
        await proxy.close()
        for runner in (fast, stuck, fresh):
            await runner.cleanup()


async def test_refusing_answers_with_an_openai_error(proxy_port):
    proxy, port, _ = proxy_port
    proxy.refuse("The mesh has 0.10 GB free for this model but needs 0.30 GB (0.20 GB short).")
    async with httpx.AsyncClient() as client:
        response = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": []})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "insufficient_capacity"
        health = await client.get(f"http://127.0.0.1:{port}/health")
        assert health.status_code == 503


async def test_a_held_request_is_answered_when_the_proxy_starts_refusing(proxy_port):
    proxy, port, _ = proxy_port  # never served: requests are held
    async with httpx.AsyncClient(timeout=30) as client:
        held = asyncio.create_task(client.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}))
        await asyncio.sleep(0.3)
        assert not held.done()
        proxy.refuse("This node is shutting down.")
        response = await asyncio.wait_for(held, 5)
    assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]


@pytest.mark.parametrize("split", [True, False])
async def test_token_ids_are_asked_for_only_when_a_member_lost_could_fail_the_stream_over(split):
    """A model alone on its node: no logprobs (they cost llama-server time on every token); split: asked for
    (a continuation needs the ids) and stripped before the client."""
    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        return await stream_events(request, [event(piece, "one") for piece in PIECES], None)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner, url = await start_stand_in(app)
    proxy = ApiProxy(Metrics(lambda: ()), hooks=ServingHooks(split=lambda: split))
    port = free_tcp_port()
    await proxy.start(port)
    proxy.serve(url)
    try:
        assert await stream_text(port) == "".join(PIECES)
    finally:
        await proxy.close()
        await runner.cleanup()
    assert ("logprobs" in bodies[0]) is split
    assert "seed" in bodies[0]  # pinned either way: a replay gives the same text


# Each API's stream as llama-server sends it (tools/server/server-common.cpp's SSE formats), opening event first.
OPENING_STREAMS = {
    "/v1/chat/completions": [
        b'data: {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": '
        b'{"role": "assistant", "content": null}, "finish_reason": null}]}\n\n',
        b'data: {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": '
        b'{"content": "Hi"}, "finish_reason": null}]}\n\n',
        b'data: {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, '
        b'"finish_reason": "stop"}]}\n\n',
        b"data: [DONE]\n\n"],
    "/v1/messages": [
        b'event: message_start\ndata: {"type": "message_start", "message": {"id": "m1", "type": "message", '
        b'"role": "assistant", "content": []}}\n\n',
        b'event: content_block_start\ndata: {"type": "content_block_start", "index": 0, "content_block": '
        b'{"type": "text", "text": ""}}\n\n',
        b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, "delta": '
        b'{"type": "text_delta", "text": "Hi"}}\n\n',
        b'event: content_block_stop\ndata: {"type": "content_block_stop", "index": 0}\n\n',
        b'event: message_stop\ndata: {"type": "message_stop"}\n\n'],
    "/v1/responses": [
        b'event: response.created\ndata: {"type": "response.created", "response": {"id": "r1", '
        b'"object": "response", "status": "in_progress"}}\n\n',
        b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "Hi"}\n\n',
        b'event: response.completed\ndata: {"type": "response.completed", "response": {"id": "r1"}}\n\n'],
}


@pytest.mark.parametrize("path", sorted(OPENING_STREAMS))
async def test_a_stream_whose_connection_broke_before_its_first_event_opens_with_its_apis_first_event(path):
    """The connection to llama-server breaks after the answer's head, before any event (llama-server itself
    still answers /health): the request goes on on the same llama-server at once (no newer one comes: the hold
    would time out), and the client's stream is the whole answer, opening event first."""
    asked = []

    async def generate(request: web.Request) -> web.StreamResponse:
        asked.append(await request.json())
        if len(asked) == 1:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"")
            assert request.transport is not None
            request.transport.abort()  # the head went out, then the connection broke
            return response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event_ in OPENING_STREAMS[path]:
            await response.write(event_)
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post(path, generate)
    app.router.add_get("/health", health)
    stand_in, url = await start_stand_in(app)
    proxy = ApiProxy(Metrics(lambda: ()), ProxyOptions(hold_timeout_s=5.0))
    port = free_tcp_port()
    await proxy.start(port)
    proxy.serve(url)
    body = {"model": "m", "stream": True, "max_tokens": 4,
            **({"input": "x"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "x"}]})}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"http://127.0.0.1:{port}{path}", json=body)
    finally:
        await proxy.close()
        await stand_in.cleanup()
    assert response.status_code == 200
    assert response.content == b"".join(OPENING_STREAMS[path])
    assert len(asked) == 2 and proxy.metrics.registry.get_sample_value("mesh_retries_total") == 1
