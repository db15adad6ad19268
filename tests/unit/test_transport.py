"""MeshTransport over real QUIC on loopback UDP: admission, control, streams, teardown."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from mesh_sidecar.errors import AuthError, FrameTooLargeError, MeshError
from mesh_sidecar.identity import NodeIdentity, generate_identity
from mesh_sidecar.net import path_mtu, quic, streams
from mesh_sidecar.net.connection import PeerConnection
from mesh_sidecar.net.streams import MeshStreamReader, MeshStreamWriter
from mesh_sidecar.net.transport import MeshTransport
from mesh_sidecar.wire import auth, frames
from tests.helpers.stranger import Watcher, unauthenticated_client
from tests.helpers.waiting import wait_until_async

HOST = "127.0.0.1"
SECRET = b"s" * auth.MESH_SECRET_BYTES
CHUNK = 64 * 1024
BIG = 50 * 1024 * 1024
PROMPT_S = 2.0
WAIT_S = 10.0  # for a condition a busy machine may take a while to reach


class Node:
    """A started transport whose on_peer queues each admitted connection and keeps it open."""

    def __init__(self, secret: bytes = SECRET, identity: NodeIdentity | None = None, **limits: float) -> None:
        self.identity = identity or generate_identity()
        self.peers: asyncio.Queue[PeerConnection] = asyncio.Queue()
        # limits: MeshTransport's dial_timeout_s, auth_timeout_s, max_unauthenticated_peers.
        self.transport = MeshTransport(self.identity, secret, self._on_peer, **limits)
        self.port = 0

    @property
    def id(self) -> bytes:
        return self.identity.node_id

    async def _on_peer(self, peer: PeerConnection) -> None:
        await self.peers.put(peer)
        await peer.wait_closed()

    async def dial(self, other: Node) -> PeerConnection:
        return await self.transport.connect([(HOST, other.port)], other.id)

    async def next_peer(self) -> PeerConnection:
        return await asyncio.wait_for(self.peers.get(), PROMPT_S)


@pytest.fixture
async def make_node() -> AsyncIterator[Callable[..., Awaitable[Node]]]:
    nodes: list[Node] = []

    async def make(secret: bytes = SECRET, **limits: float) -> Node:
        node = Node(secret, **limits)
        node.port = await node.transport.start(HOST, 0)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        await node.transport.close()


async def test_nodes_admit_each_other_and_exchange_control(make_node) -> None:
    a, b = await make_node(), await make_node()
    outbound = await b.dial(a)
    inbound = await a.next_peer()
    assert await b.next_peer() is outbound  # on_peer sees outbound connections too
    assert (outbound.peer_id, outbound.initiator) == (a.id, True)
    assert (inbound.peer_id, inbound.initiator) == (b.id, False)
    assert inbound.remote_address == (HOST, b.port)

    outbound.send_control(b"hello a")
    inbound.send_control(b"hello b")
    inbound.send_control(b"")
    assert await inbound.receive_control() == b"hello a"
    assert await outbound.receive_control() == b"hello b"
    assert await outbound.receive_control() == b""
    assert outbound.rtt is not None and 0 < outbound.rtt < 1
    with pytest.raises(FrameTooLargeError):
        outbound.send_control(bytes(frames.MAX_CONTROL_MESSAGE_BYTES + 1))


async def test_simultaneous_dials_agree_on_one_connection(make_node) -> None:
    a, b = await make_node(), await make_node()
    a_to_b, b_to_a = await asyncio.gather(a.dial(b), b.dial(a))
    seen_by_b = {(await b.next_peer()).initiator: None for _ in range(2)}
    assert set(seen_by_b) == {True, False}
    # Exactly one of the two connections is kept, and it is the lower id's dial.
    assert a_to_b.preferred != b_to_a.preferred
    assert a_to_b.preferred == (a.id < b.id)


async def hash_reader(reader: MeshStreamReader, stall_at: int | None = None) -> str:
    digest, received, stalled = hashlib.sha256(), 0, False
    while chunk := await reader.read(CHUNK):
        digest.update(chunk)
        received += len(chunk)
        if stall_at is not None and received >= stall_at and not stalled:
            stalled = True  # a slow consumer: the sender must hold back, not buffer
            await asyncio.sleep(0.3)
    return digest.hexdigest()


async def send_all(writer: MeshStreamWriter, data: bytes) -> None:
    view = memoryview(data)
    for offset in range(0, len(data), CHUNK):
        writer.write(view[offset : offset + CHUNK])
        await writer.drain()
    writer.write_eof()


async def test_stream_carries_50_mb_both_ways_with_bounded_buffers(make_node) -> None:
    a, b = await make_node(), await make_node()
    outbound = await b.dial(a)
    inbound = await a.next_peer()
    up, down = os.urandom(BIG), os.urandom(BIG)
    served: asyncio.Future[tuple[str, MeshStreamReader, MeshStreamWriter]] = asyncio.get_running_loop().create_future()

    async def serve(reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        received, _ = await asyncio.gather(hash_reader(reader, stall_at=BIG // 2), send_all(writer, down))
        served.set_result((received, reader, writer))

    inbound.set_stream_handler(serve)
    reader, writer = await outbound.open_stream()
    received_down, _ = await asyncio.gather(hash_reader(reader, stall_at=BIG // 3), send_all(writer, up))
    received_up, far_reader, far_writer = await served

    assert received_up == hashlib.sha256(up).hexdigest()
    assert received_down == hashlib.sha256(down).hexdigest()
    for w in (writer, far_writer):
        assert w.peak_buffered <= streams.SEND_HIGH_WATER_BYTES + CHUNK
    for r in (reader, far_reader):
        assert r.peak_buffered <= quic.STREAM_RECEIVE_WINDOW_BYTES
    # The stalls did fill a window: the bound was tested, not just never approached.
    assert max(reader.peak_buffered, far_reader.peak_buffered) > quic.STREAM_RECEIVE_WINDOW_BYTES // 2


@pytest.mark.skipif(not quic.QuicConnection.probes_datagram_size, reason="qh3 probes its own sizes")
async def test_datagram_size_grows_to_what_loopback_carries(make_node) -> None:
    a, b = await make_node(), await make_node()
    outbound = await b.dial(a)
    inbound = await a.next_peer()
    largest = path_mtu.candidate_sizes(path_mtu.route_mtu((HOST, a.port)))[0]
    async with asyncio.timeout(PROMPT_S):
        while not outbound.datagram_size == inbound.datagram_size == largest:
            await asyncio.sleep(0.01)
    assert largest > path_mtu.BASE_DATAGRAM_BYTES
    data = os.urandom(4 * 1024 * 1024)  # whole at the new size, both ways
    served: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def echo_hash(reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        served.set_result(await hash_reader(reader))
        await send_all(writer, data)

    inbound.set_stream_handler(echo_hash)
    reader, writer = await outbound.open_stream()
    received, _ = await asyncio.gather(hash_reader(reader), send_all(writer, data))
    assert await served == received == hashlib.sha256(data).hexdigest()


def _burst(pacer) -> int:
    """Datagrams a full pacing bucket lets out before the pacer asks the sender to wait."""
    pacer.update_bucket(now=10.0)
    sent = 0
    while pacer.next_send_time(10.0) is None and sent < 10_000:
        pacer.update_after_send(10.0)
        sent += 1
    return sent


@pytest.mark.skipif(not quic.QuicConnection.paces_in_bursts, reason="qh3's pacer is native code")
async def test_a_full_pacing_bucket_releases_one_gso_batch(make_node) -> None:
    from aioquic.quic.recovery import QuicPacketPacer

    size = 1472
    window, rtt = 400 * size, 0.002  # 294 MB/s: 5 us a datagram, above the pacer's 1 us floor
    ours, stock = quic._BurstPacer(max_datagram_size=size), QuicPacketPacer(max_datagram_size=size)
    for pacer in (ours, stock):
        pacer.update_rate(congestion_window=window, smoothed_rtt=rtt)
    assert _burst(stock) <= 17  # aioquic's own: 16 datagrams
    assert quic.PACING_BURST_DATAGRAMS <= _burst(ours) <= quic.PACING_BURST_DATAGRAMS + 1
    small = quic._BurstPacer(max_datagram_size=size)
    small.update_rate(congestion_window=20 * size, smoothed_rtt=rtt)
    assert 10 <= _burst(small) <= 11  # never more than half the window at once
    # And connections use it.
    a, b = await make_node(), await make_node()
    outbound = await b.dial(a)
    inbound = await a.next_peer()
    assert all(isinstance(c._quic._loss._pacer, quic._BurstPacer) for c in (outbound, inbound))


async def test_half_close_leaves_the_other_direction_open(make_node) -> None:
    a, b = await make_node(), await make_node()
    outbound = await b.dial(a)
    inbound = await a.next_peer()

    async def reply_after_eof(reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        request = b""
        while chunk := await reader.read(CHUNK):
            request += chunk
        assert reader.at_eof()
        writer.write(b"got " + request)
        await writer.drain()

    inbound.set_stream_handler(reply_after_eof)
    reader, writer = await outbound.open_stream()
    writer.write(b"ping")
    writer.write_eof()
    with pytest.raises(RuntimeError):
        writer.write(b"more")
    assert await asyncio.wait_for(reader.readexactly(8), PROMPT_S) == b"got ping"
    assert await asyncio.wait_for(reader.read(CHUNK), PROMPT_S) == b""  # handler returned: FIN
    with pytest.raises(asyncio.IncompleteReadError):
        await reader.readexactly(1)


async def test_abort_resets_the_peer_with_its_code(make_node) -> None:
    a, b = await make_node(), await make_node()
    outbound = await b.dial(a)
    inbound = await a.next_peer()
    outcome: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def read_until_error(reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        try:
            while await reader.read(CHUNK):
                pass
        except ConnectionResetError as exc:
            outcome.set_result(exc)

    inbound.set_stream_handler(read_until_error)
    reader, writer = await outbound.open_stream()
    writer.write(b"partial")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.abort(7)
    assert "code 7" in str(await asyncio.wait_for(outcome, PROMPT_S))
    with pytest.raises(ConnectionResetError):
        writer.write(b"x")
    with pytest.raises(ConnectionResetError):
        await reader.read(1)


def refusals(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "mesh_sidecar.net.connection" and r.getMessage().startswith("refused") and text in r.getMessage()
    ]


async def test_wrong_mesh_secret_is_refused_on_both_sides(make_node, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="mesh_sidecar.net.connection")
    a = await make_node()
    intruder = await make_node(secret=b"x" * auth.MESH_SECRET_BYTES)
    with pytest.raises(AuthError, match=auth.WRONG_SECRET):
        await intruder.dial(a)
    # The client's refusal arrives with its failed dial; the server logs its own as it closes.
    await wait_until_async(lambda: refusals(caplog, f"refused {HOST}:{intruder.port}"), WAIT_S,
                           "the server logs its refusal")
    server_side = refusals(caplog, f"refused {HOST}:{intruder.port}: {auth.WRONG_SECRET}")
    client_side = refusals(caplog, f"refused by {HOST}:{a.port}: {auth.WRONG_SECRET}")
    assert len(server_side) == 1 and len(client_side) == 1, caplog.text
    assert a.peers.empty() and intruder.peers.empty()


async def test_key_other_than_the_ticket_id_is_refused(make_node, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="mesh_sidecar.net.connection")
    a, b = await make_node(), await make_node()
    with pytest.raises(AuthError, match=auth.KEY_MISMATCH):
        await b.transport.connect([(HOST, a.port)], generate_identity().node_id)
    assert len(refusals(caplog, auth.KEY_MISMATCH)) == 1, caplog.text
    assert a.peers.empty() and b.peers.empty()


async def test_addresses_are_tried_in_order(make_node) -> None:
    a, b = await make_node(), await make_node(dial_timeout_s=0.3)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # bound, never answers
        silent.bind((HOST, 0))
        dead = (HOST, silent.getsockname()[1])
        connection = await b.transport.connect([dead, (HOST, a.port)], a.id)
        assert connection.peer_id == a.id
        with pytest.raises(MeshError, match="no answer"):
            await b.transport.connect([dead], a.id)


def garbage_datagrams(rng: random.Random) -> list[bytes]:
    """Noise, plus noise shaped like QUIC Initial and short-header packets."""
    noise = [rng.randbytes(rng.randrange(1, 1500)) for _ in range(200)]
    initials = []
    for _ in range(100):
        cid = rng.randbytes(8)
        header = bytes([0xC0 | rng.randrange(4)]) + struct.pack("!I", 1) + bytes([8]) + cid + bytes([8]) + cid
        initials.append(header + rng.randbytes(1200 - len(header) + rng.randrange(100)))
    shorts = [bytes([0x40 | rng.randrange(64)]) + rng.randbytes(rng.randrange(20, 1300)) for _ in range(100)]
    return noise + initials + shorts


async def test_garbage_datagrams_do_not_hurt_a_following_connection(make_node) -> None:
    a, b = await make_node(), await make_node()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        for datagram in garbage_datagrams(random.Random(1)):
            sender.sendto(datagram, (HOST, a.port))
        await asyncio.sleep(0.2)
    assert not a.transport.connections  # nothing readable, nothing kept
    outbound = await b.dial(a)
    outbound.send_control(b"still fine")
    assert await (await a.next_peer()).receive_control() == b"still fine"


async def test_closing_one_side_ends_the_other_sides_reads_promptly(make_node) -> None:
    a, b = await make_node(), await make_node()
    outbound = await b.dial(a)
    inbound = await a.next_peer()
    far_reader: asyncio.Future[MeshStreamReader] = asyncio.get_running_loop().create_future()

    async def hold(reader: MeshStreamReader, writer: MeshStreamWriter) -> None:
        far_reader.set_result(reader)
        await asyncio.sleep(3600)  # cancelled when the connection closes

    inbound.set_stream_handler(hold)
    reader, writer = await outbound.open_stream()
    writer.write(b"x")
    peer_reader = await asyncio.wait_for(far_reader, PROMPT_S)
    assert await peer_reader.read(1) == b"x"
    pending_read = asyncio.ensure_future(peer_reader.read(1))
    pending_control = asyncio.ensure_future(inbound.receive_control())
    await asyncio.sleep(0)  # both now wait inside the connection

    started = time.monotonic()
    await b.transport.close()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(pending_read, PROMPT_S)
    with pytest.raises(MeshError):
        await asyncio.wait_for(pending_control, PROMPT_S)
    await asyncio.wait_for(inbound.wait_closed(), PROMPT_S)
    assert time.monotonic() - started < PROMPT_S
    assert inbound.close_reason == "node shutting down"
    with pytest.raises(ConnectionResetError):
        await reader.read(1)  # the closing side's own streams fail at once too
    with pytest.raises(MeshError):
        inbound.send_control(b"late")


def local_port(client: Watcher) -> int:
    return client._transport.get_extra_info("sockname")[1]


async def test_silent_peer_is_refused_after_the_auth_timeout(make_node, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="mesh_sidecar.net.connection")
    a = await make_node(auth_timeout_s=0.5)
    started = time.monotonic()
    async with unauthenticated_client(HOST, a.port) as silent:
        await asyncio.wait_for(silent.wait_closed(), WAIT_S)
    assert 0.5 <= time.monotonic() - started < 0.5 + PROMPT_S
    assert silent.closed_with is not None and auth.TIMED_OUT in silent.closed_with, silent.closed_with
    assert len(refusals(caplog, f"refused {HOST}:{local_port(silent)}: {auth.TIMED_OUT}")) == 1, caplog.text
    assert a.peers.empty()


async def test_unadmitted_peers_are_capped(make_node) -> None:
    a, b = await make_node(max_unauthenticated_peers=1), await make_node(dial_timeout_s=1.0)
    async with unauthenticated_client(HOST, a.port):
        await wait_until_async(lambda: a.transport.connections, WAIT_S, "the silent client takes the only slot")
        with pytest.raises(MeshError, match="no answer"):
            await b.dial(a)  # its Initial packets are dropped while the slot is taken
    await wait_until_async(lambda: not a.transport.connections, WAIT_S, "the silent client's slot is freed")
    assert (await b.dial(a)).peer_id == a.id  # the slot is free again


async def test_unadmitted_peer_gets_only_the_pre_auth_window(make_node) -> None:
    a = await make_node()
    async with unauthenticated_client(HOST, a.port) as flood:
        await wait_until_async(lambda: a.transport.connections, WAIT_S, "the client's connection is pending at A")
        (pending,) = a.transport.connections
        flood._quic.send_stream_data(flood._quic.get_next_available_stream_id(), b"")  # the control stream, unused
        flood._quic.send_stream_data(flood._quic.get_next_available_stream_id(), bytes(1024 * 1024))
        flood.transmit()
        # A's window is PRE_AUTH_RECEIVE_WINDOW_BYTES: once that much is buffered, no more can come.
        await wait_until_async(lambda: any(r.peak_buffered >= quic.PRE_AUTH_RECEIVE_WINDOW_BYTES
                                           for r, _ in pending._unclaimed), WAIT_S, "A buffers its window's worth")
        ((unclaimed_reader, _),) = pending._unclaimed
        assert 0 < unclaimed_reader.peak_buffered <= quic.PRE_AUTH_RECEIVE_WINDOW_BYTES
        assert a.peers.empty()
