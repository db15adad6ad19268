"""HTTP requests to another member's API over the mesh: both ends of an API_FORWARD stream.

    node A                                                    node B (serves the model)
    httpx.AsyncClient(MeshForwardTransport)  ── QUIC stream ──▶ serve_forwarded_request
      GET/POST http://<B's node id>.mesh/v1/...   request         │ + Mesh-Forwarded: <token>
                                                                   ▼
      httpx.Response, its body streamed       ◀── answer ──── B's own API server, in memory

The stream carries wire/api_forward.py's format. A's side keeps its half open until
it has the whole answer; closing the response before then resets the stream, B's side
sees the reset (or a FIN), tells its API server the connection is lost, and the
generation there is cancelled. Nothing is buffered but QUIC's window and the
stream's water marks (streams.py): each chunk is passed on as the API server writes it.

B's API server (aiohttp's, the one on its API port) answers without a socket: it gets a
connection whose transport is the stream (``_ApiConnection``), is handed the request as
HTTP/1.0 bytes (wire/http1.py) and writes its answer into the stream. A loopback
connection would cost each token a socket write and an HTTP client's read, CPU that the
serving node takes from llama-server.

Failures reach A's caller as httpx.TransportError subclasses (the proxy's client,
serve/upstream_http.py, turns them into the UpstreamLostError its failover waits for):
    no stream to the member (not connected, a mesh error)     httpx.ConnectError
    the stream ends, resets or sends nonsense before the head httpx.RemoteProtocolError / ReadError
    the body breaks off (B reset the stream)                  httpx.ReadError
    httpx's connect or read timeout passes                    httpx.ConnectTimeout / ReadTimeout
To route only mesh URLs through it: ``httpx.AsyncClient(mounts={MESH_URL_PATTERN: transport})``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx

from ..errors import MeshError, WireError
from ..identity import NODE_ID_BYTES, short_id
from ..units import KIB
from ..wire.api_forward import (
    FORWARDED_TOKEN_HEADER,
    HOP_BY_HOP_HEADERS,
    ForwardedRequest,
    ForwardedResponseHead,
    Headers,
    RequestDecoder,
    ResponseHeadDecoder,
    encode_request,
    encode_response_head,
    openai_error_body,
)
from ..wire.http1 import ResponseHeadReader, http1_request
from ..wire.stream_kind import StreamKind
from .streams import SEND_HIGH_WATER_BYTES, MeshStreamReader, MeshStreamWriter

log = logging.getLogger(__name__)

READ_BYTES = 64 * KIB
MESH_HOST_SUFFIX = ".mesh"
MESH_URL_PATTERN = "http://*" + MESH_HOST_SUFFIX  # an httpx mount pattern matching every mesh URL
_MESH_HOST_RE = re.compile(f"([0-9a-f]{{{2 * NODE_ID_BYTES}}}){re.escape(MESH_HOST_SUFFIX)}")
BAD_FORWARD_CODE = "bad_forward"
MODEL_UNAVAILABLE_CODE = "model_unavailable"

# A new stream to a member, by its node id (not yet carrying anything).
OpenStream = Callable[[bytes], Awaitable[tuple[MeshStreamReader, MeshStreamWriter]]]
# This node's API server as loop.create_server takes it (aiohttp's web.Server): a new connection's protocol.
ApiServer = Callable[[], asyncio.Protocol]


def mesh_url(node_id: bytes) -> str:
    """The base URL that reaches ``node_id``'s API through :class:`MeshForwardTransport`."""
    if len(node_id) != NODE_ID_BYTES:
        raise ValueError(f"a node id is {NODE_ID_BYTES} bytes, not {len(node_id)}")
    return f"http://{node_id.hex()}{MESH_HOST_SUFFIX}"


def mesh_node_id(host: str) -> bytes | None:
    """The node id a mesh URL's host names (``<64 hex digits>.mesh``), or None for any other host."""
    match = _MESH_HOST_RE.fullmatch(host.lower())
    return bytes.fromhex(match.group(1)) if match else None


# B's side: the member whose API answers --------------------------------------------------------


async def serve_forwarded_request(reader: MeshStreamReader, writer: MeshStreamWriter,
                                  local_api: Callable[[], ApiServer | None], token: str, peer_name: str) -> None:
    """Answer one API_FORWARD stream (kind byte read) from ``peer_name`` with this node's own API.

    ``local_api()`` is the API's server, or None where this node has none (503
    ``model_unavailable``). The request reaches it with ``FORWARDED_TOKEN_HEADER: token``; its
    answer goes back as it is produced. Returns when the answer is sent, the requester went
    away (its FIN or reset: the server's connection is lost, which cancels the request), or the
    stream failed; never raises for any of those.
    """
    try:
        request = await _read_request(reader)
    except WireError as exc:
        log.warning("forwarded request from %s refused: %s", peer_name, exc)
        _answer_error(writer, 400, f"The forwarded request could not be read: {exc}", "invalid_request_error",
                      BAD_FORWARD_CODE)
        return
    except ConnectionError as exc:
        log.info("forwarded request from %s: the stream broke before the request was in (%s)", peer_name, exc)
        writer.abort()
        return
    server = local_api()
    if server is None:
        _answer_error(writer, 503, "This member serves no API now; ask another.", "unavailable",
                      MODEL_UNAVAILABLE_CODE)
        return
    passed_on = replace(request, headers=tuple((n, v) for n, v in request.headers if _passed_on(n)))
    connection = _ApiConnection(writer, peer_name)
    try:
        connection.open(server(), http1_request(passed_on, ((FORWARDED_TOKEN_HEADER, token),)))
        async with asyncio.TaskGroup() as group:
            answered = group.create_task(connection.wait_closed())
            watch = group.create_task(_until_requester_leaves(reader))
            # Whichever ends first ends the other: the answer is sent, or nobody waits for it.
            answered.add_done_callback(lambda _: watch.cancel())
            watch.add_done_callback(lambda _: answered.cancel())
        if answered.cancelled():
            log.info("forwarded %s %s from %s: the requester went away; cancelled", request.method,
                     request.target, peer_name)
    finally:
        connection.lose()
        if not writer.is_closing():
            writer.abort()  # an answer cut off (cancelled, or this node stopping) is a reset, never a FIN


async def _read_request(reader: MeshStreamReader) -> ForwardedRequest:
    decoder = RequestDecoder()
    while True:
        data = await reader.read(READ_BYTES)
        if not data:
            decoder.feed_eof()  # raises: a stream that ends early carries no request
        if (request := decoder.feed(data)) is not None:
            return request  # bytes after it (decoder.leftover) mean nothing in version 1


async def _until_requester_leaves(reader: MeshStreamReader) -> None:
    """Return when the requester closes or resets its side: it no longer wants the answer."""
    try:
        while await reader.read(READ_BYTES):
            pass  # bytes after the request mean nothing in version 1
    except ConnectionError:
        pass


class _ApiConnection(asyncio.Transport):
    """One connection of this node's API server whose far end is an API_FORWARD stream.

    The server writes an HTTP/1.0 answer: its head goes on as the stream's answer head, the
    rest as the body, and the server's close (the end of an HTTP/1.0 answer) is the stream's
    FIN. Past the stream's high water mark the server is paused, as a socket's would be.
    """

    def __init__(self, writer: MeshStreamWriter, peer_name: str) -> None:
        super().__init__()
        self._writer = writer
        self._peer_name = peer_name
        self._head = ResponseHeadReader()
        self._head_sent = False
        self._protocol: asyncio.Protocol | None = None
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lost = False
        self._drain: asyncio.Task[None] | None = None

    def open(self, protocol: asyncio.BaseProtocol, request: bytes) -> None:
        assert isinstance(protocol, asyncio.Protocol)
        self._protocol = protocol
        protocol.connection_made(self)
        protocol.data_received(request)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def lose(self) -> None:
        """The server hears that the connection is gone (once): what it still writes goes nowhere."""
        if self._lost:
            return
        self._lost = True
        self._end()
        if self._drain is not None:
            self._drain.cancel()
        if self._protocol is not None:
            self._protocol.connection_lost(None)

    # asyncio.Transport, as the server uses it

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed.done():
            return
        chunk = bytes(data)
        try:
            if not self._head_sent:
                got = self._head.feed(chunk)
                if got is None:
                    return
                head, chunk = got
                self._writer.write(encode_response_head(head))
                self._head_sent = True
            self._writer.write(chunk)
        except WireError as exc:
            log.warning("this node's API answered %s what cannot be forwarded: %s", self._peer_name, exc)
            if not self._head_sent:
                _answer_error(self._writer, 502, f"This member's API answered what cannot be forwarded: {exc}",
                              "server_error", BAD_FORWARD_CODE)
            self.abort()
            return
        except ConnectionError:
            self._end()  # the requester reset the stream: lose() follows
            return
        if self._drain is None and self._writer.unsent_bytes() > SEND_HIGH_WATER_BYTES:
            assert self._protocol is not None
            self._protocol.pause_writing()
            self._drain = asyncio.ensure_future(self._drained())

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        """The server is done: the whole answer is written (a reset if it never began one)."""
        if self._closed.done():
            return
        if self._head_sent:
            self._writer.close()
        else:
            self._writer.abort()
        self._end()

    def abort(self) -> None:
        self._writer.abort()
        self._end()

    def is_closing(self) -> bool:
        return self._closed.done()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket, peer address or TLS: a member's stream, authenticated by the mesh

    def get_write_buffer_size(self) -> int:
        return self._writer.unsent_bytes()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # the stream's water marks rule

    def can_write_eof(self) -> bool:
        return False

    def is_reading(self) -> bool:
        return True

    def pause_reading(self) -> None:
        pass  # the whole request was handed over at once

    def resume_reading(self) -> None:
        pass

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        assert isinstance(protocol, asyncio.Protocol)
        self._protocol = protocol

    def _end(self) -> None:
        if not self._closed.done():
            self._closed.set_result(None)

    async def _drained(self) -> None:
        try:
            await self._writer.drain()
        except ConnectionError:
            pass  # the stream failed: the next write says so
        finally:
            self._drain = None
            if not self._lost and self._protocol is not None:
                self._protocol.resume_writing()


def _passed_on(name: str) -> bool:
    """Whether a request header from the peer goes on to the local API (never the token it could forge)."""
    lowered = name.lower()
    return lowered not in HOP_BY_HOP_HEADERS and lowered != FORWARDED_TOKEN_HEADER.lower()


def _answer_error(writer: MeshStreamWriter, status: int, message: str, error_type: str, code: str) -> None:
    """An OpenAI-style error (serve/access.py's shape) as the whole answer, if the stream still takes one."""
    body = json.dumps(openai_error_body(message, error_type, code)).encode()
    head = ForwardedResponseHead(status, (("Content-Type", "application/json"),))
    try:
        writer.write(encode_response_head(head) + body)
        writer.close()
    except ConnectionError:
        writer.abort()


# A's side: the member that forwards --------------------------------------------------------------


class MeshForwardTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends requests for ``http://<node id hex>.mesh/...`` to that member's API.

    ``open_stream(node_id)`` gives a new stream to the member (ConnectionError or a MeshError if
    there is none). Each request takes one stream; the response's body streams as it arrives,
    and closing the response early resets the stream, which cancels the request at the member.
    """

    def __init__(self, open_stream: OpenStream) -> None:
        self._open_stream = open_stream

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        node_id = mesh_node_id(request.url.host)
        if node_id is None or request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"{request.url} is not a mesh URL (http://<node id>.mesh/...)",
                                            request=request)
        member = short_id(node_id)
        timeouts = request.extensions.get("timeout", {})
        try:
            encoded = encode_request(ForwardedRequest(
                request.method, request.url.raw_path.decode("ascii"),
                _end_to_end(request.headers.raw),
                await request.aread()))
        except (WireError, UnicodeDecodeError) as exc:
            raise httpx.LocalProtocolError(f"the request cannot be forwarded to {member}: {exc}",
                                           request=request) from exc
        try:
            async with asyncio.timeout(timeouts.get("connect")):
                reader, writer = await self._open_stream(node_id)
            writer.write(bytes((StreamKind.API_FORWARD,)) + encoded)  # and no FIN: see the module docstring
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"no stream to {member} in time", request=request) from exc
        except (ConnectionError, MeshError) as exc:
            raise httpx.ConnectError(f"no stream to {member}: {exc}", request=request) from exc
        body = _ResponseBody(reader, writer, member, timeouts.get("read"))
        try:
            head = await body.read_head(request)
        except BaseException:
            writer.abort()  # cancelled, timed out or failed: the member stops too
            raise
        headers = [(n, v) for n, v in head.headers if n.lower() not in HOP_BY_HOP_HEADERS]
        return httpx.Response(head.status, headers=headers, stream=body)


class _ResponseBody(httpx.AsyncByteStream):
    """A forwarded answer's body as it arrives; closing it before the end resets the stream."""

    def __init__(self, reader: MeshStreamReader, writer: MeshStreamWriter, member: str,
                 read_timeout: float | None) -> None:
        self._reader = reader
        self._writer = writer
        self._member = member
        self._read_timeout = read_timeout
        self._ended = False  # the member's FIN came: the body is whole
        self._first = b""  # body bytes that came with the head

    async def read_head(self, request: httpx.Request) -> ForwardedResponseHead:
        """The answer's head (the body bytes that came with it kept for the body), as httpx errors."""
        decoder = ResponseHeadDecoder()
        try:
            while True:
                data = await self._read()
                if not data:
                    decoder.feed_eof()
                if (result := decoder.feed(data)) is not None:
                    head, self._first = result
                    return head
        except WireError as exc:
            raise httpx.RemoteProtocolError(f"{self._member} answered a forwarded request with nonsense: {exc}",
                                            request=request) from exc
        except ConnectionError as exc:
            raise httpx.ReadError(f"{self._member}'s stream broke before its answer: {exc}", request=request) from exc

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._first:
            yield self._first
        while True:
            try:
                data = await self._read()
            except ConnectionError as exc:
                raise httpx.ReadError(f"{self._member}'s answer broke off: {exc}") from exc
            if not data:
                self._ended = True
                return
            yield data

    async def aclose(self) -> None:
        if self._ended:
            self._writer.close()  # our FIN: the member's side is done too
        else:
            self._writer.abort()  # the member cancels the request

    async def _read(self) -> bytes:
        try:
            async with asyncio.timeout(self._read_timeout):
                return await self._reader.read(READ_BYTES)
        except TimeoutError as exc:
            raise httpx.ReadTimeout(f"{self._member} sent nothing for {self._read_timeout} s") from exc


def _end_to_end(raw: list[tuple[bytes, bytes]]) -> Headers:
    """Raw HTTP headers as text, each byte one character (how wire/api_forward.py carries them),
    hop-by-hop ones left out."""
    return tuple((name.decode("latin-1"), value.decode("latin-1")) for name, value in raw
                 if name.decode("latin-1").lower() not in HOP_BY_HOP_HEADERS)
