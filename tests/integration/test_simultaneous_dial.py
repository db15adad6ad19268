"""Two connections between the same two members (both dialed at once): an RPC tunnel
already running keeps working, the tunnel port stays, and the extra connection goes
away once idle. Two real Meshes on loopback, a real ggml-rpc-server behind one."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from mesh_sidecar.llama.launch import start_rpc_server
from mesh_sidecar.mesh.runtime import Mesh
from mesh_sidecar.mesh.timings import MeshTimings
from mesh_sidecar.net.connection import PeerConnection
from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.wire import auth
from mesh_sidecar.wire.ticket import PeerAddress
from tests.helpers.meshes import HANG_S, make_mesh, row, ticket_of, wait_for
from tests.helpers.tunnels import DEVICE_COUNT_CMD, HELLO_REQUEST, RPC_HEADER

pytestmark = pytest.mark.slow

SECRET = b"s" * auth.MESH_SECRET_BYTES
QUICK_RETIRE = MeshTimings(retire_idle_s=0.5, retire_poll_s=0.1)


async def rpc_client(m: Mesh, peer: Mesh) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``peer``'s rpc-server through ``m``'s tunnel port, past HELLO."""
    host, port = m.tunnel_endpoint(peer.identity.node_id).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(HELLO_REQUEST)
    reply = await asyncio.wait_for(reader.readexactly(8 + 28), HANG_S)
    assert reply[8:11] == bytes([7, 0, 0]), reply.hex()
    return reader, writer


async def device_count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    writer.write(RPC_HEADER.pack(DEVICE_COUNT_CMD, 0))
    size, count = struct.unpack("<QI", await asyncio.wait_for(reader.readexactly(12), HANG_S))
    assert size == 4
    return count


def connections(m: Mesh, peer: Mesh) -> list[PeerConnection]:
    return [c for c in m._transport.connections if c.peer_id == peer.identity.node_id and not c.closed]


@pytest.mark.parametrize("second_dial_preferred", [True, False], ids=["replaces", "is-retired"])
async def test_a_second_connection_does_not_cut_a_running_tunnel(
        second_dial_preferred: bool, binaries, tmp_path: Path) -> None:
    rpc_port = free_tcp_port()
    rpc_server = await start_rpc_server(binaries, rpc_port, tmp_path)
    said: list[str] = []
    # Both ends keep the connection the lower id dialed. x joins y, then y dials x:
    # with x the higher id, y's dial replaces x's; with x the lower, y's is the extra one.
    low, high = sorted((make_mesh(tmp_path, name, SECRET, said.append, rpc_port=rpc_port, timings=QUICK_RETIRE)
                        for name in "pq"),
                       key=lambda m: m.identity.node_id)
    x, y = (high, low) if second_dial_preferred else (low, high)
    await x.start(0)
    await y.start(0)
    tasks = [asyncio.create_task(m.run()) for m in (x, y)]
    try:
        await x.join(ticket_of(y, SECRET))
        await wait_for(lambda: row(x, y).get("state") == "connected" and row(y, x).get("state") == "connected",
                       "x and y connected")
        (first,) = connections(x, y)
        endpoint = x.tunnel_endpoint(y.identity.node_id)
        reader, writer = await rpc_client(x, y)  # llama-server's connection, now running on `first`
        assert await device_count(reader, writer) >= 1
        assert first.open_streams == 1

        # y dials x while the first connection is up, as when both dial at once.
        assert x.port is not None
        await y._dialer.dial(x.identity.node_id, [PeerAddress("127.0.0.1", x.port)])
        await wait_for(lambda: len(connections(x, y)) == 2 and len(connections(y, x)) == 2,
                       "two connections on both sides")
        (second,) = [c for c in connections(x, y) if c is not first]
        assert second.preferred is second_dial_preferred
        kept, extra = (second, first) if second.preferred else (first, second)
        await wait_for(lambda: x._peers[y.identity.node_id].connection is kept, "x moves to the kept connection")

        # The running tunnel answers; the port is the one llama-server was given.
        assert await device_count(reader, writer) >= 1
        assert x.tunnel_endpoint(y.identity.node_id) == endpoint
        writer.close()  # rpc-server serves one client at a time: the next needs this one gone
        await wait_for(lambda: first.open_streams == 0, "the first tunnel connection ends")

        # A new tunnel connection takes the kept connection; the extra one closes once idle.
        reader, writer = await rpc_client(x, y)
        assert await device_count(reader, writer) >= 1
        assert kept.open_streams == 1
        await wait_for(lambda: extra.closed, "the extra connection closes once it carries nothing")
        assert not kept.closed
        assert await device_count(reader, writer) >= 1
        writer.close()
        assert connections(x, y) == [kept]
        assert row(x, y)["state"] == row(y, x)["state"] == "connected"
        assert not [m for m in said if m.startswith("Lost peer")], said
    finally:
        for task in tasks:
            task.cancel()
        await x.close(graceful=False)
        await y.close(graceful=False)
        await rpc_server.stop()
