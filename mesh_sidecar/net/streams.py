"""Byte pipes on QUIC streams: MeshStreamReader and MeshStreamWriter, with water marks both ways.

Every bidirectional stream but the control stream (connection.py) is a byte
pipe, read and written like asyncio's StreamReader and StreamWriter, with
half-close (``write_eof`` sends FIN; the other direction stays open). A
connection keeps its pipes in a StreamTable, their one link to its QUIC
connection: the connection feeds the table what arrives, and the pipes send,
grant credit and reset through it.

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
from collections.abc import Callable

from ..units import KIB
from .quic import QuicConnection

SEND_HIGH_WATER_BYTES = 512 * KIB
SEND_LOW_WATER_BYTES = 128 * KIB

StreamPair = tuple["MeshStreamReader", "MeshStreamWriter"]


class StreamCode(enum.IntEnum):
    """Error codes in our RESET_STREAM and STOP_SENDING frames."""

    CLOSED = 0  # closed before reading to the end
    ABORTED = 1
    HANDLER_FAILED = 2


class StreamTable:
    """One connection's open byte pipes, and what they do through its QUIC connection."""

    def __init__(self, quic: QuicConnection, transmit_soon: Callable[[], None]) -> None:
        self._quic = quic
        self._transmit_soon = transmit_soon  # the connection sends what the library queued, soon
        self._streams: dict[int, StreamPair] = {}
        self._blocked_writers: set[MeshStreamWriter] = set()
        self._closed = False

    def __len__(self) -> int:
        """Streams not yet finished both ways."""
        return len(self._streams)

    def get(self, stream_id: int) -> StreamPair | None:
        return self._streams.get(stream_id)

    def add(self, stream_id: int) -> StreamPair:
        """A pipe for ``stream_id``, new to this table."""
        reader = MeshStreamReader(self, stream_id)
        pair = reader, MeshStreamWriter(self, stream_id, reader)
        self._streams[stream_id] = pair
        return pair

    def received(self, reader: MeshStreamReader, data: bytes, fin: bool) -> None:
        """Bytes (and maybe FIN) the peer sent on ``reader``'s stream."""
        reader._feed(data, fin)
        if fin:
            reader.finished = True
            self._forget_if_done(reader.stream_id)

    def reset_by_peer(self, stream_id: int, error_code: int) -> None:
        """The peer reset its sending side of ``stream_id``."""
        if (pair := self._streams.get(stream_id)) is None:
            return
        reader = pair[0]
        reader._fail(ConnectionResetError(f"stream reset by peer (code {error_code})"))
        reader.finished = True
        self._forget_if_done(stream_id)

    def stopped_by_peer(self, stream_id: int, error_code: int) -> None:
        """The peer stopped reading ``stream_id``; the library has already reset our sending side."""
        if (pair := self._streams.get(stream_id)) is not None:
            pair[1]._fail(ConnectionResetError(f"peer stopped reading (code {error_code})"))
            self._send_finished(pair[1])

    def grant(self, stream_id: int, consumed: int) -> None:
        """Credit the peer for ``consumed`` bytes read from ``stream_id`` (the control stream too)."""
        if not self._closed and self._quic.grant_window(stream_id, consumed):
            self._transmit_soon()

    def close(self, why: str) -> None:
        """The connection is closing: every pipe fails (ConnectionResetError(why)), and nothing more is sent."""
        self._closed = True
        for reader, writer in self._streams.values():
            reader._fail(ConnectionResetError(why))
            writer._fail(ConnectionResetError(why))
        self._streams.clear()
        self._blocked_writers.clear()

    def wake_writers(self) -> None:
        """After a send: wake the writers whose unsent bytes fell to what they wait for."""
        for writer in list(self._blocked_writers):
            writer._check_unblocked()

    def _send_finished(self, writer: MeshStreamWriter) -> None:
        writer.finished = True
        self._forget_if_done(writer.stream_id)

    def _forget_if_done(self, stream_id: int) -> None:
        pair = self._streams.get(stream_id)
        if pair is not None and pair[0].finished and pair[1].finished:
            del self._streams[stream_id]

    def _stop_receiving(self, stream_id: int, error_code: int) -> None:
        if not self._closed:
            self._quic.stop_stream(stream_id, error_code)
            self._transmit_soon()

    def _abort(self, writer: MeshStreamWriter, error_code: int) -> None:
        if self._closed:
            return
        self._quic.reset_stream(writer.stream_id, error_code)
        if not writer._reader.finished:
            self._stop_receiving(writer.stream_id, error_code)
        error = ConnectionResetError(f"stream aborted locally (code {error_code})")
        writer._reader._fail(error)
        writer._fail(error)
        self._send_finished(writer)
        self._transmit_soon()


class MeshStreamReader:
    """The receiving half of a stream; reads like asyncio.StreamReader."""

    def __init__(self, table: StreamTable, stream_id: int) -> None:
        self._table = table
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
        self._table.grant(self.stream_id, self._consumed)
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

    def __init__(self, table: StreamTable, stream_id: int, reader: MeshStreamReader) -> None:
        self._table = table
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
        quic = self._table._quic
        quic.send_stream_data(self.stream_id, data)
        self.peak_buffered = max(self.peak_buffered, quic.unsent_bytes(self.stream_id))
        self._table._transmit_soon()

    def unsent_bytes(self) -> int:
        """Written and not yet sent: what a writer that would rather drop than wait looks at (relay.py)."""
        return 0 if self._error is not None else self._table._quic.unsent_bytes(self.stream_id)

    async def drain(self) -> None:
        """Wait while too much is written and unsent; raises if the stream failed."""
        if self._error is not None:
            raise self._error
        if self._table._quic.unsent_bytes(self.stream_id) > SEND_HIGH_WATER_BYTES:
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
        self._table._quic.send_stream_data(self.stream_id, b"", end_stream=True)
        self._table._send_finished(self)
        self._table._transmit_soon()

    def is_closing(self) -> bool:
        return self._eof_written or self._error is not None

    def close(self) -> None:
        """FIN our side and tell the peer to stop sending if it has not finished."""
        if self._error is not None:
            return
        self.write_eof()
        if not self._reader.finished:
            self._table._stop_receiving(self.stream_id, StreamCode.CLOSED)
            self._reader._fail(ConnectionResetError("stream closed locally"))

    async def wait_closed(self) -> None:
        """Wait until everything written has been sent once, or the stream failed."""
        await self._wait_unsent(0)

    def abort(self, error_code: int = StreamCode.ABORTED) -> None:
        """Reset both directions with ``error_code``."""
        if self._error is not None:
            return
        self._table._abort(self, error_code)

    async def _wait_unsent(self, limit: int) -> None:
        self._wait_limit = limit
        blocked = self._table._blocked_writers
        try:
            while self._error is None and self._table._quic.unsent_bytes(self.stream_id) > limit:
                self._wakeup.clear()
                blocked.add(self)
                await self._wakeup.wait()
        finally:
            blocked.discard(self)

    def _check_unblocked(self) -> None:
        if self._table._quic.unsent_bytes(self.stream_id) <= self._wait_limit:
            self._wakeup.set()

    def _fail(self, error: ConnectionError) -> None:
        if self._error is None:
            self._error = error
            self.finished = True
            self._wakeup.set()

