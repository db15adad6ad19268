"""net/quic.py's ACK timing: a lone packet's ACK waits for a second packet or for data to ride with.

Two connections driven by hand over a clock of the test's own: every datagram is handed over
at the time the test says, so the ACK deadlines are exact.
"""

from __future__ import annotations

import pytest

from mesh_sidecar.identity import generate_identity
from mesh_sidecar.net import quic

pytestmark = pytest.mark.skipif(not quic.QuicConnection.delays_lone_acks, reason="qh3 times its own ACKs")

ADDR = ("127.0.0.1", 4433)
STREAM = 0  # the client's first bidirectional stream


def _deliver(sender: quic.QuicConnection, receiver: quic.QuicConnection, now: float) -> int:
    datagrams = sender.datagrams_to_send(now=now)
    for data, _ in datagrams:
        receiver.receive_datagram(data, ADDR, now=now)
    return len(datagrams)


def _connected() -> tuple[quic.QuicConnection, quic.QuicConnection]:
    client = quic.QuicConnection(configuration=quic.quic_configuration(generate_identity(), is_client=True))
    server = quic.QuicConnection(configuration=quic.quic_configuration(generate_identity(), is_client=False),
                                 original_destination_connection_id=client.original_destination_connection_id)
    client.connect(ADDR, now=0.0)
    for _ in range(10):
        if not _deliver(client, server, 0.0) + _deliver(server, client, 0.0):
            break
    assert client._handshake_complete and server._handshake_complete
    # Whatever the handshake left to acknowledge, acknowledged: each side starts with nothing owed.
    for now in (1.0, 1.5, 1.5):
        _deliver(client, server, now)
        _deliver(server, client, now)
    assert _ack_due(client) is None and _ack_due(server) is None
    return client, server


def _ack_due(connection: quic.QuicConnection) -> float | None:
    return connection._spaces[quic.tls.Epoch.ONE_RTT].ack_at


def test_a_lone_packet_waits_for_a_second_then_both_are_acknowledged_at_once() -> None:
    client, server = _connected()
    client.send_stream_data(STREAM, b"token 1")
    _deliver(client, server, 2.0)
    assert _ack_due(server) == pytest.approx(2.0 + quic.LONE_PACKET_ACK_DELAY_S)  # aioquic alone: 2.001
    client.send_stream_data(STREAM, b"token 2")
    _deliver(client, server, 2.009)
    assert _ack_due(server) == pytest.approx(2.010)  # the second: within 1 ms, as aioquic does
    assert _deliver(server, client, 2.010) == 1 and _ack_due(server) is None


def test_a_lone_packet_is_still_acknowledged_within_the_delay() -> None:
    client, server = _connected()
    client.send_stream_data(STREAM, b"token 1")
    _deliver(client, server, 2.0)
    assert _deliver(server, client, 2.0 + quic.LONE_PACKET_ACK_DELAY_S / 2) == 0  # nothing due yet
    assert server.get_timer() == pytest.approx(2.0 + quic.LONE_PACKET_ACK_DELAY_S)
    assert _deliver(server, client, 2.0 + quic.LONE_PACKET_ACK_DELAY_S) == 1 and _ack_due(server) is None


def test_an_ack_owed_rides_with_the_next_data() -> None:
    client, server = _connected()
    client.send_stream_data(STREAM, b"request")
    _deliver(client, server, 2.0)
    assert _ack_due(server) is not None
    server.send_stream_data(STREAM, b"reply")  # before the ACK was due
    assert _deliver(server, client, 2.003) == 1  # one packet: the reply, with the ACK in it
    assert _ack_due(server) is None
