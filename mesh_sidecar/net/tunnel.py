"""Tunnels: local TCP ports that lead to a peer's rpc-server over QUIC streams.

    serving node                                 peer P
    llama-server --TCP--> 127.0.0.1:<port for P>
                          TunnelListener  == QUIC stream ==>  serve_inbound_stream
                          (RpcOutputCheck on the replies)
                                                              RpcStreamFilter (REGISTER_PEER rewrite)
                                                              --TCP--> 127.0.0.1:<P's rpc-server>

One listener per peer, bound to 127.0.0.1. Each TCP connection to it becomes one
QUIC stream; the peer connects that stream to its own rpc-server and to nothing
else. The port outlives a connection that is replaced (``use``): connections
already relaying stay on their stream, new ones take the new connection. Bytes
relay both ways with backpressure (``drain`` on both kinds of writer) and
half-closes travel as FIN. When the peer is lost, the listener
closes and live connections are ended at once (reset when data was still in
flight), so llama-server gets an error, not a hang.

A tunnel's stream starts with the StreamKind.RPC byte (wire/stream_kind.py);
peer_streams.py hands it to ``serve_inbound_stream`` on the other side.

Given OutputChecks at construction (the serving node's, mesh/serving.py), a listener
asks them for a check on each connection it accepts; a check measures the float tensors
P's rpc-server returns and judges them by the output rule (wire/rpc_outputs.py; every place the
check acts: docs/architecture.md, "The output check") before llama-server reads them, and on a
fault (a corrupt tensor, or P breaking the RPC protocol, which would otherwise stop the check) the
listener keeps the reply back, resets the connection (llama-server aborts rather than
compute on garbage) and reports it through ``OutputChecks.rejected``, which blames P.

A listener also times how long the peer owes replies (reply_waits.py): when tokens stall,
that names the worker holding them up.

Two data paths: given a NativePath (mesh/data_paths.py), a listener first offers each accepted
connection to it, before a byte is read; when the peer's native relay is up (tcp+tls), the
connection's socket goes to the relay (net/data_plane/process.py), which relays, checks and times it
outside Python and reports counters and faults back. Otherwise, or when the relay is missing or
dead, the connection takes the QUIC stream as above. The port is the same either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import MeshError, WireError
from ..identity import short_id
from ..ports import LOOPBACK, loopback_client_uid
from ..wire.rpc_framing import RpcStreamFilter
from ..wire.rpc_outputs import CheckOff, OutputRejected, RpcOutputCheck
from ..wire.stream_kind import StreamKind
from .connection import PeerConnection
from .reply_waits import ReplyWaits
from .streams import MeshStreamReader, MeshStreamWriter

log = logging.getLogger(__name__)

RELAY_CHUNK_BYTES = 256 * 1024

Reader = asyncio.StreamReader | MeshStreamReader
Writer = asyncio.StreamWriter | MeshStreamWriter


class NativePath(Protocol):
    """The native data relay, as a tunnel listener offers it connections (mesh/data_paths.py)."""

    def hand_over(self, node_id: bytes, sock: socket.socket, check: bool, tunnel: TunnelListener) -> bool:
        """Relay ``sock`` (accepted, nothing read) to ``node_id`` natively; False: take the QUIC path."""
        ...


class OutputChecks(Protocol):
    """The serving node's check of what peers' rpc-servers return through their tunnels."""

    def check_for(self, node_id: bytes) -> RpcOutputCheck | None:
        """A check for one new tunnel connection to ``node_id``'s rpc-server, or None to relay unchecked."""
        ...

    def rejected(self, node_id: bytes, event: OutputRejected) -> None:
        """A reply from ``node_id`` failed its check; its tunnel connection is being reset."""
        ...


@dataclass
class TunnelCounters:
    """Bytes and RPC commands through one peer's tunnels (for status and metrics)."""

    bytes_to_peer: int = 0
    bytes_from_peer: int = 0
    streams: int = 0
    # The other way: streams the peer opened into our rpc-server (serve_inbound_stream).
    inbound_streams: int = 0
    inbound_bytes_from_peer: int = 0
    inbound_bytes_to_peer: int = 0
    rpc_commands: int = 0  # RPC frames the peer sent our rpc-server, HELLO included
    # Of the inbound bytes, those that moved a layer's output (rpc_framing.py): with --b2b they come
    # from the worker that computed it; without, from the serving node, which fetched it first.
    inbound_activation_bytes: int = 0
    # Buffers its open streams asked our rpc-server for: memory held for that peer's llama-server.
    inbound_held_bytes: int = 0


def _nodelay(writer: asyncio.StreamWriter) -> None:
    # RPC is a strict request/response protocol: Nagle would add a delay per command.
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _relay(reader: Reader, writer: Writer, count: Callable[[int], None],
                 observe: Callable[[bytes], None] | None = None) -> None:
    """Copy until EOF (showing each chunk to ``observe`` first), then half-close the other side."""
    while data := await reader.read(RELAY_CHUNK_BYTES):
        count(len(data))
        if observe is not None:
            observe(data)
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


def _abort(*writers: Writer) -> None:
    for writer in writers:
        if isinstance(writer, MeshStreamWriter):
            writer.abort()
        else:
            writer.transport.abort()


async def _run_pair(first, second, *writers: Writer) -> None:
    """Run both relay directions; any failure resets both connections."""
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(first)
            tg.create_task(second)
    except* (ConnectionError, OSError, asyncio.IncompleteReadError):
        _abort(*writers)
    else:
        for writer in writers:
            writer.close()


class OutputCheckFailed(ConnectionError):
    """A reply failed the output check; the tunnel connection is reset."""


async def _relay_checked(reader: Reader, writer: Writer, check: RpcOutputCheck,
                         on_rejected: Callable[[OutputRejected], None], count: Callable[[int], None]) -> None:
    """Copy the peer's replies through the output check until EOF, then half-close the other side."""
    while data := await reader.read(RELAY_CHUNK_BYTES):
        count(len(data))
        check.receive_from_server(data)
        if out := check.data_to_client():
            writer.write(out)
        while (event := check.next_event()) is not None:
            match event:
                case OutputRejected():
                    on_rejected(event)
                    raise OutputCheckFailed(event.fault.detail)
                case CheckOff(reason=reason):  # llama-server's doing, never the worker's
                    log.info("output check off for this tunnel connection: %s", reason)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


class TunnelListener:
    """127.0.0.1:<port> that leads to one peer's rpc-server."""

    def __init__(self, peer: PeerConnection, checks: OutputChecks | None = None,
                 native: NativePath | None = None) -> None:
        self.peer = peer
        self._checks = checks
        self._native = native
        self.counters = TunnelCounters()
        self.reply_waits = ReplyWaits()
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.native_connections: set[int] = set()  # handed to the native relay, not yet closed
        self._taken_back: set[asyncio.Task[None]] = set()  # connections the relay gave back, over QUIC
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Accepted(self), LOOPBACK, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def _accepted(self, transport: asyncio.Transport) -> bool:
        """A new connection, nothing read yet: refused, or handed to the native path (True: done here)."""
        # The port is on loopback, but any local user could connect and so reach a
        # peer's rpc-server: only our own user's processes (llama-server) may.
        client, server = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        if (uid := loopback_client_uid(client, server)) != os.getuid():
            log.warning("tunnel to %s: refused a local connection from %s:%d owned by uid %s, not ours (%d)",
                        short_id(self.peer.peer_id), client[0], client[1], uid, os.getuid())
            transport.abort()
            return True
        if self._native is None:
            return False
        node_id = self.peer.peer_id
        sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
        try:
            check = self._checks is not None and self._checks.check_for(node_id) is not None
            handed = self._native.hand_over(node_id, sock, check, self)
        finally:
            sock.close()  # the relay holds its own copy now
        if handed:
            self.counters.streams += 1
            transport.abort()  # only our descriptor closes: the connection lives on in the relay
        return handed

    def take_back(self, sock: socket.socket) -> None:
        """A connection the native relay gave back unread (the peer's relay did not answer): over QUIC."""
        self._idle.clear()
        task = asyncio.get_running_loop().create_task(self._carry_taken_back(sock))
        self._taken_back.add(task)
        task.add_done_callback(self._taken_back.discard)

    async def _carry_taken_back(self, sock: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
        await self._handle(reader, writer)

    def native_opened(self, conn_id: int) -> None:
        self.native_connections.add(conn_id)
        self._idle.clear()

    def native_closed(self, conn_id: int) -> None:
        self.native_connections.discard(conn_id)
        if not self._writers and not self.native_connections:
            self._idle.set()

    def use(self, peer: PeerConnection) -> None:
        """Open the streams of TCP connections accepted from now on over ``peer``."""
        self.peer = peer

    async def wait_idle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no connection runs through this tunnel."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass

    async def close(self) -> None:
        """Stop listening and end live connections at once (the peer is gone)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._taken_back):
            task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, tcp_reader: asyncio.StreamReader, tcp_writer: asyncio.StreamWriter) -> None:
        _nodelay(tcp_writer)
        self._writers.add(tcp_writer)
        self._idle.clear()
        try:
            try:
                quic_reader, quic_writer = await self.peer.open_stream()
            except (ConnectionError, MeshError) as exc:  # MeshError: the connection is closed
                log.warning("tunnel to %s: cannot open a stream (%s)", short_id(self.peer.peer_id), exc)
                tcp_writer.transport.abort()
                return
            self.counters.streams += 1
            quic_writer.write(bytes([StreamKind.RPC]))
            node_id, checks = self.peer.peer_id, self._checks
            check = checks.check_for(node_id) if checks is not None else None
            if checks is None or check is None:
                await _run_pair(
                    _relay(tcp_reader, quic_writer, self._count_out),
                    _relay(quic_reader, tcp_writer, self._count_in),
                    quic_writer, tcp_writer,
                )
                return

            def to_peer(data: bytes) -> None:
                check.receive_from_client(data)
                if check.replies_owed:  # commands with no reply (b2b's pushes) leave nothing owed
                    self.reply_waits.sent(time.monotonic())

            await _run_pair(
                _relay(tcp_reader, quic_writer, self._count_bytes_out, to_peer),
                _relay_checked(quic_reader, tcp_writer, check, lambda event: checks.rejected(node_id, event),
                               self._count_in),
                quic_writer, tcp_writer,
            )
        finally:
            self._writers.discard(tcp_writer)
            if not self._writers and not self.native_connections:
                self._idle.set()

    def count_native(self, to_peer_bytes: int, from_peer_bytes: int, owed_s: float, now: float) -> None:
        """What the native relay reports for one of this tunnel's connections (stats every 100 ms)."""
        self.counters.bytes_to_peer += to_peer_bytes
        self.counters.bytes_from_peer += from_peer_bytes
        if owed_s:
            self.reply_waits.owed(now - owed_s, now)

    def _count_bytes_out(self, n: int) -> None:
        self.counters.bytes_to_peer += n

    def _count_out(self, n: int) -> None:
        self._count_bytes_out(n)
        self.reply_waits.sent(time.monotonic())

    def _count_in(self, n: int) -> None:
        self.counters.bytes_from_peer += n
        self.reply_waits.received(time.monotonic())


class _Accepted(asyncio.StreamReaderProtocol):
    """A tunnel port's connection: offered to the native path before anything is read, else relayed here."""

    def __init__(self, listener: TunnelListener) -> None:
        super().__init__(asyncio.StreamReader(), listener._handle)
        self._listener = listener

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        # The transport starts reading only after this returns: a handed-over socket loses no byte.
        if not self._listener._accepted(transport):
            super().connection_made(transport)


async def serve_inbound_stream(
    quic_reader: MeshStreamReader,
    quic_writer: MeshStreamWriter,
    rpc_port: int,
    resolve_endpoint: Callable[[int], str | None],
    peer_name: str,
    *,
    counters: TunnelCounters | None = None,
) -> None:
    """Connect one stream from a peer to the local rpc-server, through the RPC filter.

    ``counters``, when given, gets this stream's inbound_* bytes and its rpc_commands.
    """
    try:
        tcp_reader, tcp_writer = await asyncio.open_connection(LOOPBACK, rpc_port)
    except OSError as exc:
        log.warning("tunnel from %s: local rpc-server unreachable (%s)", peer_name, exc)
        quic_writer.abort()
        return
    _nodelay(tcp_writer)
    rpc_filter = RpcStreamFilter(resolve_endpoint)
    counts = counters if counters is not None else TunnelCounters()
    counts.inbound_streams += 1
    frames_counted = activation_counted = held_counted = 0

    def forward_to_server() -> None:
        nonlocal frames_counted, activation_counted, held_counted
        counts.inbound_held_bytes += rpc_filter.allocated_bytes - held_counted
        held_counted = rpc_filter.allocated_bytes
        counts.rpc_commands += rpc_filter.frames_seen - frames_counted
        frames_counted = rpc_filter.frames_seen
        activation = rpc_filter.activation_bytes_to_server + rpc_filter.activation_bytes_from_server
        counts.inbound_activation_bytes += activation - activation_counted
        activation_counted = activation
        if out := rpc_filter.data_to_server():
            tcp_writer.write(out)
        while (event := rpc_filter.next_event()) is not None:
            log.info("tunnel from %s: %s", peer_name, event)

    async def client_to_server() -> None:
        while data := await quic_reader.read(RELAY_CHUNK_BYTES):
            counts.inbound_bytes_from_peer += len(data)
            rpc_filter.receive_from_client(data)
            forward_to_server()
            await tcp_writer.drain()
        tcp_writer.write_eof()

    async def server_to_client() -> None:
        while data := await tcp_reader.read(RELAY_CHUNK_BYTES):
            # The server's HELLO reply tells the filter the dialect; client
            # bytes it held until then are released now.
            counts.inbound_bytes_to_peer += len(data)
            rpc_filter.receive_from_server(data)
            forward_to_server()
            quic_writer.write(data)
            await quic_writer.drain()
        quic_writer.write_eof()

    try:
        await _run_pair(client_to_server(), server_to_client(), quic_writer, tcp_writer)
    except* WireError as group:
        log.warning("tunnel from %s closed: %s", peer_name, group.exceptions[0])
        _abort(quic_writer, tcp_writer)
    finally:
        counts.inbound_held_bytes -= held_counted  # rpc-server freed this client's buffers
