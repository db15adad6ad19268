"""HTTP requests to another member's API over the mesh: both ends of an API_FORWARD stream.

    node A                                                    node B (serves the model)
    httpx.AsyncClient(MeshForwardTransport)  ── QUIC stream ──▶ serve_forwarded_request
      GET/POST http://<B's node id>.mesh/v1/...   request         │ + Mesh-Forwarded: <token>
                                                                   ▼
      httpx.Response, its body streamed       ◀── answer ──── B's own API on 127.0.0.1

The stream carries wire/api_forward.py's format. A's side keeps its half open until
it has the whole answer; closing the response before then resets the stream, B's side
sees the reset (or a FIN), closes its HTTP request to the local API, and the
generation there is cancelled. Nothing is buffered but QUIC's window and the
stream's water marks (streams.py): each chunk is passed on as the local API sends it.

Failures reach A's caller as httpx.TransportError subclasses, so failover code that
already catches those for llama-server sees them too:
    no stream to the member (not connected, a mesh error)     httpx.ConnectError
    the stream ends, resets or sends nonsense before the head httpx.RemoteProtocolError / ReadError
    the body breaks off (B reset the stream)                  httpx.ReadError
    httpx's connect or read timeout passes                    httpx.ConnectTimeout / ReadTimeout
To route only mesh URLs through it: ``httpx.AsyncClient(mounts={MESH_URL_PATTERN: transport})``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

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
from ..wire.stream_kind import StreamKind
from .streams import MeshStreamReader, MeshStreamWriter

log = logging.getLogger(__name__)

READ_BYTES = 64 * KIB
MESH_HOST_SUFFIX = ".mesh"
MESH_URL_PATTERN = "http://*" + MESH_HOST_SUFFIX  # an httpx mount pattern matching every mesh URL
_MESH_HOST_RE = re.compile(f"([0-9a-f]{{{2 * NODE_ID_BYTES}}}){re.escape(MESH_HOST_SUFFIX)}")
LOCAL_API_CONNECT_TIMEOUT_S = 5.0
# Generation can pause for long between tokens: no read timeout towards the local API.
LOCAL_API_TIMEOUT = httpx.Timeout(connect=LOCAL_API_CONNECT_TIMEOUT_S, read=None, write=60.0, pool=None)
BAD_FORWARD_CODE = "bad_forward"
MODEL_UNAVAILABLE_CODE = "model_unavailable"

# A new stream to a member, by its node id (not yet carrying anything).
OpenStream = Callable[[bytes], Awaitable[tuple[MeshStreamReader, MeshStreamWriter]]]


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
                                  local_api: Callable[[], str | None], token: str, peer_name: str) -> None:
    """Answer one API_FORWARD stream (kind byte read) from ``peer_name`` with this node's own API.

    ``local_api()`` is the API's base URL ("http://127.0.0.1:8080"), or None where this node
    has none (503 ``model_unavailable``). The request goes there with ``FORWARDED_TOKEN_HEADER:
    token``; its answer comes back as it is produced. Returns when the answer is sent, the
    requester went away (its FIN or reset: the local request is closed, which cancels it), or
    the stream failed; never raises for any of those.
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
    base = local_api()
    if base is None:
        _answer_error(writer, 503, "This member serves no API now; ask another.", "unavailable",
                      MODEL_UNAVAILABLE_CODE)
        return
    try:
        # trust_env=False: a proxy named in the environment must not see the token or the request.
        async with (httpx.AsyncClient(timeout=LOCAL_API_TIMEOUT, trust_env=False, verify=_tls_context()) as client,
                    asyncio.TaskGroup() as group):
            relay = group.create_task(_relay(client, base, request, token, writer, peer_name))
            watch = group.create_task(_until_requester_leaves(reader))
            # Whichever ends first ends the other: the answer is sent, or nobody waits for it.
            relay.add_done_callback(lambda _: watch.cancel())
            watch.add_done_callback(lambda _: relay.cancel())
        if relay.cancelled():
            log.info("forwarded %s %s from %s: the requester went away; cancelled", request.method,
                     request.target, peer_name)
    finally:
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


async def _relay(client: httpx.AsyncClient, base: str, request: ForwardedRequest, token: str,
                 writer: MeshStreamWriter, peer_name: str) -> None:
    """Make ``request`` to the local API and stream its answer to ``writer``."""
    url = httpx.URL(base).copy_with(raw_path=request.target.encode("ascii"))  # the host stays ``base``'s
    headers = [(name, value) for name, value in request.headers if _passed_on(name)]
    headers.append((FORWARDED_TOKEN_HEADER, token))
    head_sent = False
    try:
        async with client.stream(request.method, url, content=request.body,
                                 headers=[(n.encode("latin-1"), v.encode("latin-1")) for n, v in headers]) as answer:
            head = ForwardedResponseHead(answer.status_code, _end_to_end(answer.headers.raw))
            try:
                writer.write(encode_response_head(head))
            except WireError as exc:
                log.warning("the local API's answer to %s cannot be forwarded: %s", peer_name, exc)
                _answer_error(writer, 502, f"This member's API answered what cannot be forwarded: {exc}",
                              "server_error", BAD_FORWARD_CODE)
                return
            head_sent = True
            async for chunk in answer.aiter_raw():
                writer.write(chunk)
                await writer.drain()  # the stream's water marks: aioquic has no backpressure of its own
        writer.close()
    except httpx.TransportError as exc:
        if head_sent:
            log.info("the local API's answer to %s broke off: %s", peer_name, exc)
            writer.abort()  # a reset, not FIN: the requester must not take a cut answer as whole
        else:
            log.info("the local API did not answer %s's forwarded request: %s", peer_name, exc)
            _answer_error(writer, 503, f"This member's API is not answering ({exc}); ask another.", "unavailable",
                          MODEL_UNAVAILABLE_CODE)
    except ConnectionError as exc:
        log.info("forwarded answer to %s stopped: %s", peer_name, exc)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The one TLS context the local API's clients share: each client would load the CA bundle
    again (18 ms, on every forwarded request) though a plain-HTTP local API never uses it."""
    return ssl.create_default_context()


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
