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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from mesh_sidecar.net.packet_relay import RelayCounters
from mesh_sidecar.net.peer_streams import StreamServices, serve_streams
from mesh_sidecar.net.tunnel import TunnelCounters, TunnelListener
from mesh_sidecar.ports import LOOPBACK, free_tcp_port, loopback_client_uid, socket_owner_uid
from mesh_sidecar.wire.rpc_outputs import GGML_TYPE_F32, NON_FINITE, Fault, OutputRejected, RpcOutputCheck
from tests.helpers.tunnels import (
    CHUNK,
    DEVICE_COUNT_CMD,
    HANG_S,
    HELLO_REPLY_7,
    HELLO_REQUEST,
    RPC_HEADER,
    EchoServer,
    Mesh,
    echo_round_trip,
    echo_server,
    read_to_end,
    tunnel_mesh,
)
from tests.unit.test_rpc_outputs import get_tensor, reply


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    async with tunnel_mesh() as m:
        yield m


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    async with echo_server() as server:
        yield server


BULK = 20 * 1024 * 1024


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


def assert_connected(m: Mesh) -> None:
    assert not m.a_to_b.closed and not m.b_from_a.closed
    assert m.a_to_b in m.a.transport.connections and m.b_from_a in m.b.transport.connections


# --- 1. bulk ---------------------------------------------------------------------


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


# --- 2. half-close ---------------------------------------------------------------


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


# --- 3. peer loss ----------------------------------------------------------------


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


# --- 4. target unreachable ---------------------------------------------------------


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


# --- 5. oversized RPC frame -------------------------------------------------------


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


async def test_stream_of_unknown_kind_is_closed(mesh: Mesh, echo: EchoServer, caplog) -> None:
    caplog.set_level(logging.WARNING, "mesh_sidecar.net.peer_streams")
    mesh.target_port = await echo.start()
    reader, writer = await mesh.a_to_b.open_stream()
    writer.write(bytes([99]) + b"anything")
    data, how = await asyncio.wait_for(read_to_end(reader), HANG_S)
    assert data == b"" and echo.received == []
    assert any("unknown kind 99" in r.getMessage() for r in caplog.records)
    await echo_round_trip(mesh, b"the tunnel still works")


# --- the serving node's output check ------------------------------------------------------


class RecordingChecks:
    """OutputChecks as the serving node gives them to a tunnel: a check per connection, rejections kept."""

    def __init__(self) -> None:
        self.asked: list[bytes] = []
        self.rejections: list[tuple[bytes, OutputRejected]] = []

    def check_for(self, node_id: bytes) -> RpcOutputCheck:
        self.asked.append(node_id)
        return RpcOutputCheck(lambda tensor: None if tensor.finite else Fault(NON_FINITE, "NaN or Inf"))

    def rejected(self, node_id: bytes, event: OutputRejected) -> None:
        self.rejections.append((node_id, event))


async def worker_answering(values: np.ndarray) -> asyncio.Server:
    """A stand-in rpc-server: answers HELLO, then one GET_TENSOR with ``values``, then waits."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in (HELLO_REPLY_7, reply(values.tobytes())):
            _, size = RPC_HEADER.unpack(await reader.readexactly(RPC_HEADER.size))
            await reader.readexactly(size)
            writer.write(answer)
            await writer.drain()
        await reader.read()
        writer.close()

    return await asyncio.start_server(serve, LOOPBACK, 0)


async def test_a_listener_checks_each_connection_with_the_checks_it_was_made_with(mesh: Mesh) -> None:
    nan = np.full(64, np.nan, dtype=np.float32)
    worker = await worker_answering(nan)
    mesh.target_port = worker.sockets[0].getsockname()[1]
    checks = RecordingChecks()
    listener = TunnelListener(mesh.a_to_b, checks)
    try:
        reader, writer = await asyncio.open_connection(LOOPBACK, await listener.start())
        writer.write(HELLO_REQUEST)
        assert await asyncio.wait_for(reader.readexactly(len(HELLO_REPLY_7)), HANG_S) == HELLO_REPLY_7
        writer.write(get_tensor(GGML_TYPE_F32, "l_out-3", nan.nbytes))
        data, how = await asyncio.wait_for(read_to_end(reader), HANG_S)
        writer.close()
        assert data == b"" and how in ("eof", "reset")  # the NaN reply never reaches llama-server
        (node_id, event), = checks.rejections
        assert checks.asked == [node_id] == [mesh.b.identity.node_id]
        assert event.fault.kind == NON_FINITE and event.tensor.name == "l_out-3"
    finally:
        await listener.close()
        worker.close()


# --- REGISTER_PEER: by the sending member's own rpc order ---------------------------------------

HELLO_REPLY_B2B = struct.pack("<Q", 28) + bytes([7, 0, 2, 1]) + bytes(24)


def register_peer(index: int, endpoint: bytes) -> bytes:
    return RPC_HEADER.pack(18, 132) + struct.pack("<I128s", index, endpoint)


async def test_a_members_register_peer_resolves_through_its_own_order_only(mesh: Mesh) -> None:
    """B serves A's streams as a node does (serve_streams): A's REGISTER_PEER indices are looked up in A's
    table, never in another member's, whatever that member announced."""
    received = bytearray()

    async def rpc_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, size = RPC_HEADER.unpack(await reader.readexactly(RPC_HEADER.size))
        await reader.readexactly(size)
        writer.write(HELLO_REPLY_B2B)
        await writer.drain()
        received.extend(await reader.read())
        writer.close()

    server = await asyncio.start_server(rpc_server, LOOPBACK, 0)
    a_id, other = mesh.a.identity.node_id, bytes(32)
    tables = {a_id: {1: "127.0.0.1:40001"}, other: {0: "127.0.0.1:40009"}}
    asked: list[bytes] = []

    def resolve(sender: bytes, index: int) -> str | None:
        asked.append(sender)
        return tables.get(sender, {}).get(index)

    services = StreamServices(server.sockets[0].getsockname()[1], resolve, lambda _sha: None,
                              None, RelayCounters(), None, lambda: None, "")  # type: ignore[arg-type]
    serve_streams(mesh.b_from_a, services, TunnelCounters())
    try:
        reader, writer = await mesh.connect()
        writer.write(HELLO_REQUEST)
        assert await asyncio.wait_for(reader.readexactly(len(HELLO_REPLY_B2B)), HANG_S) == HELLO_REPLY_B2B
        writer.write(register_peer(0, b"10.0.0.9:50052") + register_peer(1, b"10.0.0.8:50052"))
        writer.write_eof()
        await asyncio.wait_for(read_to_end(reader), HANG_S)
        writer.close()
    finally:
        server.close()
    assert bytes(received) == (register_peer(0, b"")  # index 0 is only in the other member's table: cleared
                               + register_peer(1, b"127.0.0.1:40001"))
    assert set(asked) == {a_id}
