"""The node's network edge: an authenticated QUIC full mesh on one UDP port.

One UDP socket both listens and dials; every datagram goes to its connection
by destination connection id. Datagrams waiting together are read together and
each connection handles its share at once (one pass over the QUIC state, one
ACK); datagrams sent together go as one Linux UDP GSO ``sendmsg()`` where the
kernel allows. Only this module imports the QUIC library: aioquic, or qh3 1.x
(a fork with the same API and Rust parts) when MESH_QUIC=qh3; every use of
their internals sits in the ``_Quic`` / ``_Qh3Quic`` adapter.

    UDP port ── MeshTransport ──(connection id)──> PeerConnection ── _Quic (aioquic)
                                                     ├─ stream 0: control stream
                                                     └─ other bidirectional streams: byte pipes
                                                        (MeshStreamReader, MeshStreamWriter)

Control stream, the client's first bidirectional stream (id 0):

    frame = length (4 bytes, big endian) | payload
    frames 1-4:  the auth handshake (auth.py), each at most auth.MAX_MESSAGE_BYTES
    then:        control messages, each at most MAX_CONTROL_MESSAGE_BYTES

Admission, before any other use of a connection:
  1. TLS: the server presents the self-signed certificate of its node key and
     the client checks that key is the id it dialed. aioquic has no API to ask
     for a client certificate, so the client's key is proved in step 2.
  2. auth.py on stream 0: each side signs, and MACs with the mesh secret, a
     transcript of both fresh nonces and both ids.
  A failure closes the connection with CloseCode.AUTH_REFUSED and the reason,
  logged once where it was decided ("refused 10.0.0.3:4433: wrong mesh secret")
  and once where it was received ("refused by 10.0.0.3:4433: ...").

An unadmitted peer costs bounded memory: at most MAX_UNAUTHENTICATED_PEERS at
a time, each for at most auth.AUTH_TIMEOUT_S, with a connection receive window
of PRE_AUTH_RECEIVE_WINDOW_BYTES. An Initial packet that draws no reply (not a
client hello aioquic can read) is forgotten at once.

Backpressure. aioquic buffers all it is given to send (its issue #328) and
doubles receive windows as data arrives rather than as it is read. Here:
  send:    writer.drain() waits while the stream's bytes not yet sent exceed
           SEND_HIGH_WATER_BYTES, until they fall to SEND_LOW_WATER_BYTES.
  receive: a stream's window is granted as its reader consumes (bytes read +
           STREAM_RECEIVE_WINDOW_BYTES), so at most that much waits in a reader.
           The connection window opens to CONNECTION_RECEIVE_WINDOW_BYTES on
           admission and then grows as aioquic's does; stream windows bound it.

Lifetime. ``on_peer(connection)`` runs once per admitted connection, inbound
or outbound, as a task the transport owns; when it returns the connection is
closed. Peer-opened streams wait until ``set_stream_handler`` is called, then
each runs its handler as a task the connection owns. Closing a connection
cancels its tasks, and its stream readers and writers raise
ConnectionResetError (a stream whose FIN had arrived keeps its data).

Simultaneous dials: two nodes may dial each other at once and get two admitted
connections. The transport keeps both and says which to keep:
``PeerConnection.preferred`` is true for the one dialed by the lower node id;
``open_streams`` tells when the other one has finished its work.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import itertools
import logging
import os
import secrets
import socket
import ssl
import struct
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from .. import environment

# The QUIC library, chosen once per process: aioquic, or qh3 1.x (MESH_QUIC=qh3), a fork with
# the same API and Rust parts; only the adapter section below knows how their internals differ.
QUIC_LIBRARY = environment.quic_library()
if QUIC_LIBRARY == "aioquic":
    from aioquic import tls
    from aioquic.buffer import Buffer
    from aioquic.quic import events
    from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
    from aioquic.quic.connection import QuicConnection
    from aioquic.quic.packet import QuicFrameType, QuicPacketType, pull_quic_header
    from aioquic.quic.packet_builder import QuicDeliveryState, QuicPacketBuilder
    from aioquic.quic.recovery import K_MICRO_SECOND, QuicPacketPacer
elif QUIC_LIBRARY == "qh3":
    from qh3._hazmat import Buffer
    from qh3.quic import events
    from qh3.quic.configuration import QuicConfiguration
    from qh3.quic.connection import QuicConnection
    from qh3.quic.packet import QuicPacketType, pull_quic_header
    from qh3.tls import SignatureAlgorithm, load_pem_private_key, load_pem_x509_certificates

    SMALLEST_MAX_DATAGRAM_SIZE = 1200  # RFC 9000 14.1
    if not hasattr(QuicConnection, "_write_application"):
        # qh3 2: a native core that opens receive windows itself as data arrives, read or not.
        raise ImportError("MESH_QUIC=qh3 needs qh3 1.x: qh3 2 grants flow-control credit by itself, so a "
                          "peer could make this node buffer without bound; install 'qh3<2' or use aioquic")
else:
    raise ImportError(f"MESH_QUIC={QUIC_LIBRARY!r}: the QUIC library must be aioquic or qh3")
if TYPE_CHECKING:
    from aioquic.quic.recovery import QuicPacketSpace
    from aioquic.quic.stream import QuicStream

from ..wire import auth
from ..wire.frames import FRAME_HEADER, MAX_CONTROL_MESSAGE_BYTES, FrameDecoder, encode_frame
from . import path_mtu
from ..errors import (
    AuthError,
    FrameTooLargeError,
    MalformedMessageError,
    MeshError,
    PortInUseError,
    UsageError,
    WireError,
)
from ..identity import NodeIdentity, node_id_of_certificate, short_id

logger = logging.getLogger(__name__)

KIB = 1024
MIB = 1024 * KIB

ALPN = "mesh-inference/1"
KEEPALIVE_INTERVAL_S = 2.0
IDLE_TIMEOUT_S = 10.0
DIAL_TIMEOUT_S = 3.0  # per address, TLS and admission included
MAX_DATAGRAM_BYTES = path_mtu.BASE_DATAGRAM_BYTES  # until a bigger size is probed (path_mtu.py)
CONNECTION_ID_BYTES = 8
SOCKET_BUFFER_BYTES = 4 * MIB  # asked of the kernel, which may cap it
MAX_DATAGRAMS_PER_READ = 64  # read in one go when the socket is readable, then each connection pumps once
MAX_UDP_PAYLOAD_BYTES = 65535
# Linux UDP GSO: one sendmsg() carries up to this many equal-size datagrams (the last may be shorter).
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
GSO_MAX_SEGMENTS = 64
PACING_BURST_DATAGRAMS = GSO_MAX_SEGMENTS  # what a full pacing bucket may send at once (_BurstPacer)
GSO_MAX_BYTES = 65000
STREAM_RECEIVE_WINDOW_BYTES = 1 * MIB
WINDOW_GRANT_STEP_BYTES = STREAM_RECEIVE_WINDOW_BYTES // 4  # fewer MAX_STREAM_DATA frames
SEND_HIGH_WATER_BYTES = 512 * KIB
SEND_LOW_WATER_BYTES = 128 * KIB
CONNECTION_RECEIVE_WINDOW_BYTES = 16 * MIB
PRE_AUTH_RECEIVE_WINDOW_BYTES = 4 * KIB
MAX_UNAUTHENTICATED_PEERS = 32
# Datagrams that are not QUIC for us (scans, floods) are dropped; one log line per interval says so.
IGNORED_DATAGRAMS_LOG_INTERVAL_S = 60.0
CONTROL_STREAM_ID = 0

Address = tuple[str, int]
PeerHandler = Callable[["PeerConnection"], Awaitable[None]]
StreamHandler = Callable[["MeshStreamReader", "MeshStreamWriter"], Awaitable[None]]


class CloseCode(enum.IntEnum):
    """Application error codes in our CONNECTION_CLOSE frames."""

    NORMAL = 0
    AUTH_REFUSED = 1
    PROTOCOL_ERROR = 2
    HANDLER_FAILED = 3


class StreamCode(enum.IntEnum):
    """Error codes in our RESET_STREAM and STOP_SENDING frames."""

    CLOSED = 0  # closed before reading to the end
    ABORTED = 1
    HANDLER_FAILED = 2


def _format_address(address: tuple) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- QUIC library adapter: the only code that knows aioquic's internals ------


def _quic_configuration(identity: NodeIdentity, *, is_client: bool) -> QuicConfiguration:
    configuration = QuicConfiguration(
        alpn_protocols=[ALPN],
        is_client=is_client,
        idle_timeout=IDLE_TIMEOUT_S,
        max_data=PRE_AUTH_RECEIVE_WINDOW_BYTES,
        max_stream_data=STREAM_RECEIVE_WINDOW_BYTES,
        max_datagram_size=MAX_DATAGRAM_BYTES,
        connection_id_length=CONNECTION_ID_BYTES,
        # Node certificates are self-signed: the client checks the key they carry, not a chain.
        verify_mode=ssl.CERT_NONE,
    )
    if QUIC_LIBRARY == "qh3":
        _qh3_credentials(configuration, identity, is_client=is_client)
    elif not is_client:
        configuration.certificate = identity.certificate()
        configuration.private_key = identity.private_key
    return configuration


if QUIC_LIBRARY == "aioquic":

    class _BurstPacer(QuicPacketPacer):
        """aioquic's pacer, but a full bucket releases one GSO batch, not 16 datagrams.

        With 16, a sender that paces near what the receiver can take ends up
        woken by its pacing timer for one or two datagrams at a time, each its
        own sendmsg() and pump: relay runs flipped between 0.5 and 0.26 Gbit/s
        (twice the CPU per byte) on the same link. Bursts stay capped at half
        the congestion window.
        """

        def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
            super().update_rate(congestion_window, smoothed_rtt)
            rate = congestion_window / max(smoothed_rtt, K_MICRO_SECOND)
            burst = min(congestion_window // 2, PACING_BURST_DATAGRAMS * self._max_datagram_size)
            self.bucket_max = max(2 * self._max_datagram_size, burst) / rate
            self.bucket_time = min(self.bucket_time, self.bucket_max)


class _Quic(QuicConnection):
    """aioquic's connection, with receive windows that grow only as we allow."""

    _admitted = False
    paces_in_bursts = True  # _BurstPacer

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.paces_in_bursts:
            self._loss._pacer = _BurstPacer(max_datagram_size=self._max_datagram_size)

    def _write_connection_limits(self, builder: QuicPacketBuilder, space: QuicPacketSpace) -> None:
        if self._admitted:
            super()._write_connection_limits(builder, space)
            return
        # Before admission, hide arrivals from aioquic's window doubling.
        limit = self._local_max_data
        used, limit.used = limit.used, 0
        try:
            super()._write_connection_limits(builder, space)
        finally:
            limit.used = used

    def _write_stream_limits(self, builder: QuicPacketBuilder, space: QuicPacketSpace, stream: QuicStream) -> None:
        # Stream windows move only in grant_window(), as readers consume.
        highest, stream.receiver.highest_offset = stream.receiver.highest_offset, 0
        try:
            super()._write_stream_limits(builder, space, stream)
        finally:
            stream.receiver.highest_offset = highest

    def admit(self) -> None:
        """Open the connection window once the peer is admitted."""
        self._admitted = True
        limit = self._local_max_data
        limit.value = max(limit.value, limit.used + CONNECTION_RECEIVE_WINDOW_BYTES)

    def grant_window(self, stream_id: int, consumed: int) -> bool:
        """Let the peer send up to ``consumed`` + one window; True if that is news to send."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.receiver.is_finished:
            return False
        limit = consumed + STREAM_RECEIVE_WINDOW_BYTES
        if limit - stream.max_stream_data_local < WINDOW_GRANT_STEP_BYTES:
            return False
        stream.max_stream_data_local = limit
        return True

    def unsent_bytes(self, stream_id: int) -> int:
        """Bytes written to the stream and not yet sent once."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        return stream.sender._buffer_stop - stream.sender.highest_offset

    def peer_node_id(self) -> bytes:
        """The node id in the peer's TLS certificate."""
        certificate = self.tls._peer_certificate
        if certificate is None:
            raise AuthError("peer presented no certificate")
        return node_id_of_certificate(certificate)

    def smoothed_rtt(self) -> float | None:
        recovery = self._loss
        return recovery._rtt_smoothed if recovery._rtt_initialized else None

    # Datagram size (path_mtu.py): aioquic sends what it was configured with and has no probes.
    probes_datagram_size = True

    @property
    def datagram_size(self) -> int:
        return self._max_datagram_size

    def set_datagram_size(self, size: int) -> None:
        self._max_datagram_size = size
        self._loss._cc._max_datagram_size = size  # the window grows by it
        self._loss._pacer._max_datagram_size = size

    def probe_timeouts(self) -> int:
        """Loss recovery's probe timeouts in a row: nothing sent since has been acknowledged."""
        return self._loss._pto_count

    def datagram_size_probe(self, size: int, now: float,
                            on_result: Callable[[int, bool], None]) -> list[tuple[bytes, tuple]]:
        """One PING padded to ``size`` bytes; ``on_result(size, acknowledged)`` once its fate is known.

        The probe is kept out of bytes in flight, so its loss (the likely outcome of a size too
        big) does not shrink the congestion window (RFC 8899 section 3).
        """
        builder = QuicPacketBuilder(
            host_cid=self.host_cid, is_client=self._is_client, max_datagram_size=size,
            packet_number=self._packet_number, peer_cid=self._peer_cid.cid, quic_logger=self._quic_logger,
            spin_bit=self._spin_bit, version=self._version,
        )
        builder.start_packet(QuicPacketType.ONE_RTT, self._cryptos[tls.Epoch.ONE_RTT])
        frame = builder.start_frame(QuicFrameType.PING, handler=self._on_size_probe, handler_args=(size, on_result))
        frame.push_bytes(bytes(builder.remaining_buffer_space))  # PADDING frames are single zero bytes
        datagrams, packets = builder.flush()
        self._packet_number = builder.packet_number
        for packet in packets:
            packet.in_flight = False
            packet.sent_time = now
            self._loss.on_packet_sent(packet=packet, space=self._spaces[tls.Epoch.ONE_RTT])
        address = self._network_paths[0].addr
        return [(datagram, address) for datagram in datagrams]

    @staticmethod
    def _on_size_probe(delivery: QuicDeliveryState, size: int, on_result: Callable[[int, bool], None]) -> None:
        on_result(size, delivery == QuicDeliveryState.ACKED)


def _qh3_credentials(configuration: QuicConfiguration, identity: NodeIdentity, *, is_client: bool) -> None:
    """qh3 takes its own certificate and key types, and offers EdDSA only when asked."""
    if is_client:
        configuration.signature_algorithms = [SignatureAlgorithm.ED25519]
        return
    pem = serialization.Encoding.PEM
    configuration.certificate = load_pem_x509_certificates(identity.certificate().public_bytes(pem))[0]
    configuration.private_key = load_pem_private_key(identity.private_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


class _Qh3Quic(_Quic):
    """qh3 1.x: aioquic's core with Rust parts; it doubles windows inline, where aioquic has hooks."""

    probes_datagram_size = False  # it probes 1350 and 1452 itself, with per-space packet numbers
    paces_in_bursts = False  # its pacer is native code

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._written: dict[int, int] = {}  # bytes written per stream: its native sender does not tell

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        super().send_stream_data(stream_id, bytes(data), end_stream)  # its native sender takes bytes only
        self._written[stream_id] = self._written.get(stream_id, 0) + len(data)

    def datagrams_to_send(self, now: float) -> list:
        # Hide arrivals from the doubling in _write_application, as _Quic's hooks do for aioquic.
        hidden = [(stream.receiver, stream.receiver.highest_offset) for stream in self._streams_dirty_limits]
        for receiver, _ in hidden:
            receiver.highest_offset = 0
        limit = self._local_max_data
        used = limit.used
        if not self._admitted:
            limit.used = 0
        try:
            return super().datagrams_to_send(now)
        finally:
            for receiver, highest in hidden:
                receiver.highest_offset = highest
            limit.used = used

    # qh3 also doubles a window when the peer says it is blocked by it: undo that.

    def _handle_data_blocked_frame(self, context: Any, frame_type: int, buf: Buffer) -> None:
        value = self._local_max_data.value
        super()._handle_data_blocked_frame(context, frame_type, buf)
        if not self._admitted:
            self._local_max_data.value = value

    def _handle_stream_data_blocked_frame(self, context: Any, frame_type: int, buf: Buffer) -> None:
        start = buf.tell()
        stream_id = buf.pull_uint_var()
        buf.seek(start)
        stream = self._streams.get(stream_id)
        before = None if stream is None else stream.max_stream_data_local
        super()._handle_stream_data_blocked_frame(context, frame_type, buf)
        stream = self._streams.get(stream_id)
        if stream is not None and stream.max_stream_data_local != before:
            stream.max_stream_data_local = before if before is not None else stream.max_stream_data_local // 2

    def grant_window(self, stream_id: int, consumed: int) -> bool:
        if not super().grant_window(stream_id, consumed):
            return False
        self._streams_dirty_limits.add(self._streams[stream_id])  # only these get MAX_STREAM_DATA
        return True

    def unsent_bytes(self, stream_id: int) -> int:
        stream = self._streams.get(stream_id)
        if stream is None:
            self._written.pop(stream_id, None)
            return 0
        return self._written.get(stream_id, 0) - stream.sender.highest_offset

    def peer_node_id(self) -> bytes:
        certificate = self.get_peercert()
        if certificate is None:
            raise AuthError("peer presented no certificate")
        return node_id_of_certificate(x509.load_der_x509_certificate(certificate.public_bytes()))

    def get_peer_address(self) -> tuple | None:
        return self._network_paths[0].addr if self._network_paths else None


_QuicConnection = _Qh3Quic if QUIC_LIBRARY == "qh3" else _Quic


# --- streams -----------------------------------------------------------------


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


# --- connections ---------------------------------------------------------------


class PeerConnection:
    """One connection to a peer node; handed out only once the peer is admitted."""

    def __init__(
        self,
        transport: MeshTransport,
        quic: _Quic,
        handshake: auth.ClientHandshake | auth.ServerHandshake,
        *,
        initiator: bool,
    ) -> None:
        self._transport = transport
        self._loop = transport._loop
        self._quic = quic
        self._handshake = handshake
        self.initiator = initiator
        self.peer_id = b""  # set on admission
        self.close_reason: str | None = None
        self._admitted = False
        self._settled = asyncio.Event()  # admitted, or failed with _failure
        self._failure: MeshError | None = None
        self._decoder = FrameDecoder(auth.MAX_MESSAGE_BYTES)
        self._control: deque[bytes] = deque()
        self._control_ready = asyncio.Event()
        self._control_consumed = 0
        self._streams: dict[int, tuple[MeshStreamReader, MeshStreamWriter]] = {}
        self._unclaimed: deque[tuple[MeshStreamReader, MeshStreamWriter]] = deque()
        self._stream_handler: StreamHandler | None = None
        self._blocked_writers: set[MeshStreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._connection_ids: set[bytes] = set()
        self._timer: asyncio.Handle | None = None
        self._timer_at: float | None = None
        self._auth_timer = self._loop.call_at(handshake.deadline, self._auth_timed_out)
        self._transmit_scheduled = False
        self._terminated = asyncio.Event()
        self._size_search: path_mtu.DatagramSizeSearch | None = None  # from admission on
        self._size_probe_due = False

    # public ------------------------------------------------------------------

    @property
    def remote_address(self) -> Address:
        address = self._quic.get_peer_address()
        assert address is not None
        return address[0], address[1]

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
        own_id = self._transport.node_id
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
        """The next control message; MeshError once the connection is closed."""
        while not self._control:
            if self.close_reason is not None:
                raise MeshError(f"connection to {self._name()} closed: {self.close_reason}")
            self._control_ready.clear()
            await self._control_ready.wait()
        message = self._control.popleft()
        self._control_consumed += FRAME_HEADER.size + len(message)
        self._grant(CONTROL_STREAM_ID, self._control_consumed)
        return message

    async def open_stream(self) -> tuple[MeshStreamReader, MeshStreamWriter]:
        """A new stream; the peer's handler sees it when its first byte (or FIN) arrives."""
        self._check_open()
        stream_id = self._quic.get_next_available_stream_id()
        self._quic.send_stream_data(stream_id, b"")  # creates it, sends nothing
        return self._add_stream(stream_id)

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
        self._pump()

    async def wait_closed(self) -> None:
        await self._terminated.wait()

    # QUIC plumbing -----------------------------------------------------------

    def _datagram_received(self, data: bytes, address: tuple) -> None:
        """Feed one datagram; the transport pumps once after the batch it came in."""
        self._quic.receive_datagram(data, address, now=self._loop.time())

    def _pump(self) -> int:
        """Handle aioquic's events, send its datagrams, re-arm its timer; returns datagrams sent."""
        self._handle_events()
        if self._terminated.is_set():
            return 0
        datagrams = self._quic.datagrams_to_send(now=self._loop.time())
        if self._size_probe_due:
            datagrams += self._size_probe()
        self._transport._send_datagrams(datagrams)
        when = self._quic.get_timer()
        # Compared with the deadline we asked for: uvloop hands back a plain Handle for one already due.
        if self._timer is not None and when != self._timer_at:
            self._timer.cancel()
            self._timer = None
        if when is not None and self._timer is None:
            self._timer, self._timer_at = self._loop.call_at(when, self._on_timer), when
        for writer in list(self._blocked_writers):
            writer._check_unblocked()
        return len(datagrams)

    def _on_timer(self) -> None:
        self._timer = None
        self._quic.handle_timer(now=self._loop.time())
        self._check_black_hole()
        self._pump()

    def _transmit_soon(self) -> None:
        # Coalesce the writes of one loop iteration into one pass over aioquic.
        if not self._transmit_scheduled:
            self._transmit_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._transmit_scheduled = False
        self._pump()

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
            self._connection_ids.add(event.connection_id)
            self._transport._routes[event.connection_id] = self
        elif isinstance(event, events.ConnectionIdRetired):
            self._connection_ids.discard(event.connection_id)
            self._transport._routes.pop(event.connection_id, None)
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
            entry = self._streams.get(event.stream_id)
            if entry is not None:  # aioquic has already reset our sending side
                entry[1]._fail(ConnectionResetError(f"peer stopped reading (code {event.error_code})"))
                self._send_finished(entry[1])

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
        if self._handshake.peer_id in self._transport._removed:
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
        if self._quic.probes_datagram_size:
            self._size_search = path_mtu.DatagramSizeSearch(self._size_candidates())
            self._size_probe_due = True
        self._spawn(self._keepalive())
        self._spawn(self._serve_peer())

    def _auth_timed_out(self) -> None:
        if not self._admitted and self.close_reason is None:
            self._refuse(auth.timeout_error())
            self._pump()

    def _refuse(self, error: MeshError) -> None:
        logger.warning("refused %s: %s", self._name(), error)
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
                self._failure = MeshError(f"closed before admission: {reason}")
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
        entry = self._streams.get(stream_id)
        if entry is None:
            peer_opened = (stream_id & 1 == 0) != self.initiator  # bit 0 clear: client-opened
            if not peer_opened:
                return  # late bytes for a stream we already forgot
            if stream_id & 2:
                raise MalformedMessageError("peer opened a unidirectional stream")
            entry = self._add_stream(stream_id)
            if self._admitted and self._stream_handler is not None:
                self._spawn(self._serve_stream(*entry))
            else:
                self._unclaimed.append(entry)
        reader = entry[0]
        reader._feed(data, fin)
        if fin:
            reader.finished = True
            self._forget_if_done(stream_id)

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
        entry = self._streams.get(stream_id)
        if entry is None:
            return
        reader = entry[0]
        reader._fail(ConnectionResetError(f"stream reset by peer (code {error_code})"))
        reader.finished = True
        self._forget_if_done(stream_id)

    def _add_stream(self, stream_id: int) -> tuple[MeshStreamReader, MeshStreamWriter]:
        reader = MeshStreamReader(self, stream_id)
        entry = reader, MeshStreamWriter(self, stream_id, reader)
        self._streams[stream_id] = entry
        return entry

    def _send_finished(self, writer: MeshStreamWriter) -> None:
        writer.finished = True
        self._forget_if_done(writer.stream_id)

    def _forget_if_done(self, stream_id: int) -> None:
        entry = self._streams.get(stream_id)
        if entry is not None and entry[0].finished and entry[1].finished:
            del self._streams[stream_id]

    def _grant(self, stream_id: int, consumed: int) -> None:
        if self.close_reason is None and self._quic.grant_window(stream_id, consumed):
            self._transmit_soon()

    def _stop_receiving(self, stream_id: int, error_code: int) -> None:
        if self.close_reason is None:
            self._quic.stop_stream(stream_id, error_code)
            self._transmit_soon()

    def _abort_stream(self, writer: MeshStreamWriter, error_code: int) -> None:
        if self.close_reason is not None:
            return
        self._quic.reset_stream(writer.stream_id, error_code)
        if not writer._reader.finished:
            self._stop_receiving(writer.stream_id, error_code)
        error = ConnectionResetError(f"stream aborted locally (code {error_code})")
        writer._reader._fail(error)
        writer._fail(error)
        self._send_finished(writer)
        self._transmit_soon()

    # tasks and teardown --------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = self._transport._spawn(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _keepalive(self) -> None:
        for uid in itertools.count():
            await asyncio.sleep(KEEPALIVE_INTERVAL_S)
            self._quic.send_ping(uid)
            self._pump()

    async def _serve_peer(self) -> None:
        try:
            await self._transport._on_peer(self)
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
        for reader, writer in self._streams.values():
            reader._fail(ConnectionResetError(f"connection to {self._name()} closed: {reason}"))
            writer._fail(ConnectionResetError(f"connection to {self._name()} closed: {reason}"))
        self._streams.clear()
        self._unclaimed.clear()
        self._blocked_writers.clear()
        self._control_ready.set()
        if not self._admitted and self._failure is None:
            self._failure = MeshError(f"closed before admission: {reason}")
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
        for connection_id in self._connection_ids:
            if self._transport._routes.get(connection_id) is self:
                del self._transport._routes[connection_id]
        self._transport._connections.discard(self)
        self._terminated.set()

    def _discard(self, reason: str) -> None:
        """Close and forget at once, without the closing period (dial gave up, node stopping)."""
        self.close(reason)
        self._finalize()

    def _check_open(self) -> None:
        if self.close_reason is not None:
            raise MeshError(f"connection to {self._name()} is closed: {self.close_reason}")

    def _name(self) -> str:
        address = self._quic.get_peer_address()
        where = _format_address(address) if address is not None else "unknown address"
        return f"{short_id(self.peer_id)} at {where}" if self.peer_id else where

    def __repr__(self) -> str:
        return f"<PeerConnection {self._name()}{' closed' if self.closed else ''}>"


# --- the endpoint ----------------------------------------------------------------


class _Endpoint(asyncio.DatagramProtocol):
    def __init__(self, transport: MeshTransport, sock: socket.socket) -> None:
        self._transport = transport
        self._sock = sock

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        # asyncio reads one datagram per loop iteration: take those waiting behind it too,
        # so each connection pumps once per batch (fewer wakeups, ACKs and timer changes).
        batch = [(data, addr)]
        while len(batch) < MAX_DATAGRAMS_PER_READ:
            try:
                batch.append(self._sock.recvfrom(MAX_UDP_PAYLOAD_BYTES))
            except OSError:  # nothing more waiting, or an ICMP error: as error_received
                break
        self._transport._datagrams_received(batch)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors (port unreachable, ...) tell nothing QUIC's own timers do not.
        logger.debug("UDP error: %s", exc)


class MeshTransport:
    """Listens and dials on one UDP port; hands each admitted connection to ``on_peer``."""

    def __init__(self, identity: NodeIdentity, mesh_secret: bytes, on_peer: PeerHandler) -> None:
        if len(mesh_secret) != auth.MESH_SECRET_BYTES:
            raise UsageError(f"the mesh secret must be {auth.MESH_SECRET_BYTES} bytes, not {len(mesh_secret)}")
        self._identity = identity
        self._secret = mesh_secret
        self._on_peer = on_peer
        self._server_configuration = _quic_configuration(identity, is_client=False)
        self._client_configuration = _quic_configuration(identity, is_client=True)
        self._removed: set[bytes] = set()
        self._routes: dict[bytes, PeerConnection] = {}
        self._connections: set[PeerConnection] = set()
        self.ignored_datagrams = 0
        self._ignored_since_log = 0
        self._ignored_logged_at: float | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._sock: socket.socket | None = None
        self._gso = hasattr(socket, "SOL_UDP") and sys.platform == "linux"
        self._family = socket.AF_INET
        self._tasks: asyncio.TaskGroup | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._closed = False

    @property
    def node_id(self) -> bytes:
        return self._identity.node_id

    def set_secret(self, mesh_secret: bytes) -> None:
        """Admit new connections with this secret from now on; live ones stay."""
        if len(mesh_secret) != auth.MESH_SECRET_BYTES:
            raise ValueError(f"the mesh secret must be {auth.MESH_SECRET_BYTES} bytes")
        self._secret = mesh_secret

    def refuse_nodes(self, node_ids: Iterable[bytes]) -> None:
        """Never admit these node keys again, even with the right secret."""
        self._removed.update(node_ids)

    @property
    def connections(self) -> frozenset[PeerConnection]:
        """Every connection not yet terminated, admitted or not."""
        return frozenset(self._connections)

    async def start(self, host: str, port: int) -> int:
        """Bind the UDP port (0: any free one) and return its number."""
        self._loop = asyncio.get_running_loop()
        try:
            # Our own socket, not asyncio's wrapper of it: the endpoint reads batches, and sends with GSO.
            family, kind, proto, _, address = (await self._loop.getaddrinfo(
                host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE))[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.bind(address)
                self._udp, _ = await self._loop.create_datagram_endpoint(lambda: _Endpoint(self, sock), sock=sock)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"UDP port {port} on {host} is in use: stop the program using it or pick another port"
                ) from exc
            raise UsageError(f"cannot listen on UDP {host}:{port}: {exc.strerror or exc}") from exc
        self._sock = sock
        self._family = sock.family
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        path_mtu.set_dont_fragment(sock)
        started = self._loop.create_future()
        self._supervisor = asyncio.create_task(self._supervise(started), name="mesh-transport")
        await started
        return sock.getsockname()[1]

    async def connect(self, addresses: Sequence[Address], expected_id: bytes) -> PeerConnection:
        """Dial ``expected_id`` at each address in turn; the first admitted connection wins."""
        if self._closed or self._udp is None:
            raise MeshError("the transport is not running")
        failures: list[MeshError] = []
        for host, port in addresses:
            try:
                return await self._dial(host, port, expected_id)
            except MeshError as exc:
                failures.append(exc)
        if len(failures) == 1:
            raise failures[0]
        kind = AuthError if any(isinstance(f, AuthError) for f in failures) else MeshError
        tried = "; ".join(str(f) for f in failures) or "no addresses given"
        raise kind(f"could not connect to {short_id(expected_id)}: {tried}")

    async def close(self) -> None:
        """Close every connection, stop every task, release the port."""
        if self._closed:
            return
        self._closed = True
        for connection in list(self._connections):
            connection._discard("node shutting down")
        self._stopping.set()
        if self._supervisor is not None:
            await self._supervisor
        if self._udp is not None:
            self._udp.close()

    async def _supervise(self, started: asyncio.Future[None]) -> None:
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            started.set_result(None)
            await self._stopping.wait()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._tasks is not None
        return self._tasks.create_task(coroutine)

    async def _dial(self, host: str, port: int, expected_id: bytes) -> PeerConnection:
        where = _format_address((host, port))
        flags = socket.AI_V4MAPPED if self._family == socket.AF_INET6 else 0
        try:
            infos = await self._loop.getaddrinfo(host, port, family=self._family, type=socket.SOCK_DGRAM, flags=flags)
        except socket.gaierror as exc:
            raise MeshError(f"{where}: cannot resolve ({exc.strerror})") from exc
        now = self._loop.time()
        quic = _QuicConnection(configuration=self._client_configuration)
        nonce = secrets.token_bytes(auth.NONCE_BYTES)
        handshake = auth.ClientHandshake(self._identity, self._secret, expected_id, nonce, now)
        connection = PeerConnection(self, quic, handshake, initiator=True)
        self._add(connection, quic.host_cid)
        quic.connect(infos[0][4], now=now)
        connection._pump()
        try:
            async with asyncio.timeout(DIAL_TIMEOUT_S):
                await connection._settled.wait()
        except TimeoutError:
            connection._discard("no answer")
            raise MeshError(f"{where}: no answer within {DIAL_TIMEOUT_S:g} s") from None
        except asyncio.CancelledError:
            connection._discard("dial cancelled")
            raise
        if connection._failure is not None:
            failure = connection._failure
            raise type(failure)(f"{where}: {failure}") from failure
        return connection

    def _datagrams_received(self, batch: list[tuple[bytes, tuple]]) -> None:
        fed: dict[PeerConnection, None] = {}
        for data, addr in batch:
            if (connection := self._datagram_received(data, addr)) is not None:
                fed[connection] = None
        for connection in fed:
            connection._pump()

    def _datagram_received(self, data: bytes, addr: tuple) -> PeerConnection | None:
        """Route one datagram; the connection it was fed to, which the caller pumps."""
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=CONNECTION_ID_BYTES)
        except ValueError:
            self._ignore(addr, "not QUIC")
            return None
        connection = self._routes.get(header.destination_cid)
        if connection is not None:
            connection._datagram_received(data, addr)
            return connection
        if (
            header.packet_type == QuicPacketType.INITIAL
            and len(data) >= SMALLEST_MAX_DATAGRAM_SIZE
            and header.version in self._server_configuration.supported_versions
            and not self._closed
        ):
            self._accept(header.destination_cid, data, addr)
        else:
            self._ignore(addr, "not a connection of ours")
        return None

    def _ignore(self, addr: tuple, why: str) -> None:
        self.ignored_datagrams += 1
        self._ignored_since_log += 1
        now = self._loop.time()
        if self._ignored_logged_at is None or now - self._ignored_logged_at >= IGNORED_DATAGRAMS_LOG_INTERVAL_S:
            # Late packets of closed connections land here too, so this is not a warning.
            logger.info("ignored %d datagram(s) that belong to no connection here (the last from %s: %s)",
                        self._ignored_since_log, _format_address(addr), why)
            self._ignored_logged_at = now
            self._ignored_since_log = 0

    def _accept(self, original_connection_id: bytes, data: bytes, addr: tuple) -> None:
        waiting = sum(1 for c in self._connections if not c.initiator and not c._admitted)
        if waiting >= MAX_UNAUTHENTICATED_PEERS:
            logger.debug("dropped a new connection from %s: %d peers already authenticating", addr, waiting)
            return
        now = self._loop.time()
        quic = _QuicConnection(
            configuration=self._server_configuration,
            original_destination_connection_id=original_connection_id,
        )
        nonce = secrets.token_bytes(auth.NONCE_BYTES)
        handshake = auth.ServerHandshake(self._identity, self._secret, nonce, now)
        connection = PeerConnection(self, quic, handshake, initiator=False)
        self._add(connection, original_connection_id, quic.host_cid)
        quic.receive_datagram(data, addr, now=now)
        if not connection._pump():
            connection._shutdown("no client hello")  # nothing readable: forget it quietly
            connection._finalize()

    def _add(self, connection: PeerConnection, *connection_ids: bytes) -> None:
        self._connections.add(connection)
        for connection_id in connection_ids:
            connection._connection_ids.add(connection_id)
            self._routes[connection_id] = connection

    def _send_datagrams(self, datagrams: list[tuple[bytes, tuple]]) -> None:
        """Send in order; runs of equal-size datagrams to one address go as one GSO sendmsg()."""
        udp = self._udp
        if udp is None or udp.is_closing():
            return
        i = 0
        while i < len(datagrams):
            data, address = datagrams[i]
            size, end = len(data), i + 1
            if self._gso:
                while (end < len(datagrams) and end - i < GSO_MAX_SEGMENTS and (end - i + 1) * size <= GSO_MAX_BYTES
                       and datagrams[end][1] == address and len(datagrams[end - 1][0]) == size
                       and len(datagrams[end][0]) <= size):
                    end += 1
            if end - i == 1 or not self._send_segments([d for d, _ in datagrams[i:end]], size, address):
                for d, _ in datagrams[i:end]:
                    udp.sendto(d, address)
            i = end

    def _send_segments(self, segments: list[bytes], size: int, address: tuple) -> bool:
        """One sendmsg() with UDP_SEGMENT; False (send them one by one) if that cannot be done now."""
        assert self._udp is not None and self._sock is not None
        if self._udp.get_write_buffer_size():
            return False  # asyncio holds earlier datagrams: keep the order
        try:
            segment_size = [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))]
            self._sock.sendmsg([b"".join(segments)], segment_size, 0, address)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                return True  # too big for the link now: lost, and the black-hole check shrinks them
            self._gso = False
            logger.info("UDP segmentation offload unavailable (%s): one datagram per send from now on", exc)
            return False
        return True
