"""The QUIC library adapter: aioquic or qh3 1.x, with receive windows that grow only as we allow.

This is the only module that imports a QUIC library: aioquic, or qh3 1.x (a fork
with the same API and Rust parts) when MESH_QUIC=qh3. The rest of the package
sees ``QuicConnection`` (the chosen library's connection plus what we add:
``admit``, ``grant_window``, ``unsent_bytes``, ``peer_node_id``, datagram size
probes), ``quic_configuration``, ``parse_header``/``opens_connection`` for
routing datagrams, and ``events``, the library's event classes.

TLS, the first step of admission: the server presents the self-signed
certificate of its node key and the client checks that key is the id it
dialed. aioquic has no API to ask for a client certificate, so the client's
key is proved later, on the control stream (connection.py).

Receive windows. aioquic doubles receive windows as data arrives rather than as
it is read. Here a stream's window is granted as its reader consumes (bytes
read + STREAM_RECEIVE_WINDOW_BYTES), so at most that much waits in a reader. An
unadmitted peer gets a connection window of PRE_AUTH_RECEIVE_WINDOW_BYTES; it
opens to CONNECTION_RECEIVE_WINDOW_BYTES on admission and then grows as
aioquic's does; stream windows bound it.

Library internals we override or read (no public API does these), as checked
against aioquic 1.7.2 and qh3 1.9.4; a new version of either must be read
against this table:

    library  internal                                       why
    aioquic  QuicPacketPacer.update_rate, bucket_max        a full bucket releases one GSO batch (_BurstPacer)
    aioquic  _loss._pacer                                   connections use _BurstPacer
    aioquic  _write_connection_limits, _local_max_data      no connection window doubling before admission
    aioquic  _write_stream_limits, receiver.highest_offset  stream windows move only as readers consume
    both     _local_max_data.value                          admit: open the connection window
    both     _streams, max_stream_data_local                grant_window: credit as a reader consumes
    aioquic  sender._buffer_stop, sender.highest_offset     unsent_bytes: send-side water marks (issue #328)
    qh3      sender.highest_offset                          unsent_bytes: what we count as written, less it
    aioquic  tls._peer_certificate                          peer_node_id: the key the server's TLS proved
    both     _loss._rtt_smoothed, _rtt_initialized          smoothed_rtt, for status
    aioquic  _max_datagram_size, _cc, _pacer sizes          set_datagram_size: probed sizes (path_mtu.py)
    aioquic  _loss._pto_count                               probe_timeouts: black-hole detection
    aioquic  packet builder state, _loss.on_packet_sent     datagram_size_probe: a padded PING out of flight
    qh3      datagrams_to_send, _streams_dirty_limits       it doubles windows inline in _write_application
    qh3      _handle_data_blocked_frame                     it doubles the connection window on DATA_BLOCKED
    qh3      _handle_stream_data_blocked_frame              ... and a stream's on STREAM_DATA_BLOCKED
    qh3      _network_paths                                 get_peer_address, which qh3 lacks
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from .. import environment
from ..errors import AuthError
from ..identity import NodeIdentity, node_id_of_certificate
from ..units import KIB, MIB
from .endpoint import GSO_MAX_SEGMENTS
from .path_mtu import BASE_DATAGRAM_BYTES

# The QUIC library, chosen once per process: aioquic, or qh3 1.x (MESH_QUIC=qh3).
QUIC_LIBRARY = environment.quic_library()
if QUIC_LIBRARY == "aioquic":
    from aioquic import tls
    from aioquic.buffer import Buffer
    from aioquic.quic import events  # connection.py reads the events from here
    from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
    from aioquic.quic.connection import QuicConnection as _LibraryConnection
    from aioquic.quic.packet import QuicFrameType, QuicPacketType, pull_quic_header
    from aioquic.quic.packet_builder import QuicDeliveryState, QuicPacketBuilder
    from aioquic.quic.recovery import K_MICRO_SECOND, QuicPacketPacer
elif QUIC_LIBRARY == "qh3":
    # The type checker reads the aioquic branch: qh3's names stand in for the same ones.
    from qh3._hazmat import Buffer  # type: ignore[no-redef]
    from qh3.quic import events  # type: ignore[no-redef]  # noqa: F401 (connection.py reads them here)
    from qh3.quic.configuration import QuicConfiguration  # type: ignore[no-redef]
    from qh3.quic.connection import QuicConnection as _LibraryConnection  # type: ignore[no-redef]
    from qh3.quic.packet import QuicPacketType, pull_quic_header  # type: ignore[no-redef]
    from qh3.tls import SignatureAlgorithm, load_pem_private_key, load_pem_x509_certificates

    SMALLEST_MAX_DATAGRAM_SIZE = 1200  # RFC 9000 14.1
    if not hasattr(_LibraryConnection, "_write_application"):
        # qh3 2: a native core that opens receive windows itself as data arrives, read or not.
        raise ImportError("MESH_QUIC=qh3 needs qh3 1.x: qh3 2 grants flow-control credit by itself, so a "
                          "peer could make this node buffer without bound; install 'qh3<2' or use aioquic")
else:
    raise ImportError(f"MESH_QUIC={QUIC_LIBRARY!r}: the QUIC library must be aioquic or qh3")
if TYPE_CHECKING:
    from aioquic.quic.packet import QuicHeader
    from aioquic.quic.recovery import QuicPacketSpace
    from aioquic.quic.stream import QuicStream

ALPN = "mesh-inference/1"
IDLE_TIMEOUT_S = 10.0
MAX_DATAGRAM_BYTES = BASE_DATAGRAM_BYTES  # until a bigger size is probed (path_mtu.py)
CONNECTION_ID_BYTES = 8
PACING_BURST_DATAGRAMS = GSO_MAX_SEGMENTS  # what a full pacing bucket may send at once (_BurstPacer)
STREAM_RECEIVE_WINDOW_BYTES = 1 * MIB
WINDOW_GRANT_STEP_BYTES = STREAM_RECEIVE_WINDOW_BYTES // 4  # fewer MAX_STREAM_DATA frames
CONNECTION_RECEIVE_WINDOW_BYTES = 16 * MIB
PRE_AUTH_RECEIVE_WINDOW_BYTES = 4 * KIB


def quic_configuration(identity: NodeIdentity, *, is_client: bool) -> QuicConfiguration:
    """The settings of every connection this node makes (client) or accepts (server)."""
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


def parse_header(data: bytes) -> QuicHeader:
    """A datagram's QUIC header (destination_cid, packet_type, version); ValueError if it is not QUIC."""
    return pull_quic_header(Buffer(data=data), host_cid_length=CONNECTION_ID_BYTES)


def opens_connection(header: QuicHeader, datagram_bytes: int, configuration: QuicConfiguration) -> bool:
    """True for an Initial packet a server with ``configuration`` may answer with a new connection."""
    return (header.packet_type == QuicPacketType.INITIAL
            and datagram_bytes >= SMALLEST_MAX_DATAGRAM_SIZE
            and header.version in configuration.supported_versions)


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
            # aioquic 1.7.2 computes bucket_max here with a fixed 16 datagrams: recompute it after.
            super().update_rate(congestion_window, smoothed_rtt)
            rate = congestion_window / max(smoothed_rtt, K_MICRO_SECOND)
            burst = min(congestion_window // 2, PACING_BURST_DATAGRAMS * self._max_datagram_size)
            self.bucket_max = max(2 * self._max_datagram_size, burst) / rate
            self.bucket_time = min(self.bucket_time, self.bucket_max)


class _Quic(_LibraryConnection):
    """aioquic's connection, with receive windows that grow only as we allow."""

    _admitted = False
    paces_in_bursts = True  # _BurstPacer

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.paces_in_bursts:
            # aioquic 1.7.2 builds its pacer inside the recovery object, with no hook to pick another.
            self._loss._pacer = _BurstPacer(max_datagram_size=self._max_datagram_size)

    def _write_connection_limits(self, builder: QuicPacketBuilder, space: QuicPacketSpace) -> None:
        if self._admitted:
            super()._write_connection_limits(builder, space)
            return
        # aioquic 1.7.2 doubles _local_max_data here once half of it is used: before admission,
        # hide arrivals from it, so an unadmitted peer never gets more than the pre-auth window.
        limit = self._local_max_data
        used, limit.used = limit.used, 0
        try:
            super()._write_connection_limits(builder, space)
        finally:
            limit.used = used

    def _write_stream_limits(self, builder: QuicPacketBuilder, space: QuicPacketSpace, stream: QuicStream) -> None:
        # aioquic 1.7.2 doubles a stream's window here as data arrives (receiver.highest_offset),
        # read or not: hidden, so stream windows move only in grant_window(), as readers consume.
        highest, stream.receiver.highest_offset = stream.receiver.highest_offset, 0
        try:
            super()._write_stream_limits(builder, space, stream)
        finally:
            stream.receiver.highest_offset = highest

    def admit(self) -> None:
        """Open the connection window once the peer is admitted."""
        self._admitted = True
        # aioquic 1.7.2 and qh3 1.9.4 have no API to raise MAX_DATA: set the limit they send.
        limit = self._local_max_data
        limit.value = max(limit.value, limit.used + CONNECTION_RECEIVE_WINDOW_BYTES)

    def grant_window(self, stream_id: int, consumed: int) -> bool:
        """Let the peer send up to ``consumed`` + one window; True if that is news to send."""
        # aioquic 1.7.2 and qh3 1.9.4 keep a stream's receive limit in max_stream_data_local.
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
        # aioquic 1.7.2 buffers all it is given (its issue #328) and does not say how much:
        # its sender's buffer end less what has gone out.
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        return stream.sender._buffer_stop - stream.sender.highest_offset

    def peer_node_id(self) -> bytes:
        """The node id in the peer's TLS certificate."""
        certificate = self.tls._peer_certificate  # aioquic 1.7.2 exposes the peer's certificate nowhere else
        if certificate is None:
            raise AuthError("peer presented no certificate")
        return node_id_of_certificate(certificate)

    def smoothed_rtt(self) -> float | None:
        """Smoothed round-trip time in seconds, None before the first sample."""
        recovery = self._loss  # aioquic 1.7.2 and qh3 1.9.4 keep it private to loss recovery
        return recovery._rtt_smoothed if recovery._rtt_initialized else None

    # Datagram size (path_mtu.py): aioquic sends what it was configured with and has no probes.
    probes_datagram_size = True

    @property
    def datagram_size(self) -> int:
        return self._max_datagram_size

    def set_datagram_size(self, size: int) -> None:
        # aioquic 1.7.2 copies the configured size into the connection, congestion control
        # (the window grows by it) and the pacer; all three change together.
        self._max_datagram_size = size
        self._loss._cc._max_datagram_size = size  # type: ignore[attr-defined]  # its Reno and Cubic have it
        self._loss._pacer._max_datagram_size = size

    def probe_timeouts(self) -> int:
        """Loss recovery's probe timeouts in a row: nothing sent since has been acknowledged."""
        return self._loss._pto_count  # aioquic 1.7.2: private to loss recovery

    def datagram_size_probe(self, size: int, now: float,
                            on_result: Callable[[int, bool], None]) -> list[tuple[bytes, tuple]]:
        """One PING padded to ``size`` bytes; ``on_result(size, acknowledged)`` once its fate is known.

        The probe is kept out of bytes in flight, so its loss (the likely outcome of a size too
        big) does not shrink the congestion window (RFC 8899 section 3).
        """
        # aioquic 1.7.2 has no probe API: build the packet as its _write_application does, from
        # its packet-number, key, path and logger state, and register it with loss recovery.
        builder = QuicPacketBuilder(
            host_cid=self.host_cid, is_client=self._is_client, max_datagram_size=size,
            packet_number=self._packet_number, peer_cid=self._peer_cid.cid, quic_logger=self._quic_logger,
            spin_bit=self._spin_bit, version=self._version,  # type: ignore[arg-type]  # set once connected
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
        configuration.signature_algorithms = [SignatureAlgorithm.ED25519]  # type: ignore[attr-defined]  # qh3's
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
        # qh3 1.9.4 doubles windows inside _write_application, for the streams in _streams_dirty_limits
        # and for _local_max_data, with no hook between: hide arrivals from it around the whole call,
        # as _Quic's hooks do for aioquic.
        hidden = [(stream.receiver, stream.receiver.highest_offset)
                  for stream in self._streams_dirty_limits]  # type: ignore[attr-defined]  # qh3's
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

    # qh3 1.9.4 also doubles a window when the peer says it is blocked by it: undo that.

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
        # qh3 1.9.4 sends MAX_STREAM_DATA only for the streams in _streams_dirty_limits.
        self._streams_dirty_limits.add(self._streams[stream_id])  # type: ignore[attr-defined]  # qh3's
        return True

    def unsent_bytes(self, stream_id: int) -> int:
        # qh3 1.9.4's native sender has no _buffer_stop: our own count, less its highest_offset.
        stream = self._streams.get(stream_id)
        if stream is None:
            self._written.pop(stream_id, None)
            return 0
        return self._written.get(stream_id, 0) - stream.sender.highest_offset

    def peer_node_id(self) -> bytes:
        certificate = self.get_peercert()  # type: ignore[attr-defined]  # qh3's
        if certificate is None:
            raise AuthError("peer presented no certificate")
        return node_id_of_certificate(x509.load_der_x509_certificate(certificate.public_bytes()))

    def get_peer_address(self) -> tuple | None:
        # qh3 1.9.4 has no get_peer_address (aioquic 1.7.2 does): the same, from its network paths.
        return self._network_paths[0].addr if self._network_paths else None


# The connection class for the library in use: what the transport creates for each connection.
if TYPE_CHECKING:
    QuicConnection = _Quic  # the type callers see: qh3's connection is one
else:
    QuicConnection = _Qh3Quic if QUIC_LIBRARY == "qh3" else _Quic
