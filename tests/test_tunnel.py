"""Tunnels over real QUIC on loopback: TunnelListener (node A) -> serve_inbound_stream (node B).

Each test wires two MeshTransports in one process: A dials B; B's admitted connection
serves every stream A opens by connecting it to a local TCP target; A's TunnelListener
turns each TCP connection to its 127.0.0.1 port into one such stream. Clients are plain
asyncio TCP connections. Timeouts below are hang checks, not timing assertions.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import struct
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mesh_sidecar.wire import auth
from mesh_sidecar.identity import generate_identity
from mesh_sidecar.llama.launch import start_rpc_server
from mesh_sidecar.ports import LOOPBACK, free_tcp_port, loopback_client_uid, socket_owner_uid
from mesh_sidecar.net.connection import PeerConnection
from mesh_sidecar.net.transport import MeshTransport
from mesh_sidecar.net.tunnel import StreamKind, TunnelListener, serve_inbound_stream, serve_peer_stream

SECRET = b"t" * auth.MESH_SECRET_BYTES
HANG_S = 15.0  # a wait that only fails if something hangs
CHUNK = 64 * 1024
BULK = 20 * 1024 * 1024

RPC_HEADER = struct.Struct("<BQ")
U64 = struct.Struct("<Q")
HELLO_CMD, DEVICE_COUNT_CMD, GET_DEVICE_MEMORY_CMD = 14, 15, 11
HELLO_REQUEST = RPC_HEADER.pack(HELLO_CMD, 24) + bytes(24)  # protocol 7: caps[24], all zero
HELLO_REPLY_7 = U64.pack(28) + bytes([7, 0, 0, 0]) + bytes(24)  # size | major minor patch pad | caps


class Node:
    """A started transport whose on_peer queues each admitted connection and keeps it open."""

    def __init__(self) -> None:
        self.identity = generate_identity()
        self.peers: asyncio.Queue[PeerConnection] = asyncio.Queue()
        self.transport = MeshTransport(self.identity, SECRET, self._on_peer)
        self.port = 0

    async def _on_peer(self, peer: PeerConnection) -> None:
        await self.peers.put(peer)
        await peer.wait_closed()


@dataclass
class Mesh:
    """A and B admitted to each other, with A's tunnel listener leading to B's ``target_port``."""

    a: Node
    b: Node
    a_to_b: PeerConnection
    b_from_a: PeerConnection
    listener: TunnelListener
    target_port: int = 0

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert self.listener.port is not None
        return await asyncio.open_connection(LOOPBACK, self.listener.port)


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    a, b = Node(), Node()
    a.port = await a.transport.start(LOOPBACK, 0)
    b.port = await b.transport.start(LOOPBACK, 0)
    try:
        a_to_b = await a.transport.connect([(LOOPBACK, b.port)], b.identity.node_id)
        b_from_a = await asyncio.wait_for(b.peers.get(), HANG_S)
        assert b_from_a.peer_id == a.identity.node_id
        listener = TunnelListener(a_to_b)
        m = Mesh(a, b, a_to_b, b_from_a, listener)
        # The target port is read per stream, so a test may point it elsewhere later.
        b_from_a.set_stream_handler(
            lambda r, w: serve_peer_stream(r, w, {StreamKind.RPC: lambda r2, w2: serve_inbound_stream(
                r2, w2, m.target_port, lambda _peer: None, "A")}, "A")
        )
        port = await listener.start()
        assert port == listener.port and port > 0
        yield m
        await listener.close()
    finally:
        await a.transport.close()
        await b.transport.close()


@dataclass
class EchoServer:
    """A local TCP target. ``streaming``: echo as bytes arrive; else echo all after EOF, then close."""

    streaming: bool = True
    server: asyncio.Server | None = None
    port: int = 0
    received: list[int] = field(default_factory=list)  # bytes received per connection, on EOF
    eof_seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self, port: int = 0) -> int:
        self.server = await asyncio.start_server(self._handle, LOOPBACK, port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        total, held = 0, bytearray()
        try:
            while data := await reader.read(CHUNK):
                total += len(data)
                if self.streaming:
                    writer.write(data)
                    await writer.drain()
                else:
                    held += data
            self.received.append(total)
            self.eof_seen.set()
            writer.write(bytes(held))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    server = EchoServer()
    yield server
    await server.close()


async def read_to_end(reader: asyncio.StreamReader) -> tuple[bytes, str]:
    """Everything until the connection ends, and how: "eof" or "reset"."""
    data = bytearray()
    try:
        while chunk := await reader.read(CHUNK):
            data += chunk
    except ConnectionResetError:
        return bytes(data), "reset"
    return bytes(data), "eof"


async def send_all(writer: asyncio.StreamWriter, data: bytes) -> None:
    view = memoryview(data)
    for offset in range(0, len(data), CHUNK):
        writer.write(view[offset : offset + CHUNK])
        await writer.drain()
    writer.write_eof()


async def hash_to_end(reader: asyncio.StreamReader) -> tuple[str, int]:
    digest, n = hashlib.sha256(), 0
    while chunk := await reader.read(CHUNK):
        digest.update(chunk)
        n += len(chunk)
    return digest.hexdigest(), n


async def echo_round_trip(m: Mesh, payload: bytes) -> None:
    """One tunnel connection sends ``payload`` and must get exactly it back, then EOF."""
    reader, writer = await m.connect()
    writer.write(payload)
    writer.write_eof()
    data, how = await asyncio.wait_for(read_to_end(reader), HANG_S)
    writer.close()
    assert (data, how) == (payload, "eof")


def assert_connected(m: Mesh) -> None:
    assert not m.a_to_b.closed and not m.b_from_a.closed
    assert m.a_to_b in m.a.transport.connections and m.b_from_a in m.b.transport.connections


# --- 1. a real ggml-rpc-server ---------------------------------------------------


@pytest.mark.slow
async def test_real_rpc_server_answers_through_the_tunnel(mesh: Mesh, binaries, tmp_path: Path) -> None:
    port = free_tcp_port()
    rpc_server = await start_rpc_server(binaries, port, tmp_path)
    try:
        mesh.target_port = port
        reader, writer = await mesh.connect()

        writer.write(HELLO_REQUEST)
        reply = await asyncio.wait_for(reader.readexactly(8 + 28), HANG_S)
        assert U64.unpack_from(reply)[0] == 28
        assert reply[8:11] == bytes([7, 0, 0]), reply.hex()

        writer.write(RPC_HEADER.pack(DEVICE_COUNT_CMD, 0))
        reply = await asyncio.wait_for(reader.readexactly(8 + 4), HANG_S)
        size, count = struct.unpack("<QI", reply)
        assert size == 4 and count >= 1

        writer.write(RPC_HEADER.pack(GET_DEVICE_MEMORY_CMD, 4) + struct.pack("<I", 0))
        reply = await asyncio.wait_for(reader.readexactly(8 + 16), HANG_S)
        size, free, total = struct.unpack("<QQQ", reply)
        assert size == 16 and total > 0 and free <= total

        writer.write_eof()
        rest, _ = await asyncio.wait_for(read_to_end(reader), HANG_S)
        assert rest == b""
        writer.close()

        sent = len(HELLO_REQUEST) + 9 + 13
        assert mesh.listener.counters.bytes_to_peer == sent
        assert mesh.listener.counters.bytes_from_peer == 36 + 12 + 24
        assert mesh.listener.counters.streams == 1
        assert rpc_server.running
    finally:
        await rpc_server.stop()


# --- 2. bulk ---------------------------------------------------------------------


async def test_20_mb_cross_the_tunnel_and_back_unchanged(mesh: Mesh, echo: EchoServer) -> None:
    mesh.target_port = await echo.start()
    payload = b"\xff" + os.urandom(BULK - 1)  # first byte is no RPC HELLO: the filter passes it all
    reader, writer = await mesh.connect()
    (digest, n), _ = await asyncio.wait_for(asyncio.gather(hash_to_end(reader), send_all(writer, payload)), 60)
    writer.close()
    assert n == BULK
    assert digest == hashlib.sha256(payload).hexdigest()
    assert echo.received == [BULK]
    counters = mesh.listener.counters
    assert (counters.bytes_to_peer, counters.bytes_from_peer, counters.streams) == (BULK, BULK, 1)
    assert_connected(mesh)


# --- 3. half-close ---------------------------------------------------------------


async def test_half_close_reaches_the_target_and_the_reply_still_comes_back(mesh: Mesh) -> None:
    echo = EchoServer(streaming=False)  # answers only after it has seen EOF
    mesh.target_port = await echo.start()
    try:
        payload = b"\x01half-close " + os.urandom(300_000)
        reader, writer = await mesh.connect()
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        await asyncio.wait_for(echo.eof_seen.wait(), HANG_S)
        assert echo.received == [len(payload)]  # EOF came after every byte
        data, how = await asyncio.wait_for(read_to_end(reader), HANG_S)
        assert how == "eof"
        assert data == payload
        assert await reader.read(1) == b""
        writer.close()
        assert mesh.listener.counters.bytes_to_peer == len(payload)
        assert mesh.listener.counters.bytes_from_peer == len(payload)
    finally:
        await echo.close()


# --- 4. peer loss ----------------------------------------------------------------


@pytest.mark.parametrize("lose", ["transport", "connection"])
async def test_peer_loss_ends_open_tunnel_connections(
    mesh: Mesh, echo: EchoServer, lose: str, caplog: pytest.LogCaptureFixture
) -> None:
    mesh.target_port = await echo.start()
    reader, writer = await mesh.connect()
    ping = b"\x02ping-through-the-tunnel"  # over 9 bytes: the RPC filter passes a whole header on
    writer.write(ping)
    assert await asyncio.wait_for(reader.readexactly(len(ping)), HANG_S) == ping  # the stream is live
    idle = asyncio.create_task(read_to_end(reader))
    await asyncio.sleep(0.2)
    assert not idle.done()  # waiting in read()

    if lose == "transport":
        await mesh.b.transport.close()
    else:
        mesh.b_from_a.close("test: peer going away")
    data, how = await asyncio.wait_for(idle, HANG_S)
    assert data == b""
    assert how in ("eof", "reset")
    await asyncio.wait_for(mesh.a_to_b.wait_closed(), HANG_S)
    assert mesh.a_to_b.closed
    writer.close()

    # A connection made after the loss but before the listener closes ends at once, cleanly.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        reader2, writer2 = await mesh.connect()
        writer2.write(HELLO_REQUEST)
        data, how = await asyncio.wait_for(read_to_end(reader2), HANG_S)
        writer2.close()
        await asyncio.sleep(0)
    assert data == b""
    assert how in ("eof", "reset")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]

    port = mesh.listener.port
    await mesh.listener.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(LOOPBACK, port)


# --- 5. target unreachable ---------------------------------------------------------


async def test_unreachable_target_resets_the_connection_and_the_tunnel_survives(
    mesh: Mesh, echo: EchoServer
) -> None:
    mesh.target_port = free_tcp_port()  # nothing listens there
    reader, writer = await mesh.connect()
    writer.write(HELLO_REQUEST)  # the far side connects when the stream's first bytes arrive
    data, how = await asyncio.wait_for(read_to_end(reader), HANG_S)
    writer.close()
    assert data == b""
    assert how in ("eof", "reset")  # asyncio's abort() sends FIN when nothing is left unread
    assert_connected(mesh)

    await echo.start(mesh.target_port)  # now something listens at the same port
    await echo_round_trip(mesh, b"\x03after " + os.urandom(10_000))
    assert mesh.listener.counters.streams == 2
    assert_connected(mesh)


# --- 6. oversized RPC frame -------------------------------------------------------


@dataclass
class FakeRpcServer:
    """Answers a protocol-7 HELLO like ggml-rpc-server, then echoes raw bytes; records what it got."""

    server: asyncio.Server | None = None
    received: list[bytes] = field(default_factory=list)  # per connection, when it ends
    ended: asyncio.Queue[str] = field(default_factory=asyncio.Queue)

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, LOOPBACK, 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got, how = bytearray(), "eof"
        try:
            hello = await reader.readexactly(len(HELLO_REQUEST))
            got += hello
            if hello != HELLO_REQUEST:
                how = "bad hello"
                return
            writer.write(HELLO_REPLY_7)
            await writer.drain()
            while data := await reader.read(CHUNK):
                got += data
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            how = f"error: {type(exc).__name__}"
        finally:
            self.received.append(bytes(got))
            await self.ended.put(how)
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_oversized_rpc_frame_closes_only_its_stream(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "mesh_sidecar.net.tunnel")
    fake = FakeRpcServer()
    mesh.target_port = await fake.start()
    try:
        reader, writer = await mesh.connect()
        writer.write(HELLO_REQUEST)
        assert await asyncio.wait_for(reader.readexactly(len(HELLO_REPLY_7)), HANG_S) == HELLO_REPLY_7
        writer.write(RPC_HEADER.pack(DEVICE_COUNT_CMD, 2**62))  # a 4 EiB payload: no real frame
        data, how = await asyncio.wait_for(read_to_end(reader), HANG_S)
        writer.close()
        assert data == b""
        assert how in ("eof", "reset")
        # The target saw the HELLO and nothing of the bad frame, then lost its connection.
        assert await asyncio.wait_for(fake.ended.get(), HANG_S) in ("eof", "error: ConnectionResetError")
        assert fake.received == [HELLO_REQUEST]
        # One line on the serving side names the peer and the reason; the connection stays.
        warnings = [r.getMessage() for r in caplog.records if r.name == "mesh_sidecar.net.tunnel"]
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith("tunnel from A closed: ") and "limit" in warnings[0]
        assert_connected(mesh)

        # The mesh connection is intact: a second tunnel connection talks RPC normally.
        reader, writer = await mesh.connect()
        writer.write(HELLO_REQUEST)
        assert await asyncio.wait_for(reader.readexactly(len(HELLO_REPLY_7)), HANG_S) == HELLO_REPLY_7
        frame = RPC_HEADER.pack(DEVICE_COUNT_CMD, 0)
        writer.write(frame)
        assert await asyncio.wait_for(reader.readexactly(len(frame)), HANG_S) == frame
        writer.write_eof()
        data, how = await asyncio.wait_for(read_to_end(reader), HANG_S)
        writer.close()
        assert (data, how) == (b"", "eof")
        assert await asyncio.wait_for(fake.ended.get(), HANG_S) == "eof"
        assert fake.received[1] == HELLO_REQUEST + frame
        assert mesh.listener.counters.streams == 2
        assert_connected(mesh)
    finally:
        await fake.close()


# --- who may use a tunnel port ------------------------------------------------------------

PROC_TABLE = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A3C2 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1001        0 51234 1
   1: 0100007F:1F90 0100007F:A3C2 01 00000000:00000000 00:00000000 00000000     0        0 51235 1
"""


def test_socket_owner_uid_reads_the_client_side_row():
    client, server = ("127.0.0.1", 0xA3C2), ("127.0.0.1", 0x1F90)
    assert socket_owner_uid(PROC_TABLE, client, server) == 1001
    assert socket_owner_uid(PROC_TABLE, server, client) == 0
    assert socket_owner_uid(PROC_TABLE, client, ("127.0.0.1", 1)) is None


def test_loopback_client_uid_of_a_real_connection_is_ours():
    with socket.create_server((LOOPBACK, 0)) as server, socket.create_connection(server.getsockname()):
        accepted, peer = server.accept()
        with accepted:
            assert loopback_client_uid(peer, accepted.getsockname()) == os.getuid()


# bash's /dev/tcp, not Python: the user running the tests may keep its interpreter (a venv, pyenv)
# in a home that uid 65534 cannot enter. Prints "closed: " when the port hangs up without a byte.
OTHER_USER_CONNECT = (
    'exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 3; printf hello >&3; '
    'if IFS= read -r -t 10 -n 16 reply <&3; then echo "reply: $reply"; '
    'elif [ $? -gt 128 ]; then echo timeout; else echo "closed: $reply"; fi'
)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
async def test_tunnel_port_refuses_other_local_users(mesh: Mesh, echo: EchoServer, caplog) -> None:
    caplog.set_level(logging.WARNING, "mesh_sidecar.net.tunnel")
    mesh.target_port = await echo.start()
    assert mesh.listener.port is not None
    result = await asyncio.to_thread(
        subprocess.run, ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                         "/bin/bash", "-c", OTHER_USER_CONNECT, "other-user", str(mesh.listener.port)],
        capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "closed: \n", result.stdout
    assert echo.received == [] and mesh.listener.counters.streams == 0
    assert any("owned by uid 65534" in r.getMessage() for r in caplog.records)
    await echo_round_trip(mesh, b"our own user still gets through")


async def test_stream_of_unknown_kind_is_closed(mesh: Mesh, echo: EchoServer, caplog) -> None:
    caplog.set_level(logging.WARNING, "mesh_sidecar.net.tunnel")
    mesh.target_port = await echo.start()
    reader, writer = await mesh.a_to_b.open_stream()
    writer.write(bytes([99]) + b"anything")
    data, how = await asyncio.wait_for(read_to_end(reader), HANG_S)
    assert data == b"" and echo.received == []
    assert any("unknown kind 99" in r.getMessage() for r in caplog.records)
    await echo_round_trip(mesh, b"the tunnel still works")
