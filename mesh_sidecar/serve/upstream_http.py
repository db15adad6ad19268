"""HTTP to where the proxy sends a request: this node's llama-server, or a member's API over the mesh.

Both look alike to the proxy (``UpstreamClient``): a streamed exchange whose answer
is read chunk by chunk as it comes (``UpstreamAnswer``), a JSON post for a
continuation's preparation, and one error, ``UpstreamLostError``, for anything
that means "nobody answered, or the answer broke off" (failover's cue, once the
proxy has found llama-server gone or not answering its health check).

A pooled connection llama-server closed is no failure: its HTTP library closes a
connection idle for 5 s (cpp-httplib's keep-alive timeout), and a request written
as it does gets "Server disconnected" before any byte of an answer. Such a request
was never read, so it is sent again once, on a fresh connection
(:func:`closed_before_answer` tells it from the rest); and idle connections are
let go after LLAMA_KEEPALIVE_S, before llama-server would close them.

    LlamaServerHttp   aiohttp's client, over loopback TCP to our llama-server
    MemberApiHttp     httpx with net/api_forward.py's transport: an API_FORWARD stream

Why two libraries: each streamed chunk through httpx passes anyio's cancel scopes,
h11 and a task switch, about 0.15 ms of CPU per token on a 2-core machine, and
on a serving node that CPU is taken from llama-server's own threads; aiohttp's
client (C parser, no task per read) reads the same stream for less than half.
aiohttp already serves our API. The mesh side stays on httpx, whose transport
interface carries a request over a QUIC stream without an HTTP parser at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Protocol

import aiohttp
import httpx

from ..errors import UpstreamLostError
from .sse import EVENT_SEPARATOR

log = logging.getLogger(__name__)

UPSTREAM_CONNECT_TIMEOUT_S = 5.0
# Under cpp-httplib's keep-alive timeout (CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND, 5 s): an idle pooled connection is
# closed here first, so a request seldom meets one llama-server is closing.
LLAMA_KEEPALIVE_S = 4.0
# The errno of a write or read on a connection the server had closed, before its answer began.
_CLOSED_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})
# A fast streamed answer is read from llama-server at most this often: tokens that come faster leave
# together, one write to the client (one QUIC packet when forwarded) instead of one each. Each
# token read and passed on costs the sidecar CPU that llama-server's threads lose; 50 writes a
# second is smoother than a screen needs, and adds at most this much to when a token is seen.
STREAM_FLUSH_INTERVAL_S = 0.02
# Reads never held, so the first token never is: a chat stream's first event carries only the role.
UNHELD_READS = 2
# Reads are held only while events come fast enough for a hold to gather this many: fewer do not pay for
# pausing and resuming the socket and a timer (a token a read costs less).
EVENTS_PER_HOLD = 2
UPSTREAM_WRITE_TIMEOUT_S = 60.0
# Generation can pause for long between tokens on a slow mesh: no read timeout.
_MEMBER_TIMEOUT = httpx.Timeout(connect=UPSTREAM_CONNECT_TIMEOUT_S, read=None, write=UPSTREAM_WRITE_TIMEOUT_S,
                                pool=None)
_LLAMA_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=UPSTREAM_CONNECT_TIMEOUT_S, sock_read=None)
_LLAMA_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


def closed_before_answer(exc: BaseException) -> bool:
    """Whether ``exc``, raised while sending a request and waiting for its answer's head, means the pooled
    connection was closed by the server before it read the request (send it again on a fresh one): aiohttp's
    "Server disconnected", or a reset or broken pipe on an established connection. Not a refused connection
    (nobody listens: llama-server is gone), nor a timeout."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return (isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError)
            and exc.errno in _CLOSED_ERRNOS)
_MEMBER_ERRORS = (httpx.TransportError,)


class UpstreamAnswer(Protocol):
    """An answer whose body is read as it arrives; ``aclose`` before its end cancels the request there."""

    @property
    def status_code(self) -> int: ...

    def header_items(self) -> list[tuple[str, str]]: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class UpstreamClient(Protocol):
    async def send(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> UpstreamAnswer:
        """The answer's head; its body follows through the answer. UpstreamLostError if none came."""
        ...

    async def aclose(self) -> None: ...


# --- this node's llama-server ---------------------------------------------------------------


class _LlamaAnswer:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    @property
    def status_code(self) -> int:
        return self._response.status

    def header_items(self) -> list[tuple[str, str]]:
        return list(self._response.headers.items())

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        content = self._response.content
        loop = asyncio.get_running_loop()
        reads = 0
        read_at = loop.time()
        fast = False  # whether, at the pace of the last read, a hold gathers EVENTS_PER_HOLD events
        with _lost_on(_LLAMA_ERRORS, "llama-server's answer broke off"):
            while True:
                if (fast and reads >= UNHELD_READS and (hold_s := read_at + STREAM_FLUSH_INTERVAL_S - loop.time()) > 0
                        and not content.is_eof()):
                    await self._gather(hold_s)
                chunk = await content.readany()
                if not chunk:
                    return
                reads += 1
                now = loop.time()
                fast = chunk.count(EVENT_SEPARATOR) * STREAM_FLUSH_INTERVAL_S >= EVENTS_PER_HOLD * (now - read_at)
                read_at = now
                yield chunk

    async def _gather(self, hold_s: float) -> None:
        """Let the socket gather what llama-server sends for ``hold_s``: no wakeup per token meanwhile."""
        connection = self._response.connection  # None once the whole body is in
        transport = connection.transport if connection is not None else None
        # Closed: the read says how. Not reading: aiohttp's own flow control holds it, and resumes it.
        if transport is None or transport.is_closing() or not transport.is_reading():
            return
        transport.pause_reading()
        try:
            await asyncio.sleep(hold_s)
        finally:
            if not transport.is_closing():
                transport.resume_reading()

    async def aread(self) -> bytes:
        with _lost_on(_LLAMA_ERRORS, "llama-server's answer broke off"):
            return await self._response.read()

    async def aclose(self) -> None:
        # A whole answer gives its connection back to the pool; a cut one closes it, which is what
        # stops llama-server generating for a client that left.
        self._response.release()


class LlamaServerHttp:
    """This node's llama-server (any of them, by URL), with its key once ``authorize``d."""

    def __init__(self, key: str | None = None) -> None:
        self._headers: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None
        if key:
            self.authorize(key)

    def authorize(self, key: str) -> None:
        self._headers["Authorization"] = f"Bearer {key}"

    def _opened(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the running event loop.
        if self._session is None:
            self._session = _llama_session(aiohttp.TCPConnector(keepalive_timeout=LLAMA_KEEPALIVE_S))
        return self._session

    def _fresh(self) -> aiohttp.ClientSession:
        """A session that keeps no connection: each request on a new one (the pool's may all be closing)."""
        if self._fresh_session is None:
            self._fresh_session = _llama_session(aiohttp.TCPConnector(force_close=True))
        return self._fresh_session

    async def send(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> UpstreamAnswer:
        headers = {**headers, **self._headers}
        with _lost_on(_LLAMA_ERRORS, "llama-server did not answer"):
            try:
                response = await self._opened().request(method, url, headers=headers, data=body)
            except _LLAMA_ERRORS as exc:
                if not closed_before_answer(exc):
                    raise
                log.info("llama-server closed a pooled connection under a %s %s (%r); sending it again on a fresh "
                         "one", method, url, exc)
                response = await self._fresh().request(method, url, headers=headers, data=body)
        return _LlamaAnswer(response)

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        """Status and body of a GET (for /metrics), within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                answer = await self.send("GET", url, {}, b"")
                try:
                    return answer.status_code, await answer.aread()
                finally:
                    await answer.aclose()
        except TimeoutError as exc:
            raise UpstreamLostError(f"llama-server did not answer within {timeout_s:g} s") from exc

    async def aclose(self) -> None:
        for session in (self._session, self._fresh_session):
            if session is not None:
                await session.close()


def _llama_session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    # auto_decompress off: bytes pass through as llama-server sent them, with its Content-Encoding.
    return aiohttp.ClientSession(timeout=_LLAMA_TIMEOUT, auto_decompress=False, connector=connector,
                                 skip_auto_headers=("Accept-Encoding", "User-Agent"))


# --- a member's API, over the mesh ----------------------------------------------------------


class _MemberAnswer:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    @property
    def status_code(self) -> int:
        return self._response.status_code

    def header_items(self) -> list[tuple[str, str]]:
        return list(self._response.headers.items())

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        with _lost_on(_MEMBER_ERRORS):
            async for chunk in self._response.aiter_raw():
                yield chunk

    async def aread(self) -> bytes:
        with _lost_on(_MEMBER_ERRORS):
            return await self._response.aread()

    async def aclose(self) -> None:
        await self._response.aclose()


class MemberApiHttp:
    """Members' APIs through ``transport`` (net/api_forward.MeshForwardTransport), by mesh URL."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._client = httpx.AsyncClient(transport=transport, timeout=_MEMBER_TIMEOUT)

    async def send(self, method: str, url: str, headers: Mapping[str, str], body: bytes) -> UpstreamAnswer:
        with _lost_on(_MEMBER_ERRORS):
            response = await self._client.send(
                self._client.build_request(method, url, headers=headers, content=body), stream=True)
        return _MemberAnswer(response)

    async def aclose(self) -> None:
        await self._client.aclose()


@contextlib.contextmanager
def _lost_on(errors: tuple[type[BaseException], ...], what: str = "") -> Iterator[None]:
    """The client library's ``errors`` in the block, as UpstreamLostError saying ``what`` failed (the
    mesh transport's own messages already name the member and what broke)."""
    try:
        yield
    except errors as exc:
        raise UpstreamLostError(f"{what}: {exc!r}" if what else str(exc)) from exc


async def post_json(client: UpstreamClient, url: str, payload: object) -> Any:
    """The JSON of a 2xx answer; UpstreamLostError for no answer, another status or no JSON."""
    answer = await client.send("POST", url, {"Content-Type": "application/json"}, json.dumps(payload).encode())
    try:
        body = await answer.aread()
    finally:
        await answer.aclose()
    if not 200 <= answer.status_code < 300:
        raise UpstreamLostError(f"answered {answer.status_code}: {body[:200].decode(errors='replace')}")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise UpstreamLostError(f"answered no JSON: {exc}") from exc
