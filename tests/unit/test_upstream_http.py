"""serve/upstream_http.py's client to this node's llama-server, against a real HTTP server on loopback:
one error, UpstreamLostError, for no answer and for an answer that broke off; tokens that come faster
than the flush interval are read together, slower ones as they come; a pooled connection the server
closed is sent again on a fresh one, once."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from mesh_sidecar.errors import UpstreamLostError
from mesh_sidecar.ports import LOOPBACK, free_tcp_port
from mesh_sidecar.serve import upstream_http
from mesh_sidecar.serve.upstream_http import LlamaServerHttp, closed_before_answer, post_json

KEY = "llama-server-key"
# Longer than the product's, so that a loaded machine's scheduling delays stay well inside it.
FLUSH_INTERVAL_S = 0.1
FAST_EVENTS = 20
FAST_GAP_S = FLUSH_INTERVAL_S / 4  # four events come in each flush interval
FIRST_ALONE_S = 3 * FLUSH_INTERVAL_S
ROLE_GAP_S = 0.001
SLOW_EVENTS = 8
SLOW_GAP_S = FLUSH_INTERVAL_S * 0.8  # a hold would gather one event, sometimes two


async def _stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b"data: 0\n\n")
    if request.query.get("cut") == "late":  # a second read first: the next one would be held
        await asyncio.sleep(FAST_GAP_S)
        await response.write(b"data: 1\n\n")
    if request.query.get("cut"):
        assert request.transport is not None
        request.transport.abort()
        return response
    await response.write(b"data: [DONE]\n\n")
    return response


async def _fast(request: web.Request) -> web.StreamResponse:
    """A role event, the first token soon after it, a pause, then FAST_EVENTS events FAST_GAP_S apart, each
    its own write."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b"data: role\n\n")
    await asyncio.sleep(ROLE_GAP_S)
    await response.write(b"data: first\n\n")
    await asyncio.sleep(FIRST_ALONE_S)
    for n in range(FAST_EVENTS):
        await response.write(f"data: {n}\n\n".encode())
        await asyncio.sleep(FAST_GAP_S)
    return response


async def _slow(request: web.Request) -> web.StreamResponse:
    """SLOW_EVENTS events SLOW_GAP_S apart, each carrying the loop time it was sent at."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(SLOW_EVENTS):
        await response.write(f"data: {asyncio.get_running_loop().time()}\n\n".encode())
        await asyncio.sleep(SLOW_GAP_S)
    return response


async def _echo(request: web.Request) -> web.Response:
    return web.json_response({"auth": request.headers.get("Authorization"), "body": await request.json()},
                             status=int(request.query.get("status", "200")))


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/stream", _stream)
    app.router.add_get("/fast", _fast)
    app.router.add_get("/slow", _slow)
    app.router.add_post("/echo", _echo)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = free_tcp_port()
    await web.TCPSite(runner, LOOPBACK, port).start()
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        await runner.cleanup()


async def test_a_stream_comes_in_chunks_with_its_head(server) -> None:
    client = LlamaServerHttp()
    try:
        answer = await client.send("GET", server + "/stream", {}, b"")
        assert answer.status_code == 200
        assert ("Content-Type", "text/event-stream") in answer.header_items()
        assert b"".join([chunk async for chunk in answer.aiter_raw()]) == b"data: 0\n\ndata: [DONE]\n\n"
        await answer.aclose()
    finally:
        await client.aclose()


async def test_tokens_faster_than_the_flush_interval_are_read_together(server, monkeypatch) -> None:
    """The role event and the first token are read as they come, however soon one follows the other; the
    fast events after them in a few reads, not one each; no byte is lost or reordered."""
    monkeypatch.setattr(upstream_http, "STREAM_FLUSH_INTERVAL_S", FLUSH_INTERVAL_S)
    client = LlamaServerHttp()
    try:
        answer = await client.send("GET", server + "/fast", {}, b"")
        chunks = []
        async for chunk in answer.aiter_raw():
            chunks.append((chunk, asyncio.get_running_loop().time()))
        await answer.aclose()
    finally:
        await client.aclose()
    assert [chunk for chunk, _ in chunks[:2]] == [b"data: role\n\n", b"data: first\n\n"]
    assert chunks[1][1] - chunks[0][1] < FLUSH_INTERVAL_S / 2  # the first token was not held
    fast = [chunk for chunk, _ in chunks[2:]]
    assert b"".join(fast) == b"".join(f"data: {n}\n\n".encode() for n in range(FAST_EVENTS))
    # Read as they come, the fast events would take FAST_EVENTS reads; held, about a quarter of that.
    assert len(fast) <= FAST_EVENTS // 2, [len(c) for c in fast]


async def test_tokens_slower_than_a_hold_pays_for_are_read_as_they_come(server, monkeypatch) -> None:
    """Events too far apart for a hold to gather two are not held: each is read when it comes, not up to a
    flush interval later."""
    monkeypatch.setattr(upstream_http, "STREAM_FLUSH_INTERVAL_S", FLUSH_INTERVAL_S)
    client = LlamaServerHttp()
    late_s = []
    try:
        answer = await client.send("GET", server + "/slow", {}, b"")
        async for chunk in answer.aiter_raw():
            now = asyncio.get_running_loop().time()
            late_s += [now - float(event[len(b"data: "):]) for event in chunk.split(b"\n\n") if event]
        await answer.aclose()
    finally:
        await client.aclose()
    assert len(late_s) == SLOW_EVENTS
    assert max(late_s) < FLUSH_INTERVAL_S / 2, late_s


async def test_an_answer_cut_off_is_upstream_lost(server) -> None:
    client = LlamaServerHttp()
    try:
        answer = await client.send("GET", server + "/stream?cut=1", {}, b"")
        with pytest.raises(UpstreamLostError, match="broke off"):
            async for _ in answer.aiter_raw():
                pass
        await answer.aclose()
    finally:
        await client.aclose()


async def test_an_answer_cut_off_while_reads_are_held_is_upstream_lost(server) -> None:
    """The connection is lost between two reads close together: the held read says so as UpstreamLostError
    (the proxy's failover cue), whatever state the closed connection is in."""
    client = LlamaServerHttp()
    try:
        answer = await client.send("GET", server + "/stream?cut=late", {}, b"")
        with pytest.raises(UpstreamLostError, match="broke off"):
            async for _ in answer.aiter_raw():
                await asyncio.sleep(ROLE_GAP_S * 5)  # the relay's work on a chunk, while the cut arrives
        await answer.aclose()
    finally:
        await client.aclose()


async def test_nobody_listening_is_upstream_lost() -> None:
    client = LlamaServerHttp()
    try:
        with pytest.raises(UpstreamLostError, match="did not answer"):
            await client.send("GET", f"http://{LOOPBACK}:{free_tcp_port()}/health", {}, b"")
    finally:
        await client.aclose()


async def test_the_key_goes_with_every_request_and_json_posts_check_the_status(server) -> None:
    client = LlamaServerHttp()
    client.authorize(KEY)
    try:
        assert await post_json(client, server + "/echo", {"a": 1}) == {"auth": f"Bearer {KEY}", "body": {"a": 1}}
        with pytest.raises(UpstreamLostError, match="answered 500"):
            await post_json(client, server + "/echo?status=500", {"a": 1})
        status, body = await client.get(server + "/stream", timeout_s=5.0)
        assert (status, body) == (200, b"data: 0\n\ndata: [DONE]\n\n")
    finally:
        await client.aclose()


async def test_a_get_that_takes_too_long_is_upstream_lost(server) -> None:
    client = LlamaServerHttp()
    try:
        with pytest.raises(UpstreamLostError, match="within"):
            await client.get(server + "/stream", timeout_s=0.0)
    finally:
        await client.aclose()


class KeepAliveCloser:
    """A real HTTP/1.1 server that closes kept-alive connections as cpp-httplib (llama-server's) does when its
    keep-alive timeout ends as a request arrives: the connection's first request is answered and kept alive; a
    request after it on that connection is read and the connection closed with no byte of an answer
    (``closes_first``: every request, the first too)."""

    def __init__(self, *, closes_first: bool = False) -> None:
        self.connections = 0
        self.answered = 0
        self._closes_first = closes_first

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if served or self._closes_first:
                    return  # closed under the request: "Server disconnected" at the client
                served += 1
                self.answered += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n"
                             b"Connection: keep-alive\r\n\r\n{\"ok\": true}")
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


@pytest.fixture
async def keep_alive_closer() -> AsyncIterator[tuple[KeepAliveCloser, str]]:
    closer = KeepAliveCloser()
    server = await asyncio.start_server(closer.handle, LOOPBACK, 0)
    try:
        yield closer, f"http://{LOOPBACK}:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_a_pooled_connection_the_server_closed_is_sent_again_on_a_fresh_one(keep_alive_closer) -> None:
    closer, url = keep_alive_closer
    client = LlamaServerHttp()
    try:
        for _ in range(2):  # the 2nd meets the pooled connection, which the server closes under it
            assert await post_json(client, url + "/v1/chat/completions", {"a": 1}) == {"ok": True}
    finally:
        await client.aclose()
    assert (closer.answered, closer.connections) == (2, 2)  # the retry on a connection of its own


async def test_a_server_that_closes_under_every_request_costs_one_retry_not_more() -> None:
    closer = KeepAliveCloser(closes_first=True)
    server = await asyncio.start_server(closer.handle, LOOPBACK, 0)
    client = LlamaServerHttp()
    try:
        with pytest.raises(UpstreamLostError, match="Server disconnected"):
            await post_json(client, f"http://{LOOPBACK}:{server.sockets[0].getsockname()[1]}/x", {})
    finally:
        await client.aclose()
        server.close()
    assert (closer.answered, closer.connections) == (0, 2)


@pytest.mark.parametrize(("exc", "retried"), [
    (aiohttp.ServerDisconnectedError(), True),
    (aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"), True),
    (aiohttp.ClientOSError(errno.EPIPE, "Broken pipe"), True),
    (aiohttp.ClientConnectorError(aiohttp.client_reqrep.ConnectionKey(LOOPBACK, 1, False, True, None, None, None),
                                  ConnectionRefusedError(errno.ECONNREFUSED, "refused")), False),
    (aiohttp.ClientOSError(errno.ETIMEDOUT, "timed out"), False),
    (TimeoutError(), False),
    (aiohttp.ClientPayloadError("broke off"), False),
])
def test_only_a_connection_closed_before_the_answer_is_retried(exc: BaseException, retried: bool) -> None:
    assert closed_before_answer(exc) is retried
