"""Peer health: PeerHealth on its own (no clock), RPC command counts of inbound streams,
then two real Meshes on loopback."""

from __future__ import annotations

import asyncio
import logging
import struct

import pytest

from mesh_sidecar.mesh.events import PeerDegraded, PeerLost, PeerRecovered
from mesh_sidecar.mesh.health import (
    ANSWERED_WITHIN_LOST_AFTERS,
    CONFIRM_FLOOR_S,
    DEGRADED_AFTER_S,
    HEARTBEAT_INTERVAL_S,
    LOST_AFTER_HEARTBEATS,
    LOST_AFTER_RTTS,
    LOST_AFTER_S,
    RTT_WINDOW,
    HealthState,
    PeerHealth,
    Sign,
    lost_reason,
    percentile,
)
from mesh_sidecar.mesh.membership import Membership
from mesh_sidecar.mesh.timings import MeshTimings
from mesh_sidecar.net.tunnel import TunnelCounters, serve_inbound_stream
from mesh_sidecar.ports import LOOPBACK
from mesh_sidecar.wire import auth
from mesh_sidecar.wire.gossip import Ping
from tests.helpers.meshes import HANG_S, make_mesh, row, ticket_of, wait_for

PEER = bytes(range(32))
SECRET = b"h" * auth.MESH_SECRET_BYTES


def answered(health: PeerHealth, nonce: int, sent: float, rtt: float) -> None:
    health.ping_sent(nonce, sent)
    assert health.pong_received(nonce, sent + rtt) == pytest.approx(rtt)


# --- percentiles and samples --------------------------------------------------------------


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0
    samples = [float(i) for i in range(1, 101)]  # 1..100, shuffled order must not matter
    samples.reverse()
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 95) == 95.0
    assert percentile(samples, 100) == 100.0
    assert percentile(samples, 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_rtt_last_p50_p95():
    health = PeerHealth(PEER)
    assert (health.rtt_last_s, health.rtt_p50_s, health.rtt_p95_s) == (None, None, None)
    for i in range(20):  # RTTs 1..20 ms, one heartbeat a second
        answered(health, i, float(i), (i + 1) / 1000)
    assert health.rtt_last_s == pytest.approx(0.020)
    assert health.rtt_p50_s == pytest.approx(0.010)
    assert health.rtt_p95_s == pytest.approx(0.019)
    assert (health.pings_sent, health.pongs_received, health.missed) == (20, 20, 0)


def test_rtt_window_is_bounded():
    health = PeerHealth(PEER)
    for i in range(RTT_WINDOW + 10):
        answered(health, i, float(i), 1.0 if i < 10 else 0.001)
    assert len(health.rtt_samples) == RTT_WINDOW
    assert health.rtt_p95_s == pytest.approx(0.001)  # the ten slow ones fell out


# --- nonces -------------------------------------------------------------------------------


def test_unknown_answered_and_superseded_nonces_are_ignored():
    health = PeerHealth(PEER)
    assert health.pong_received(99, 1.0) is None  # never sent
    health.ping_sent(1, 0.0)
    health.ping_sent(2, 1.0)
    health.ping_sent(3, 2.0)
    assert health.pong_received(2, 2.5) == pytest.approx(1.5)  # answers 1 as well
    assert health.pong_received(1, 2.6) is None  # superseded by 2's Pong
    assert health.pong_received(2, 2.7) is None  # answered already
    assert health.rtt_samples == (pytest.approx(1.5),)
    assert health.silent_s(3.0) == pytest.approx(1.0)  # only 3 still waits


def test_duplicate_ping_nonce_keeps_the_first_send_time():
    health = PeerHealth(PEER)
    health.ping_sent(1, 0.0)
    health.ping_sent(1, 1.0)
    assert health.pings_sent == 1 and health.missed == 0
    assert health.pong_received(1, 1.5) == pytest.approx(1.5)


def test_forgotten_pings_no_longer_count():
    health = PeerHealth(PEER, max_outstanding=3)
    for nonce in range(5):
        health.ping_sent(nonce, float(nonce))
    assert health.pong_received(0, 5.0) is None
    assert health.pong_received(1, 5.0) is None
    assert health.silent_s(5.0) == 3.0  # the oldest remembered is nonce 2
    assert health.missed == 4


def test_rtt_is_ours_not_the_echoed_time():
    health = PeerHealth(PEER)
    health.ping_sent(5, 10.0)
    assert health.pong_received(5, 10.25) == 0.25


# --- missed heartbeats --------------------------------------------------------------------


def test_missed_counts_consecutive_unanswered_heartbeats():
    health = PeerHealth(PEER)
    health.ping_sent(1, 0.0)
    assert health.missed == 0  # still within its heartbeat
    health.ping_sent(2, 1.0)
    health.ping_sent(3, 2.0)
    assert health.missed == 2
    health.ping_sent(4, 3.0)
    assert health.missed == 3
    health.pong_received(2, 3.1)  # late answer to 2: 3 is still missed, 4 is in its heartbeat
    assert health.missed == 1
    health.pong_received(4, 3.2)
    assert health.missed == 0


def test_a_slow_but_answering_peer_stays_connected():
    # RTT 1.5 s, longer than a heartbeat: every Pong still counts as an answer.
    health = PeerHealth(PEER)
    events = []
    for i in range(20):
        health.ping_sent(i, float(i))
        if i >= 2:
            health.pong_received(i - 2, float(i) - 0.5)
        events.append(health.tick(float(i)))
    assert events == [None] * 20
    assert health.state is HealthState.CONNECTED
    assert health.rtt_last_s == pytest.approx(1.5)


# --- states -------------------------------------------------------------------------------


def test_nothing_outstanding_is_connected_forever():
    health = PeerHealth(PEER)
    assert health.tick(1000.0) is None
    assert health.state is HealthState.CONNECTED
    answered(health, 1, 0.0, 0.01)
    assert health.tick(1000.0) is None


def test_degraded_exactly_at_threshold_then_lost_exactly_at_threshold():
    health = PeerHealth(PEER)
    answered(health, 1, 0.0, 0.01)
    assert health.lost_after_s == LOST_AFTER_S  # a quick link: the floor
    health.ping_sent(2, 1.0)  # never answered
    health.ping_sent(3, 1.5)
    assert health.tick(1.0 + DEGRADED_AFTER_S - 0.001) is None
    assert health.state is HealthState.CONNECTED
    event = health.tick(1.0 + DEGRADED_AFTER_S)
    assert event == PeerDegraded(PEER, DEGRADED_AFTER_S, 1)
    assert health.state is HealthState.DEGRADED
    health.ping_sent(4, 2.0)
    health.ping_sent(5, 2.5)
    health.ping_sent(6, 3.0)
    assert health.tick(1.0 + LOST_AFTER_S - 0.001) is None
    assert health.state is HealthState.DEGRADED
    event = health.tick(1.0 + LOST_AFTER_S)
    assert event == PeerLost(PEER, LOST_AFTER_S, 4)
    assert health.state is HealthState.LOST


def test_a_slow_link_waits_longer_before_lost():
    health = PeerHealth(PEER)
    for nonce in range(1, 21):  # round trips of 0.5 s: heartbeats plus a few of them
        answered(health, nonce, nonce * HEARTBEAT_INTERVAL_S, 0.5)
    expected = LOST_AFTER_HEARTBEATS * HEARTBEAT_INTERVAL_S + LOST_AFTER_RTTS * 0.5
    assert health.lost_after_s == pytest.approx(expected) and expected > LOST_AFTER_S
    health.ping_sent(100, 20.0)
    assert not isinstance(health.tick(20.0 + LOST_AFTER_S), PeerLost)
    assert health.tick(20.0 + expected) == PeerLost(PEER, pytest.approx(expected), 0)


def test_a_peer_heard_from_is_not_lost_while_its_pings_wait_on_a_lossy_link():
    health = PeerHealth(PEER)
    answered(health, 1, 0.0, 0.002)
    health.ping_sent(2, 1.0)  # lost, and its retransmissions too
    health.heard(1.0 + LOST_AFTER_S - 0.2)  # an acknowledgement of something else came
    assert not isinstance(health.tick(1.0 + LOST_AFTER_S), PeerLost)
    assert health.quiet_s(1.0 + LOST_AFTER_S) == pytest.approx(0.2)
    # Nothing at all for LOST_AFTER_S: lost, as long as its oldest Ping has waited.
    event = health.tick(1.0 + 2 * LOST_AFTER_S - 0.2)
    assert isinstance(event, PeerLost) and event.silent_s == pytest.approx(2 * LOST_AFTER_S - 0.2)


def test_a_peer_heard_from_but_answering_nothing_is_lost_in_the_end():
    health = PeerHealth(PEER)
    answered(health, 1, 0.0, 0.002)
    health.ping_sent(2, 1.0)
    limit = ANSWERED_WITHIN_LOST_AFTERS * LOST_AFTER_S
    for at in (1.5, 3.0, 5.0, 7.0, 9.0, 10.9):
        health.heard(at)  # its QUIC still acknowledges: its mesh is hung
        assert not isinstance(health.tick(at), PeerLost)
    assert isinstance(health.tick(1.0 + limit), PeerLost)


def test_a_stray_sign_evicts_no_one_when_the_probe_is_answered():
    health = PeerHealth(PEER)
    answered(health, 1, 0.0, 0.002)
    assert health.suspect(Sign.UNREACHABLE, 1.0)  # probe it
    assert not health.suspect(Sign.UNREACHABLE, 1.0)  # one probe at a time
    health.probed(2, 1.0)
    assert health.suspected
    assert health.pong_received(2, 1.003) == pytest.approx(0.003)
    assert not health.suspected
    assert health.tick(1.0 + CONFIRM_FLOOR_S * 2) is None and health.state is HealthState.CONNECTED


def test_its_port_unreachable_after_the_probe_confirms_the_loss_at_once():
    health = PeerHealth(PEER)
    answered(health, 1, 0.0, 0.002)
    assert health.suspect(Sign.RESET, 1.0)
    health.probed(2, 1.0)
    assert health.tick(1.0005) is None  # no second sign yet
    assert not health.suspect(Sign.UNREACHABLE, 1.001)  # the dead port answered the probe
    event = health.tick(1.001)
    assert isinstance(event, PeerLost) and health.state is HealthState.LOST
    assert event.sign == "its data connection was reset, and a probe 1 ms later found it unreachable"
    assert lost_reason(event) == event.sign


def test_more_resets_after_the_probe_confirm_nothing():
    # A relay that dies alone (or stops before its node says Leave) resets all its tunnel connections
    # at once: one event, not a second sign; its node still answers the probe.
    health = PeerHealth(PEER)
    answered(health, 1, 0.0, 0.002)
    assert health.suspect(Sign.RESET, 1.0)
    health.probed(2, 1.0)
    for at in (1.0001, 1.0002, 1.001):
        assert not health.suspect(Sign.RESET, at)
        assert health.tick(at) is None
    assert health.pong_received(2, 1.002) is not None
    assert health.tick(1.0 + 2 * CONFIRM_FLOOR_S) is None and health.state is HealthState.CONNECTED


def test_an_unanswered_probe_confirms_the_loss_after_a_few_round_trips():
    health = PeerHealth(PEER)
    answered(health, 1, 0.0, 0.002)
    assert health.confirm_s == CONFIRM_FLOOR_S  # a quick link: the floor
    health.suspect(Sign.RESET, 1.0)
    health.probed(2, 1.0)
    assert health.tick(1.0 + CONFIRM_FLOOR_S - 0.001) is None
    event = health.tick(1.0 + CONFIRM_FLOOR_S)
    assert isinstance(event, PeerLost)
    assert event.sign == "its data connection was reset, and no answer to a probe in 500 ms"


def test_lost_is_final():
    health = PeerHealth(PEER)
    health.ping_sent(1, 0.0)
    assert isinstance(health.tick(LOST_AFTER_S), PeerLost)
    assert health.pong_received(1, LOST_AFTER_S + 0.1) is None
    health.ping_sent(2, 6.0)
    assert health.pings_sent == 1
    assert health.tick(7.0) is None
    assert health.state is HealthState.LOST


def test_connected_straight_to_lost_when_ticks_are_sparse():
    health = PeerHealth(PEER)
    health.ping_sent(1, 0.0)
    assert health.tick(9.0) == PeerLost(PEER, 9.0, 0)


def test_recovery_after_degraded():
    health = PeerHealth(PEER)
    health.ping_sent(1, 0.0)
    health.ping_sent(2, 0.5)
    health.ping_sent(3, 1.0)
    assert isinstance(health.tick(1.6), PeerDegraded)
    assert health.tick(1.8) is None  # still degraded: no second event
    assert health.pong_received(3, 2.0) == pytest.approx(1.0)
    assert health.state is HealthState.DEGRADED  # states change on tick only
    assert health.tick(2.0) == PeerRecovered(PEER, pytest.approx(0.4), pytest.approx(1.0))
    assert health.state is HealthState.CONNECTED
    assert health.missed == 0
    assert health.tick(3.0) is None


def test_custom_thresholds_are_checked():
    with pytest.raises(ValueError):
        PeerHealth(PEER, degraded_after_s=5.0, lost_after_s=5.0)
    with pytest.raises(ValueError):
        PeerHealth(PEER, window=0)
    health = PeerHealth(PEER, degraded_after_s=0.5, lost_after_s=1.0, heartbeat_interval_s=0.1)
    health.ping_sent(1, 0.0)
    assert isinstance(health.tick(0.5), PeerDegraded)
    assert isinstance(health.tick(1.0), PeerLost)


# --- RPC commands through a peer's streams into our rpc-server -----------------------------

RPC_HEADER = struct.Struct("<BQ")
HELLO_REQUEST = RPC_HEADER.pack(14, 24) + bytes(24)  # protocol 7: caps[24], all zero
HELLO_REPLY_7 = struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24)
DEVICE_COUNT_FRAME = RPC_HEADER.pack(15, 0)


async def fake_rpc_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers HELLO like a protocol-7 rpc-server, then echoes."""
    assert await reader.readexactly(len(HELLO_REQUEST)) == HELLO_REQUEST
    writer.write(HELLO_REPLY_7)
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.write_eof()


async def test_inbound_stream_counts_rpc_commands_and_bytes():
    # A plain TCP connection stands in for the peer's QUIC stream.
    counters = TunnelCounters()
    rpc = await asyncio.start_server(fake_rpc_server, LOOPBACK, 0)
    rpc_port = rpc.sockets[0].getsockname()[1]
    front = await asyncio.start_server(
        lambda r, w: serve_inbound_stream(r, w, rpc_port, lambda _i: None, "A", counters=counters),
        LOOPBACK, 0)
    try:
        reader, writer = await asyncio.open_connection(LOOPBACK, front.sockets[0].getsockname()[1])
        writer.write(HELLO_REQUEST)
        assert await asyncio.wait_for(reader.readexactly(len(HELLO_REPLY_7)), HANG_S) == HELLO_REPLY_7
        writer.write(DEVICE_COUNT_FRAME * 2)
        assert await asyncio.wait_for(reader.readexactly(18), HANG_S) == DEVICE_COUNT_FRAME * 2
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), HANG_S) == b""
        writer.close()
        assert counters.inbound_streams == 1
        assert counters.rpc_commands == 3  # HELLO and two DEVICE_COUNTs
        assert counters.inbound_bytes_from_peer == len(HELLO_REQUEST) + 18
        assert counters.inbound_bytes_to_peer == len(HELLO_REPLY_7) + 18
        assert (counters.bytes_to_peer, counters.bytes_from_peer, counters.streams) == (0, 0, 0)
    finally:
        front.close()
        rpc.close()


# --- two Meshes on loopback ---------------------------------------------------------------

class DeafToPings(Membership):
    """A membership that leaves Pings unanswered while ``deaf``: a node hung as far as the mesh can tell."""

    deaf = False

    def receive(self, from_id, msg, now):
        return None if self.deaf and isinstance(msg, Ping) else super().receive(from_id, msg, now)


@pytest.fixture
def deaf_to_pings():
    DeafToPings.deaf = False
    yield DeafToPings
    DeafToPings.deaf = False


async def test_silent_peer_is_degraded_then_lost_before_quic_would_notice(deaf_to_pings, caplog, tmp_path):
    # Fast heartbeats and short thresholds; QUIC keepalives keep the connection itself
    # alive all along, so only the heartbeats can tell that B stopped answering. B's QUIC
    # still acknowledges: it is heard from, so lost only after ANSWERED_WITHIN_LOST_AFTERS
    # times lost_after_s (4 s). Degraded for 3.5 s before: wide enough for a busy machine's polling.
    timings = MeshTimings(heartbeat_interval_s=0.1, degraded_after_s=0.5, lost_after_s=1.0)
    caplog.set_level(logging.INFO, "mesh_sidecar.mesh.runtime")
    said: dict[str, list[str]] = {"a": [], "b": []}
    a = make_mesh(tmp_path, "a", SECRET, said["a"].append, timings=timings)
    b = make_mesh(tmp_path, "b", SECRET, said["b"].append, timings=timings, membership=deaf_to_pings)
    await a.start(0)
    await b.start(0)
    tasks = [asyncio.create_task(m.run()) for m in (a, b)]
    try:
        await a.join(ticket_of(b, SECRET))
        await wait_for(lambda: row(a, b).get("rtt_p95_ms") is not None and row(b, a).get("rtt_ms") is not None,
                       "heartbeats answered")
        status = row(a, b)
        assert status["state"] == status["health"] == "connected"
        assert status["missed_heartbeats"] == 0
        assert 0 <= status["rtt_p50_ms"] <= status["rtt_p95_ms"]
        assert status["rpc_commands"] == status["bytes_from_peer_in"] == status["bytes_to_peer_in"] == 0

        # B hangs as far as the mesh is concerned: its Pings go unanswered.
        deaf_to_pings.deaf = True
        await wait_for(lambda: row(a, b)["health"] == "degraded", "B degraded", 10.0)
        assert row(a, b)["missed_heartbeats"] >= 1
        assert row(a, b)["state"] == "connected"
        await wait_for(lambda: row(a, b)["state"] == "lost", "B lost", 10.0)
        assert row(a, b)["health"] == "lost"
        assert any(m.startswith("Peer b is slow to answer") for m in said["a"]), said["a"]
        assert any(m.startswith("Lost peer b: no heartbeat answer for 4.") for m in said["a"]), said["a"]
        assert a.connected_members() == []
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a.close(graceful=False)
        await b.close(graceful=False)


async def test_a_peer_that_answers_again_recovers(deaf_to_pings, tmp_path):
    timings = MeshTimings(heartbeat_interval_s=0.1, degraded_after_s=0.3, lost_after_s=5.0)
    said: list[str] = []
    a = make_mesh(tmp_path, "a", SECRET, said.append, timings=timings)
    b = make_mesh(tmp_path, "b", SECRET, timings=timings, membership=deaf_to_pings)
    await a.start(0)
    await b.start(0)
    tasks = [asyncio.create_task(m.run()) for m in (a, b)]
    try:
        await a.join(ticket_of(b, SECRET))
        await wait_for(lambda: row(a, b).get("rtt_ms") is not None, "heartbeats answered")
        deaf_to_pings.deaf = True
        await wait_for(lambda: row(a, b)["health"] == "degraded", "B degraded", 10.0)
        deaf_to_pings.deaf = False
        await wait_for(lambda: row(a, b)["health"] == "connected", "B recovered", 10.0)
        assert row(a, b)["state"] == "connected" and row(a, b)["missed_heartbeats"] == 0
        assert any(m.startswith("Peer b answers heartbeats again") for m in said), said
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a.close(graceful=False)
        await b.close(graceful=False)
