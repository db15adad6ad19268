"""Two transports in one process with a tunnel between them, a local echo target, and ggml RPC's
first messages: what the tunnel tests (tests/unit and tests/integration test_tunnel.py) run on.

A dials B over real QUIC on loopback; B's admitted connection serves every stream A opens by
connecting it to a local TCP target; A's TunnelListener turns each TCP connection to its 127.0.0.1
port into one such stream.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from mesh_sidecar.identity import generate_identity
from mesh_sidecar.net.connection import PeerConnection
from mesh_sidecar.net.peer_streams import serve_peer_stream
from mesh_sidecar.net.transport import MeshTransport
from mesh_sidecar.net.tunnel import TunnelListener, serve_inbound_stream
from mesh_sidecar.ports import LOOPBACK
from mesh_sidecar.wire import auth
from mesh_sidecar.wire.stream_kind import StreamKind

SECRET = b"t" * auth.MESH_SECRET_BYTES
HANG_S = 15.0  # a wait that only fails if something hangs
CHUNK = 64 * 1024

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


@asynccontextmanager
async def tunnel_mesh() -> AsyncIterator[Mesh]:
    """A and B admitted to each other over QUIC on loopback, A's tunnel listener started."""
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


@asynccontextmanager
async def echo_server() -> AsyncIterator[EchoServer]:
    """An EchoServer, not yet started (a test starts it on the port it wants), closed after."""
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


async def echo_round_trip(m: Mesh, payload: bytes) -> None:
    """One tunnel connection sends ``payload`` and must get exactly it back, then EOF."""
    reader, writer = await m.connect()
    writer.write(payload)
    writer.write_eof()
    data, how = await asyncio.wait_for(read_to_end(reader), HANG_S)
    writer.close()
    assert (data, how) == (payload, "eof")
