"""A request forwarded to a member's API over the mesh: the wire format in memory, then both
ends over real QUIC on loopback (tests/helpers/tunnels.py) with an aiohttp stand-in as the
member's own API. Timeouts are hang checks, not timing assertions.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from mesh_sidecar.errors import (
    ConnectionClosedError,
    FrameTooLargeError,
    MalformedMessageError,
    ProtocolVersionError,
    WireError,
)
from mesh_sidecar.net.api_forward import (
    MESH_URL_PATTERN,
    ApiServer,
    MeshForwardTransport,
    mesh_node_id,
    mesh_url,
    serve_forwarded_request,
)
from mesh_sidecar.net.peer_streams import serve_peer_stream
from mesh_sidecar.net.streams import MeshStreamReader, MeshStreamWriter
from mesh_sidecar.serve.access import MAX_REQUEST_BODY_BYTES
from mesh_sidecar.wire.api_forward import (
    FORWARD_VERSION,
    FORWARDED_TOKEN_HEADER,
    MAX_FORWARD_HEAD_BYTES,
    MAX_FORWARDED_BODY_BYTES,
    MAX_FORWARDED_HEADERS,
    PREFIX,
    ForwardedRequest,
    ForwardedResponseHead,
    RequestDecoder,
    ResponseHeadDecoder,
    encode_request,
    encode_response_head,
)
from mesh_sidecar.wire.stream_kind import StreamKind
from tests.helpers.tunnels import HANG_S, Mesh, tunnel_mesh

REQUEST = ForwardedRequest("POST", "/v1/chat/completions?stream=1",
                           (("Content-Type", "application/json"), ("X-Two", "a"), ("X-Two", "b \t c"),
                            ("X-Latin", "caf\xe9")),
                           b'{"messages": []}')
HEAD = ForwardedResponseHead(200, (("Content-Type", "text/event-stream"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")))


def raw_head(fields: object, version: int = FORWARD_VERSION) -> bytes:
    """A head as a peer might send it, right or wrong."""
    head = json.dumps(fields).encode()
    return PREFIX.pack(version, len(head)) + head


def request_fields(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = {"method": "GET", "target": "/v1/models", "headers": [], "body_bytes": 0}
    fields.update(changes)
    return fields


# the wire format ---------------------------------------------------------------------------------------


def test_a_request_round_trips_whatever_the_split():
    encoded = encode_request(REQUEST)
    data = encoded + b"extra"
    for cut in range(len(data) + 1):
        decoder = RequestDecoder()
        first = decoder.feed(data[:cut])
        if cut < len(encoded):
            assert first is None
            assert decoder.feed(data[cut:]) == REQUEST
            assert decoder.leftover == b"extra"
        else:
            assert first == REQUEST
            assert decoder.leftover == data[len(encoded):cut]  # what came with the body's last byte


def test_a_request_fed_a_byte_at_a_time_is_complete_at_its_last_byte():
    data = encode_request(REQUEST)
    decoder = RequestDecoder()
    results = [decoder.feed(data[i:i + 1]) for i in range(len(data))]
    assert results[:-1] == [None] * (len(data) - 1) and results[-1] == REQUEST
    assert decoder.leftover == b""
    decoder.feed_eof()  # complete: the end of the stream is no error
    with pytest.raises(RuntimeError):
        decoder.feed(b"more")


def test_a_request_without_body_or_headers():
    empty = ForwardedRequest("GET", "/", (), b"")
    assert RequestDecoder().feed(encode_request(empty)) == empty


def test_an_answer_head_round_trips_with_the_body_that_came_with_it():
    data = encode_response_head(HEAD) + b"data: 1\n\n"
    head_bytes = len(data) - len(b"data: 1\n\n")
    for cut in range(len(data) + 1):
        decoder = ResponseHeadDecoder()
        first = decoder.feed(data[:cut])
        if cut < head_bytes:
            assert first is None
            assert decoder.feed(data[cut:]) == (HEAD, b"data: 1\n\n")
        else:
            assert first == (HEAD, data[head_bytes:cut])
            with pytest.raises(RuntimeError):
                decoder.feed(b"")


@pytest.mark.parametrize("cut", [0, 1, 4, 5, 20])
def test_a_stream_that_ends_early_says_where(cut):
    data = encode_request(REQUEST)
    decoder = RequestDecoder()
    assert decoder.feed(data[:cut]) is None
    with pytest.raises(MalformedMessageError, match=f"ended in its head, after {cut} bytes"):
        decoder.feed_eof()
    decoder = RequestDecoder()
    assert decoder.feed(data[:-1]) is None
    with pytest.raises(MalformedMessageError, match="ended in its body"):
        decoder.feed_eof()
    answer = ResponseHeadDecoder()
    assert answer.feed(encode_response_head(HEAD)[:cut]) is None
    with pytest.raises(MalformedMessageError, match="answer ended in its head"):
        answer.feed_eof()


def test_another_version_is_refused_at_its_first_byte():
    with pytest.raises(ProtocolVersionError, match="version 2; this node speaks 1"):
        RequestDecoder().feed(b"\x02")
    with pytest.raises(ProtocolVersionError, match="forwarded answer of version 0"):
        ResponseHeadDecoder().feed(b"\x00")


def test_an_oversized_head_is_refused_from_its_length_alone():
    with pytest.raises(FrameTooLargeError, match=f"over {MAX_FORWARD_HEAD_BYTES}"):
        RequestDecoder().feed(PREFIX.pack(FORWARD_VERSION, MAX_FORWARD_HEAD_BYTES + 1))
    with pytest.raises(FrameTooLargeError, match="head of"):
        ResponseHeadDecoder().feed(PREFIX.pack(FORWARD_VERSION, 2**32 - 1))
    big = ForwardedRequest("GET", "/", (("X-Big", "x" * MAX_FORWARD_HEAD_BYTES),), b"")
    with pytest.raises(FrameTooLargeError):
        encode_request(big)


def test_an_oversized_body_is_refused_from_its_length_alone():
    with pytest.raises(FrameTooLargeError, match=f"body of {MAX_FORWARDED_BODY_BYTES + 1} bytes"):
        RequestDecoder().feed(raw_head(request_fields(body_bytes=MAX_FORWARDED_BODY_BYTES + 1)))
    with pytest.raises(FrameTooLargeError):
        encode_request(ForwardedRequest("POST", "/", (), bytes(MAX_FORWARDED_BODY_BYTES + 1)))
    assert MAX_REQUEST_BODY_BYTES == MAX_FORWARDED_BODY_BYTES  # what the API port accepts can be forwarded


@pytest.mark.parametrize("fields, message", [
    ([1, 2], "not an object"),
    (request_fields(extra=1), r"unknown keys \['extra'\]"),
    ({"method": "GET", "target": "/", "headers": []}, r"lacks \['body_bytes'\]"),
    (request_fields(method=7), "must be strings"),
    (request_fields(method="GE T"), "not an HTTP token"),
    (request_fields(method=""), "not an HTTP token"),
    (request_fields(target="http://elsewhere/x"), "does not start with '/'"),
    (request_fields(target="/a b"), "visible ASCII"),
    (request_fields(target="/a\r\nX: y"), "visible ASCII"),
    (request_fields(target="/caf\xe9"), "visible ASCII"),
    (request_fields(body_bytes="3"), "body_bytes is not an integer"),
    (request_fields(body_bytes=True), "body_bytes is not an integer"),
    (request_fields(body_bytes=-1), "negative"),
    (request_fields(headers={"a": "b"}), "headers are not a list"),
    (request_fields(headers=[["a"]]), r"not \[name, value\]"),
    (request_fields(headers=[["a", 1]]), r"not \[name, value\]"),
    (request_fields(headers=[["a b", "1"]]), "header name 'a b' is not an HTTP token"),
    (request_fields(headers=[["X-A:", "1"]]), "is not an HTTP token"),
    (request_fields(headers=[["X-A", "1\r\nX-B: 2"]]), "'X-A' has a value HTTP does not carry"),
    (request_fields(headers=[["X-A", "1\n"]]), "CR, LF"),
    (request_fields(headers=[["X-A", "\x00"]]), "control character"),
    (request_fields(headers=[["X-A", " padded"]]), "space at an end"),
    (request_fields(headers=[["X-A", "\u20ac"]]), r"over \\xff"),
    (request_fields(headers=[["X-A", "1"]] * (MAX_FORWARDED_HEADERS + 1)), f"65 headers, over {MAX_FORWARDED_HEADERS}"),
])
def test_a_malformed_request_head_names_what_is_wrong(fields, message):
    with pytest.raises(MalformedMessageError, match=message):
        RequestDecoder().feed(raw_head(fields))


def test_a_head_that_is_not_json_or_repeats_a_key_is_malformed():
    for head, message in [(b"\xff\xfe", "not UTF-8"), (b"{", "not a JSON object"), (b"[" * 60_000, "nests too deep"),
                          (b'{"method": "GET", "method": "PUT"}', "a key given twice")]:
        with pytest.raises(MalformedMessageError, match=message):
            RequestDecoder().feed(PREFIX.pack(FORWARD_VERSION, len(head)) + head)


@pytest.mark.parametrize("fields, message", [
    ({"status": 200}, r"lacks \['headers'\]"),
    ({"status": "200", "headers": []}, "status is not an integer"),
    ({"status": 99, "headers": []}, "status 99 is not within 100-599"),
    ({"status": 600, "headers": []}, "not within"),
    ({"status": 200, "headers": [["Bad Name", "x"]]}, "not an HTTP token"),
])
def test_a_malformed_answer_head_names_what_is_wrong(fields, message):
    with pytest.raises(MalformedMessageError, match=message):
        ResponseHeadDecoder().feed(raw_head(fields))


@given(st.binary(max_size=300), st.integers(0, 300))
def test_any_bytes_decode_or_give_a_wire_error(data, cut):
    for decoder in (RequestDecoder(), ResponseHeadDecoder()):
        try:
            decoder.feed(data[:cut])
            decoder.feed(data[cut:])
        except WireError:
            pass


KEYS = st.sampled_from(["method", "target", "headers", "body_bytes", "status"])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=5),
                    max_leaves=12)


@given(st.dictionaries(KEYS, JSON, max_size=5) | JSON, KEYS, JSON)
def test_any_json_as_a_head_decodes_or_gives_a_wire_error(anything, key, value):
    # Any JSON at all, and each good head with one field replaced by any JSON.
    heads = [anything, request_fields(**{key: value}), {"status": 200, "headers": [], key: value}]
    for fields in heads:
        head = json.dumps(fields).encode()
        for decoder in (RequestDecoder(), ResponseHeadDecoder()):
            try:
                decoder.feed(PREFIX.pack(FORWARD_VERSION, len(head)) + head)
            except WireError:
                pass


def test_the_encoders_refuse_what_the_decoders_would():
    with pytest.raises(MalformedMessageError, match="target"):
        encode_request(ForwardedRequest("GET", "v1/models", (), b""))
    with pytest.raises(MalformedMessageError, match="control character"):
        encode_request(ForwardedRequest("GET", "/", (("X-A", "1\r\n"),), b""))
    with pytest.raises(MalformedMessageError, match="status"):
        encode_response_head(ForwardedResponseHead(1000, ()))
    with pytest.raises(MalformedMessageError, match="65 headers"):
        encode_response_head(ForwardedResponseHead(200, (("X-A", "1"),) * 65))


def test_mesh_urls_name_a_node_id():
    node_id = bytes(range(32))
    url = mesh_url(node_id)
    assert url == "http://" + node_id.hex() + ".mesh"
    assert mesh_node_id(httpx.URL(url + "/v1/models").host) == node_id
    assert mesh_node_id(node_id.hex().upper() + ".MESH") == node_id
    for host in ["127.0.0.1", node_id.hex() + ".mesh.example", node_id.hex()[:-2] + ".mesh", "x.mesh"]:
        assert mesh_node_id(host) is None
    with pytest.raises(ValueError, match="32 bytes"):
        mesh_url(b"short")


# the transport, without a member ---------------------------------------------------------------------


@pytest.mark.parametrize("failure", [ConnectionResetError("gone"), ConnectionClosedError("not connected")])
async def test_no_stream_to_the_member_is_a_connect_error(failure):
    async def open_stream(node_id: bytes) -> tuple[MeshStreamReader, MeshStreamWriter]:
        raise failure

    async with httpx.AsyncClient(transport=MeshForwardTransport(open_stream)) as client:
        with pytest.raises(httpx.ConnectError, match=f"no stream to node_00010203: {failure}"):
            await client.get(mesh_url(bytes(range(32))) + "/v1/models")


async def test_no_stream_within_the_connect_timeout_is_a_connect_timeout():
    async def open_stream(node_id: bytes) -> tuple[MeshStreamReader, MeshStreamWriter]:
        await asyncio.sleep(HANG_S)
        raise AssertionError("the connect timeout should have passed")

    async with httpx.AsyncClient(transport=MeshForwardTransport(open_stream)) as client:
        with pytest.raises(httpx.ConnectTimeout, match="no stream to node_00010203 in time"):
            await client.get(mesh_url(bytes(range(32))) + "/v1/models", timeout=httpx.Timeout(HANG_S, connect=0.1))


async def test_a_url_that_is_not_a_mesh_url_is_refused():
    async def open_stream(node_id: bytes) -> tuple[MeshStreamReader, MeshStreamWriter]:
        raise AssertionError("no stream for a URL that names no member")

    async with httpx.AsyncClient(transport=MeshForwardTransport(open_stream)) as client:
        with pytest.raises(httpx.UnsupportedProtocol, match="not a mesh URL"):
            await client.get("http://127.0.0.1:1/v1/models")


# both ends over QUIC ---------------------------------------------------------------------------------

TOKEN = "forwarded-token-of-this-mesh"


@dataclass
class StandIn:
    """The member's own API: what it saw, and events a test steps its answers with."""

    server: ApiServer | None = None  # its server, as serve_forwarded_request reaches it
    seen: list[dict[str, object]] = field(default_factory=list)
    steps: list[asyncio.Event] = field(default_factory=lambda: [asyncio.Event() for _ in range(3)])
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # /late has its request

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        seen = {"method": request.method, "target": request.path_qs, "body": body.decode(),
                "token": request.headers.getall(FORWARDED_TOKEN_HEADER, []),
                "x_two": request.headers.getall("X-Two", [])}
        self.seen.append(seen)
        return web.json_response(seen, headers={"X-Answer": "yes"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, each after the test sets its step; cancelled when the client goes."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i, step in enumerate(self.steps):
                await response.write(f"data: {i}\n\n".encode())
                await step.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        await response.write(b"data: [DONE]\n\n")
        return response

    async def late(self, request: web.Request) -> web.Response:
        """An answer only once the test sets the first step; cancelled when the client goes."""
        self.arrived.set()
        try:
            await self.steps[0].wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return web.Response(text="late")

    async def big(self, request: web.Request) -> web.Response:
        body = await request.read()
        return web.Response(body=body * 4)

    async def cut(self, request: web.Request) -> web.StreamResponse:
        """A first event, then (once the test has it) the connection dropped mid-answer."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 0\n\n")
        await self.steps[0].wait()
        assert request.transport is not None
        request.transport.abort()
        return response


@asynccontextmanager
async def stand_in() -> AsyncIterator[StandIn]:
    api = StandIn()
    app = web.Application(client_max_size=4 * MAX_FORWARDED_BODY_BYTES)
    app.router.add_route("*", "/echo", api.echo)
    app.router.add_get("/stream", api.stream)
    app.router.add_post("/big", api.big)
    app.router.add_get("/late", api.late)
    app.router.add_get("/cut", api.cut)
    # Cancelled when its client goes away, as llama-server stops generating when its connection closes.
    runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
    await runner.setup()
    api.server = runner.server
    try:
        yield api
    finally:
        await runner.cleanup()


@dataclass
class Forwarding:
    mesh: Mesh
    api: StandIn
    client: httpx.AsyncClient
    local_api: Callable[[], ApiServer | None]

    async def open_raw(self) -> tuple[MeshStreamReader, MeshStreamWriter]:
        """A stream from A to B with its kind byte written, for bytes no transport would send."""
        reader, writer = await self.mesh.a_to_b.open_stream()
        writer.write(bytes((StreamKind.API_FORWARD,)))
        return reader, writer


@pytest.fixture
async def fwd() -> AsyncIterator[Forwarding]:
    """A's client reaches B's stand-in API through B's serve_forwarded_request."""
    async with tunnel_mesh() as m, stand_in() as api:
        holder = Forwarding(m, api, httpx.AsyncClient(), lambda: api.server)
        servers = {StreamKind.API_FORWARD: lambda r, w: serve_forwarded_request(r, w, lambda: holder.local_api(),
                                                                                  TOKEN, "A")}
        m.b_from_a.set_stream_handler(lambda r, w: serve_peer_stream(r, w, servers, "A"))

        async def open_stream(node_id: bytes) -> tuple[MeshStreamReader, MeshStreamWriter]:
            assert node_id == m.b.identity.node_id
            return await m.a_to_b.open_stream()

        transport = MeshForwardTransport(open_stream)
        async with httpx.AsyncClient(mounts={MESH_URL_PATTERN: transport}, base_url=mesh_url(m.b.identity.node_id),
                                     timeout=httpx.Timeout(HANG_S)) as client:
            holder.client = client
            yield holder


async def streams_finish(m: Mesh) -> None:
    """Both ends forget every stream (each finished both ways)."""
    async def finished() -> None:
        while m.a_to_b.open_streams or m.b_from_a.open_streams:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(finished(), HANG_S)


async def test_a_request_reaches_the_members_api_with_the_token(fwd):
    response = await fwd.client.post("/echo?n=1", content=b"hello", headers=[("X-Two", "a"), ("X-Two", "b")])
    assert response.status_code == 200 and response.headers["X-Answer"] == "yes"
    assert response.json() == {"method": "POST", "target": "/echo?n=1", "body": "hello", "token": [TOKEN],
                               "x_two": ["a", "b"]}
    await streams_finish(fwd.mesh)


async def test_a_token_the_peer_sent_is_replaced(fwd):
    response = await fwd.client.get("/echo", headers={FORWARDED_TOKEN_HEADER: "forged",
                                                      FORWARDED_TOKEN_HEADER.lower(): "forged too"})
    assert response.json()["token"] == [TOKEN]


async def test_a_large_body_each_way(fwd):
    body = bytes(range(256)) * (4096 * 4)  # 4 MiB up, 16 MiB back: many times the water marks
    response = await fwd.client.post("/big", content=body)
    assert response.status_code == 200 and response.content == body * 4
    await streams_finish(fwd.mesh)


async def test_an_answer_streams_as_it_is_produced(fwd):
    async with fwd.client.stream("GET", "/stream") as response:
        assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
        chunks = response.aiter_raw()
        for i, step in enumerate(fwd.api.steps):
            # Event i arrives while the stand-in still waits to send the next: nothing is held back.
            assert await asyncio.wait_for(anext(chunks), HANG_S) == f"data: {i}\n\n".encode()
            step.set()
        assert await asyncio.wait_for(anext(chunks), HANG_S) == b"data: [DONE]\n\n"
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(chunks), HANG_S)
    assert not fwd.api.cancelled.is_set()
    await streams_finish(fwd.mesh)


async def test_a_client_that_goes_away_cancels_the_request_at_the_member(fwd, caplog):
    caplog.set_level(logging.INFO, "mesh_sidecar.net.api_forward")
    async with fwd.client.stream("GET", "/stream") as response:
        assert await asyncio.wait_for(anext(response.aiter_raw()), HANG_S) == b"data: 0\n\n"
    await asyncio.wait_for(fwd.api.cancelled.wait(), 2.0)
    await streams_finish(fwd.mesh)
    assert "from A: the requester went away; cancelled" in caplog.text


async def test_a_request_cancelled_before_its_answer_began_is_cancelled_at_the_member(fwd):
    request = asyncio.create_task(fwd.client.get("/late"))
    await asyncio.wait_for(fwd.api.arrived.wait(), HANG_S)
    request.cancel()
    await asyncio.wait_for(fwd.api.cancelled.wait(), 2.0)
    await streams_finish(fwd.mesh)


async def test_a_requester_that_ends_its_side_early_cancels_too(fwd):
    reader, writer = await fwd.open_raw()
    writer.write(encode_request(ForwardedRequest("GET", "/stream", (), b"")))
    head, first = await read_answer_head(reader)
    assert head.status == 200
    writer.write_eof()  # the protocol's "I went away"
    await asyncio.wait_for(fwd.api.cancelled.wait(), 2.0)
    # The answer ends in a reset, never a FIN that would make it look whole.
    with pytest.raises(ConnectionResetError):
        while await asyncio.wait_for(reader.read(1024), HANG_S):
            pass
    await streams_finish(fwd.mesh)


async def test_an_answer_cut_at_the_member_is_a_read_error(fwd):
    async with fwd.client.stream("GET", "/cut") as response:
        assert response.status_code == 200
        chunks = response.aiter_raw()
        assert await asyncio.wait_for(anext(chunks), HANG_S) == b"data: 0\n\n"
        fwd.api.steps[0].set()
        with pytest.raises(httpx.ReadError, match="answer broke off"):
            async for _ in chunks:
                pass
    await streams_finish(fwd.mesh)


async def test_no_api_at_the_member_is_503_model_unavailable(fwd):
    fwd.local_api = lambda: None  # this member serves no API at all
    response = await fwd.client.get("/echo")
    assert (response.status_code, response.json()["error"]["code"]) == (503, "model_unavailable")
    assert "serves no API" in response.json()["error"]["message"]
    assert not fwd.api.seen
    await streams_finish(fwd.mesh)


async def read_answer_head(reader: MeshStreamReader) -> tuple[ForwardedResponseHead, bytes]:
    decoder = ResponseHeadDecoder()
    while (result := decoder.feed(await asyncio.wait_for(reader.read(1024), HANG_S))) is None:
        pass
    return result


async def read_to_fin(reader: MeshStreamReader, first: bytes) -> bytes:
    body = bytearray(first)
    while data := await asyncio.wait_for(reader.read(1024), HANG_S):
        body += data
    return bytes(body)


@pytest.mark.parametrize("garbage, message", [
    (b"GET / HTTP/1.1\r\n\r\n", "version 71"),
    (PREFIX.pack(FORWARD_VERSION, MAX_FORWARD_HEAD_BYTES + 1), "head of 65537 bytes"),
    (raw_head(request_fields(target="http://elsewhere/")), "does not start with '/'"),
    (raw_head(request_fields(body_bytes=10)) + b"short", "ended in its body"),
])
async def test_garbage_on_the_stream_is_400_bad_forward(fwd, caplog, garbage, message):
    reader, writer = await fwd.open_raw()
    writer.write(garbage)
    if b"short" in garbage:
        writer.write_eof()
    head, first = await read_answer_head(reader)
    assert head.status == 400
    error = json.loads(await read_to_fin(reader, first))["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "bad_forward")
    assert message in error["message"]
    assert "forwarded request from A refused: " in caplog.text and message in caplog.text
    assert not fwd.api.seen
    writer.close()
    await streams_finish(fwd.mesh)


async def test_a_stream_that_ends_before_the_head_is_a_transport_error(fwd):
    async def answer_nothing(reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        await reader.read(1)
        writer.write_eof()

    async def reset(reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        await reader.read(1)
        writer.abort()

    async def nonsense(reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        await reader.read(1)
        writer.write(b"\x09nonsense")

    for server, error, message in [(answer_nothing, httpx.RemoteProtocolError, "ended in its head, after 0 bytes"),
                                   (reset, httpx.ReadError, "broke before its answer"),
                                   (nonsense, httpx.RemoteProtocolError, "version 9")]:
        fwd.mesh.b_from_a.set_stream_handler(server)
        with pytest.raises(error, match=message):
            await fwd.client.get("/echo")
    await streams_finish(fwd.mesh)


async def test_no_head_within_the_read_timeout_is_a_read_timeout(fwd):
    async def silent(reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        await asyncio.sleep(HANG_S)

    fwd.mesh.b_from_a.set_stream_handler(silent)
    with pytest.raises(httpx.ReadTimeout, match=r"sent nothing for 0\.2 s"):
        await fwd.client.get("/echo", timeout=httpx.Timeout(HANG_S, read=0.2))
