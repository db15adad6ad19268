"""Byte pipes on QUIC streams: MeshStreamReader and MeshStreamWriter, with water marks both ways.

Every bidirectional stream but the control stream (connection.py) is a byte
pipe, read and written like asyncio's StreamReader and StreamWriter, with
half-close (``write_eof`` sends FIN; the other direction stays open).

Backpressure. aioquic buffers all it is given to send (its issue #328) and
doubles receive windows as data arrives rather than as it is read. Here:
  send:    writer.drain() waits while the stream's bytes not yet sent exceed
           SEND_HIGH_WATER_BYTES, until they fall to SEND_LOW_WATER_BYTES.
  receive: a stream's window is granted as its reader consumes (bytes read +
           quic.STREAM_RECEIVE_WINDOW_BYTES), so at most that much waits in a
           reader.

Lifetime. Closing a connection makes its stream readers and writers raise
ConnectionResetError (a stream whose FIN had arrived keeps its data). A writer's
``abort`` resets both directions with a StreamCode.
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING

from ..units import KIB

if TYPE_CHECKING:
    from .connection import PeerConnection

SEND_HIGH_WATER_BYTES = 512 * KIB
SEND_LOW_WATER_BYTES = 128 * KIB


class StreamCode(enum.IntEnum):
    """Error codes in our RESET_STREAM and STOP_SENDING frames."""

    CLOSED = 0  # closed before reading to the end
    ABORTED = 1
    HANDLER_FAILED = 2


class MeshStreamReader:
    """The receiving half of a stream; reads like asyncio.StreamReader."""

    def __init__(self, connection: PeerConnection, stream_id: int) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self._buffer = bytearray()
        self._eof = False
        self._error: ConnectionError | None = None
        self._consumed = 0
        self._wakeup = asyncio.Event()
        self.finished = False  # the peer sent FIN or reset: no more frames will come
        self.peak_buffered = 0  # most bytes ever waiting here, for tests and metrics

    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (at least one), or b"" at end of stream."""
        if n <= 0:
            raise ValueError("read size must be positive")
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._wakeup.clear()
            await self._wakeup.wait()
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        self._consumed += len(data)
        self._connection._grant(self.stream_id, self._consumed)
        return data

    async def readexactly(self, n: int) -> bytes:
        """Exactly ``n`` bytes; asyncio.IncompleteReadError if the stream ends first."""
        parts = bytearray()
        while len(parts) < n:
            chunk = await self.read(n - len(parts))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(parts), n)
            parts += chunk
        return bytes(parts)

    def _feed(self, data: bytes, fin: bool) -> None:
        if self._error is not None:
            return  # stopped locally; the peer's reset is on its way
        self._buffer += data
        self.peak_buffered = max(self.peak_buffered, len(self._buffer))
        self._eof = self._eof or fin
        self._wakeup.set()

    def _fail(self, error: ConnectionError) -> None:
        if self._error is None and not self._eof:
            self._error = error
            self._buffer.clear()
            self._wakeup.set()


class MeshStreamWriter:
    """The sending half of a stream; writes like asyncio.StreamWriter."""

    def __init__(self, connection: PeerConnection, stream_id: int, reader: MeshStreamReader) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self._reader = reader
        self._eof_written = False
        self._error: ConnectionError | None = None
        self._wakeup = asyncio.Event()
        self._wait_limit = 0
        self.finished = False  # FIN written, or reset by either side
        self.peak_buffered = 0  # most unsent bytes ever seen just after a write()

    def write(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        if self._eof_written:
            raise RuntimeError("write() after write_eof()")
        if not data:
            return
        quic = self._connection._quic
        quic.send_stream_data(self.stream_id, data)
        self.peak_buffered = max(self.peak_buffered, quic.unsent_bytes(self.stream_id))
        self._connection._transmit_soon()

    def unsent_bytes(self) -> int:
        """Written and not yet sent: what a writer that would rather drop than wait looks at (relay.py)."""
        return 0 if self._error is not None else self._connection._quic.unsent_bytes(self.stream_id)

    async def drain(self) -> None:
        """Wait while too much is written and unsent; raises if the stream failed."""
        if self._error is not None:
            raise self._error
        if self._connection._quic.unsent_bytes(self.stream_id) > SEND_HIGH_WATER_BYTES:
            await self._wait_unsent(SEND_LOW_WATER_BYTES)
            if self._error is not None:
                raise self._error

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """Half-close: send FIN; the other direction stays open."""
        if self._error is not None:
            raise self._error
        if self._eof_written:
            return
        self._eof_written = True
        self._connection._quic.send_stream_data(self.stream_id, b"", end_stream=True)
        self._connection._send_finished(self)
        self._connection._transmit_soon()

    def is_closing(self) -> bool:
        return self._eof_written or self._error is not None

    def close(self) -> None:
        """FIN our side and tell the peer to stop sending if it has not finished."""
        if self._error is not None:
            return
        self.write_eof()
        if not self._reader.finished:
            self._connection._stop_receiving(self.stream_id, StreamCode.CLOSED)
            self._reader._fail(ConnectionResetError("stream closed locally"))

    async def wait_closed(self) -> None:
        """Wait until everything written has been sent once, or the stream failed."""
        await self._wait_unsent(0)

    def abort(self, error_code: int = StreamCode.ABORTED) -> None:
        """Reset both directions with ``error_code``."""
        if self._error is not None:
            return
        self._connection._abort_stream(self, error_code)

    async def _wait_unsent(self, limit: int) -> None:
        self._wait_limit = limit
        blocked = self._connection._blocked_writers
        try:
            while self._error is None and self._connection._quic.unsent_bytes(self.stream_id) > limit:
                self._wakeup.clear()
                blocked.add(self)
                await self._wakeup.wait()
        finally:
            blocked.discard(self)

    def _check_unblocked(self) -> None:
        if self._connection._quic.unsent_bytes(self.stream_id) <= self._wait_limit:
            self._wakeup.set()

    def _fail(self, error: ConnectionError) -> None:
        if self._error is None:
            self._error = error
            self.finished = True
            self._wakeup.set()

