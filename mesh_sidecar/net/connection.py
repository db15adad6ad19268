"""One admitted connection to a peer node: admission, the control stream, stream routing, teardown.

    MeshTransport ──(connection id)──> PeerConnection ── quic.QuicConnection
                                         ├─ stream 0: control stream
                                         └─ other bidirectional streams: byte pipes
                                            (MeshStreamReader, MeshStreamWriter)

A PeerConnection is the asyncio glue around the library's sans-I/O connection:
it feeds it datagrams, drains its events, hands its datagrams to the endpoint
and re-arms its one timer (``_pump``).

Control stream, the client's first bidirectional stream (id 0), framed by
wire/frames.py:

    frame = length (4 bytes, big endian) | payload
    frames 1-4:  the auth handshake (auth.py), each at most auth.MAX_MESSAGE_BYTES
    then:        control messages, each at most MAX_CONTROL_MESSAGE_BYTES

Admission, before any other use of a connection:
  1. TLS: the server's certificate carries the node id the client dialed (quic.py).
  2. auth.py on stream 0: each side signs, and MACs with the mesh secret, a
     transcript of both fresh nonces and both ids.
  A failure closes the connection with CloseCode.AUTH_REFUSED and the reason,
  logged once where it was decided ("refused 10.0.0.3:4433: wrong mesh secret")
  and once where it was received ("refused by 10.0.0.3:4433: ...").

The connection talks to the transport that made it through ConnectionHost
(its route table, its task group, its socket or relay circuits), and to its
streams through their StreamTable (streams.py).

Lifetime. The host's ``serve_peer(connection)`` runs once per admitted
connection, as a task the transport owns; when it returns the connection is
closed. Peer-opened streams wait until ``set_stream_handler`` is called, then
each runs its handler as a task the connection owns. Closing a connection
cancels its tasks and fails its streams (streams.py).

Datagram size: from admission on, path_mtu.py's search picks sizes to probe and
this connection sends the probes and falls back when a size stops getting through.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import (
    AuthError,
    ConnectionClosedError,
    FrameTooLargeError,
    MalformedMessageError,
    MeshError,
    WireError,
)
from ..identity import short_id
from ..wire import auth
from ..wire.frames import FRAME_HEADER, MAX_CONTROL_MESSAGE_BYTES, FrameDecoder, encode_frame
from . import path_mtu
from .connection_ids import ConnectionIdTable
from .endpoint import Address, Datagram, format_address
from .packet_relay import is_virtual
from .quic import QuicConnection, events
from .streams import MeshStreamReader, MeshStreamWriter, StreamCode, StreamPair, StreamTable

logger = logging.getLogger(__name__)

KEEPALIVE_INTERVAL_S = 2.0
CONTROL_STREAM_ID = 0

StreamHandler = Callable[[MeshStreamReader, MeshStreamWriter], Awaitable[None]]


class CloseCode(enum.IntEnum):
    """Application error codes in our CONNECTION_CLOSE frames."""

    NORMAL = 0
    AUTH_REFUSED = 1
    PROTOCOL_ERROR = 2
    HANDLER_FAILED = 3


@dataclass
class AdmissionCounters:
    """Inbound connections that never got in, for status."""

    refused_connections: int = 0  # failed admission (wrong secret, key, silence)
    unadmitted_streams: int = 0  # streams opened by peers never admitted: not served, counted


class ConnectionHost(Protocol):
    """What a connection needs from the transport that made it (transport.py)."""

    @property
    def node_id(self) -> bytes:
        """This node's id."""
        ...

    @property
    def routes(self) -> ConnectionIdTable[PeerConnection]:
        """Where datagrams go by connection id; a connection adds and retires its own ids."""
        ...

    @property
    def admission(self) -> AdmissionCounters:
        ...

    def admits(self, node_id: bytes) -> bool:
        """Whether a peer that proved ``node_id`` may be admitted (not removed from the mesh)."""
        ...

    def send_datagrams(self, datagrams: list[Datagram]) -> None:
        """Over UDP, or into a relay circuit."""
        ...

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coroutine`` as a task the transport owns."""
        ...

    async def serve_peer(self, connection: PeerConnection) -> None:
        """An admitted connection's whole life; returning closes it."""
        ...

    def finished(self, connection: PeerConnection) -> None:
        """``connection`` is gone: forget it and its routes."""
        ...


class PeerConnection:
    """One connection to a peer node; handed out only once the peer is admitted."""

    def __init__(
        self,
        host: ConnectionHost,
        quic: QuicConnection,
        handshake: auth.ClientHandshake | auth.ServerHandshake,
        *,
        initiator: bool,
    ) -> None:
        self._host = host
        self._loop = asyncio.get_running_loop()
        self._quic = quic
        self._handshake = handshake
        self.initiator = initiator
        self.peer_id = b""  # set on admission
        self.last_heard_s: float | None = None  # time.monotonic() of its last datagram
        self.close_reason: str | None = None
        self._admitted = False
        self._settled = asyncio.Event()  # admitted, or failed with _failure
        self._failure: MeshError | None = None
        self._decoder = FrameDecoder(auth.MAX_MESSAGE_BYTES)
        self._control: deque[bytes] = deque()
        self._control_ready = asyncio.Event()
        self._control_consumed = 0
        self._streams = StreamTable(quic, self._transmit_soon)
        self._unclaimed: deque[StreamPair] = deque()
        self._stream_handler: StreamHandler | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.Handle | None = None
        self._timer_at: float | None = None
        self._auth_timer = self._loop.call_at(handshake.deadline, self._auth_timed_out)
        self._transmit_scheduled = False
        self._terminated = asyncio.Event()
        self._size_search: path_mtu.DatagramSizeSearch | None = None  # from admission on
        self._size_probe_due = False

    # public ------------------------------------------------------------------

    @property
    def admitted(self) -> bool:
        """Whether the peer proved its key and the mesh secret (connection ids and streams flow before)."""
        return self._admitted

    @property
    def peer_address(self) -> tuple | None:
        """The address its datagrams come from as the QUIC library holds it (a circuit's virtual one when
        relayed), None before the first."""
        return self._quic.get_peer_address()

    @property
    def remote_address(self) -> Address:
        address = self._quic.get_peer_address()
        assert address is not None
        return address[0], address[1]

    @property
    def relayed(self) -> bool:
        """Whether this connection runs over a relay circuit (relay.py), not straight over UDP."""
        return is_virtual(self._quic.get_peer_address())

    @property
    def rtt(self) -> float | None:
        """Smoothed round-trip time in seconds, None before the first sample."""
        return self._quic.smoothed_rtt()

    @property
    def datagram_size(self) -> int:
        """Bytes per datagram to this peer: QUIC's minimum until a bigger size is probed."""
        return self._quic.datagram_size

    @property
    def preferred(self) -> bool:
        """True if the simultaneous-dial rule keeps this connection: the lower id's dial."""
        own_id = self._host.node_id
        dialer, other = (own_id, self.peer_id) if self.initiator else (self.peer_id, own_id)
        return dialer < other

    @property
    def open_streams(self) -> int:
        """Streams not yet finished both ways, whoever opened them."""
        return len(self._streams)

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    def send_control(self, data: bytes) -> None:
        """Queue one control message; they arrive whole and in order."""
        self._check_open()
        if len(data) > MAX_CONTROL_MESSAGE_BYTES:
            raise FrameTooLargeError(
                f"control message of {len(data)} bytes is over the limit of {MAX_CONTROL_MESSAGE_BYTES}"
            )
        self._quic.send_stream_data(CONTROL_STREAM_ID, encode_frame(data))
        self._transmit_soon()

    async def receive_control(self) -> bytes:
        """The next control message; ConnectionClosedError once the connection is closed."""
        while not self._control:
            if self.close_reason is not None:
                raise ConnectionClosedError(f"connection to {self._name()} closed: {self.close_reason}")
            self._control_ready.clear()
            await self._control_ready.wait()
        message = self._control.popleft()
        self._control_consumed += FRAME_HEADER.size + len(message)
        self._streams.grant(CONTROL_STREAM_ID, self._control_consumed)
        return message

    async def open_stream(self) -> tuple[MeshStreamReader, MeshStreamWriter]:
        """A new stream; the peer's handler sees it when its first byte (or FIN) arrives."""
        self._check_open()
        stream_id = self._quic.get_next_available_stream_id()
        self._quic.send_stream_data(stream_id, b"")  # creates it, sends nothing
        return self._streams.add(stream_id)

    def set_stream_handler(self, handler: StreamHandler) -> None:
        """Run ``handler(reader, writer)`` for each stream the peer opens, also those already waiting."""
        self._stream_handler = handler
        while self._unclaimed:
            self._spawn(self._serve_stream(*self._unclaimed.popleft()))

    def close(self, reason: str = "closed", code: CloseCode = CloseCode.NORMAL) -> None:
        if self.close_reason is not None:
            return
        self._quic.close(error_code=code, reason_phrase=reason)
        self._shutdown(reason)
        self.pump()

    async def wait_closed(self) -> None:
        await self._terminated.wait()

    # for the transport ---------------------------------------------------------

    async def wait_admission(self) -> MeshError | None:
        """Wait until the peer is admitted (None) or refused (why)."""
        await self._settled.wait()
        return self._failure

    def datagram_received(self, data: bytes, address: tuple) -> None:
        """Feed one datagram; the transport pumps once after the batch it came in."""
        self.last_heard_s = time.monotonic()  # the peer is alive, whatever the datagram says (health.py)
        self._quic.receive_datagram(data, address, now=self._loop.time())

    def pump(self) -> int:
        """Handle the QUIC library's events, send its datagrams, re-arm its timer; returns datagrams sent."""
        self._handle_events()
        if self._terminated.is_set():
            return 0
        datagrams = self._quic.datagrams_to_send(now=self._loop.time())
        if self._size_probe_due:
            datagrams += self._size_probe()
        self._host.send_datagrams(datagrams)
        when = self._quic.get_timer()
        # Compared with the deadline we asked for: uvloop hands back a plain Handle for one already due.
        if self._timer is not None and when != self._timer_at:
            self._timer.cancel()
            self._timer = None
        if when is not None and self._timer is None:
            self._timer, self._timer_at = self._loop.call_at(when, self._on_timer), when
        self._streams.wake_writers()
        return len(datagrams)

    def _on_timer(self) -> None:
        self._timer = None
        self._quic.handle_timer(now=self._loop.time())
        self._check_black_hole()
        self.pump()

    def _transmit_soon(self) -> None:
        # Coalesce the writes of one loop iteration into one pass over aioquic.
        if not self._transmit_scheduled:
            self._transmit_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._transmit_scheduled = False
        self.pump()

    def _handle_events(self) -> None:
        while (event := self._quic.next_event()) is not None:
            try:
                self._handle_event(event)
            except (AuthError, WireError) as exc:
                if self._admitted:
                    logger.warning("closing %s: %s", self._name(), exc)
                    self._quic.close(error_code=CloseCode.PROTOCOL_ERROR, reason_phrase=str(exc))
                    self._shutdown(str(exc))
                else:
                    self._refuse(exc)

    def _handle_event(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.ConnectionIdIssued):
            self._host.routes.route(event.connection_id, self)
        elif isinstance(event, events.ConnectionIdRetired):
            self._host.routes.retire(event.connection_id)
        elif isinstance(event, events.ConnectionTerminated):
            self._on_terminated(event)
        elif self.close_reason is not None:
            return  # closing: nothing more reaches the application
        elif isinstance(event, events.HandshakeCompleted):
            if self.initiator:
                assert isinstance(self._handshake, auth.ClientHandshake)
                self._send_auth(self._handshake.start(self._quic.peer_node_id(), self._loop.time()))
        elif isinstance(event, events.StreamDataReceived):
            self._on_stream_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, events.StreamReset):
            self._on_stream_reset(event.stream_id, event.error_code)
        elif isinstance(event, events.StopSendingReceived):
            if event.stream_id == CONTROL_STREAM_ID:
                raise MalformedMessageError("peer stopped reading the control stream")
            self._streams.stopped_by_peer(event.stream_id, event.error_code)

    # admission ---------------------------------------------------------------

    def _send_auth(self, message: bytes) -> None:
        self._quic.send_stream_data(CONTROL_STREAM_ID, encode_frame(message))

    def _on_auth_message(self, message: bytes) -> None:
        reply = self._handshake.receive(message, self._loop.time())
        if reply is not None:
            self._send_auth(reply)
        if self._handshake.complete:
            self._admit()

    def _admit(self) -> None:
        assert self._handshake.peer_id is not None
        if not self._host.admits(self._handshake.peer_id):
            # Proofs checked first, so only the removed node's own key hears this.
            self._refuse(AuthError(f"{auth.REMOVED} ({short_id(self._handshake.peer_id)})"))
            return
        self._admitted = True
        self.peer_id = self._handshake.peer_id
        self._auth_timer.cancel()
        self._decoder.max_frame_bytes = MAX_CONTROL_MESSAGE_BYTES
        self._quic.admit()
        self._settled.set()
        logger.info("admitted %s (%s)", self._name(), "outbound" if self.initiator else "inbound")
        # A relayed path's datagrams ride inside a stream: no size to probe, and no route to read it from.
        if self._quic.probes_datagram_size and not self.relayed:
            self._size_search = path_mtu.DatagramSizeSearch(self._size_candidates())
            self._size_probe_due = True
        self._spawn(self._keepalive())
        self._spawn(self._serve_peer())

    def _auth_timed_out(self) -> None:
        if not self._admitted and self.close_reason is None:
            self._refuse(auth.timeout_error(self._handshake.timeout_s))
            self.pump()

    def _refuse(self, error: MeshError) -> None:
        logger.warning("refused %s: %s", self._name(), error)
        self._host.admission.refused_connections += not self.initiator
        self._failure = error
        self._quic.close(error_code=CloseCode.AUTH_REFUSED, reason_phrase=str(error))
        self._shutdown(str(error))

    def _on_terminated(self, event: events.ConnectionTerminated) -> None:
        reason = event.reason_phrase or f"QUIC error {event.error_code:#x}"
        if not self._admitted and self._failure is None:
            # frame_type is None only for an application close, where our codes live.
            if event.frame_type is None and event.error_code == CloseCode.AUTH_REFUSED:
                logger.warning("refused by %s: %s", self._name(), reason)
                self._failure = AuthError(f"refused by the peer: {reason}")
            else:
                logger.debug("%s closed before admission: %s", self._name(), reason)
                self._failure = ConnectionClosedError(f"closed before admission: {reason}")
        self._shutdown(reason)
        self._finalize()

    # datagram size (path_mtu.py) ---------------------------------------------------

    def _size_candidates(self) -> list[int]:
        address = self._quic.get_peer_address()
        if address is None:
            return []
        return path_mtu.candidate_sizes(path_mtu.route_mtu(address), ipv6=":" in address[0])

    def _size_probe(self) -> list[tuple[bytes, tuple]]:
        self._size_probe_due = False
        if self._size_search is None or (size := self._size_search.next_probe()) is None:
            return []
        return self._quic.datagram_size_probe(size, self._loop.time(), self._on_size_probe_result)

    def _on_size_probe_result(self, size: int, acknowledged: bool) -> None:
        # Called from inside aioquic's ACK or loss handling: the next probe goes at the next pump.
        search = self._size_search
        assert search is not None
        search.on_probe_result(size, acknowledged)
        if acknowledged and search.confirmed == size:
            self._quic.set_datagram_size(size)
            logger.info("datagrams to %s: %d bytes", self._name(), size)
        self._size_probe_due = not search.done

    def _check_black_hole(self) -> None:
        if (self._size_search is not None and self._quic.datagram_size > path_mtu.BASE_DATAGRAM_BYTES
                and self._quic.probe_timeouts() >= path_mtu.BLACK_HOLE_PROBE_TIMEOUTS):
            logger.info("datagrams of %d bytes to %s go unanswered: back to %d bytes, probing again",
                        self._quic.datagram_size, self._name(), path_mtu.BASE_DATAGRAM_BYTES)
            self._quic.set_datagram_size(path_mtu.BASE_DATAGRAM_BYTES)
            self._size_search.on_black_hole(self._size_candidates())
            self._size_probe_due = True

    # streams -----------------------------------------------------------------

    def _on_stream_data(self, stream_id: int, data: bytes, fin: bool) -> None:
        if stream_id == CONTROL_STREAM_ID:
            self._on_control_data(data, fin)
            return
        pair = self._streams.get(stream_id)
        if pair is None:
            peer_opened = (stream_id & 1 == 0) != self.initiator  # bit 0 clear: client-opened
            if not peer_opened:
                return  # late bytes for a stream we already forgot
            if stream_id & 2:
                raise MalformedMessageError("peer opened a unidirectional stream")
            pair = self._streams.add(stream_id)
            if self._admitted and self._stream_handler is not None:
                self._spawn(self._serve_stream(*pair))
            else:
                self._unclaimed.append(pair)
        self._streams.received(pair[0], data, fin)

    def _on_control_data(self, data: bytes, fin: bool) -> None:
        self._decoder.feed(data)
        while (frame := self._decoder.next_frame()) is not None:
            if self._admitted:
                self._control.append(frame)
                self._control_ready.set()
            else:
                self._control_consumed += FRAME_HEADER.size + len(frame)
                self._on_auth_message(frame)
        if fin:
            raise MalformedMessageError("peer ended the control stream")

    def _on_stream_reset(self, stream_id: int, error_code: int) -> None:
        if stream_id == CONTROL_STREAM_ID:
            raise MalformedMessageError("peer reset the control stream")
        self._streams.reset_by_peer(stream_id, error_code)

    # tasks and teardown --------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = self._host.spawn(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _keepalive(self) -> None:
        for uid in itertools.count():
            await asyncio.sleep(KEEPALIVE_INTERVAL_S)
            self._quic.send_ping(uid)
            self.pump()

    async def _serve_peer(self) -> None:
        try:
            await self._host.serve_peer(self)
        except MeshError as exc:
            if not self.closed:
                logger.warning("closing %s: %s", self._name(), exc)
            self.close(str(exc))
        except Exception:
            logger.exception("peer handler for %s failed", self._name())
            self.close("peer handler failed", CloseCode.HANDLER_FAILED)
        else:
            self.close("done")

    async def _serve_stream(self, reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        assert self._stream_handler is not None
        try:
            await self._stream_handler(reader, writer)
        except (MeshError, ConnectionError) as exc:
            logger.debug("stream %d of %s ended: %s", writer.stream_id, self._name(), exc)
            writer.abort()
        except Exception:
            logger.exception("stream handler for %s failed", self._name())
            writer.abort(StreamCode.HANDLER_FAILED)
        else:
            writer.close()

    def _shutdown(self, reason: str) -> None:
        """Stop all use of the connection: wake every waiter with an error, cancel tasks."""
        if self.close_reason is not None:
            return
        self.close_reason = reason
        self._auth_timer.cancel()
        if self._admitted:
            logger.info("closed %s: %s", self._name(), reason)
        self._streams.close(f"connection to {self._name()} closed: {reason}")
        if not self._admitted and not self.initiator:
            # Never served: a stranger's tunnel or relay request goes nowhere, but is counted.
            self._host.admission.unadmitted_streams += len(self._unclaimed)
        self._unclaimed.clear()
        self._control_ready.set()
        if not self._admitted and self._failure is None:
            self._failure = ConnectionClosedError(f"closed before admission: {reason}")
        self._settled.set()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    def _finalize(self) -> None:
        """The QUIC connection is gone: stop routing to it and stop its timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._host.finished(self)
        self._terminated.set()

    def discard(self, reason: str) -> None:
        """Close and forget at once, without the closing period (dial gave up, node stopping)."""
        self.close(reason)
        self._finalize()

    def forget(self, reason: str) -> None:
        """Forget a connection whose first datagram drew no reply, sending nothing."""
        self._shutdown(reason)
        self._finalize()

    def _check_open(self) -> None:
        if self.close_reason is not None:
            raise ConnectionClosedError(f"connection to {self._name()} is closed: {self.close_reason}")

    def _name(self) -> str:
        address = self._quic.get_peer_address()
        where = format_address(address) if address is not None else "unknown address"
        return f"{short_id(self.peer_id)} at {where}" if self.peer_id else where

    def __repr__(self) -> str:
        return f"<PeerConnection {self._name()}{' closed' if self.closed else ''}>"
