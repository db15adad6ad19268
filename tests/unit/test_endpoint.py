"""The UDP endpoint on real loopback sockets: ICMP "port unreachable" names the address it concerns."""

from __future__ import annotations

import asyncio
import socket

from mesh_sidecar.net.endpoint import UdpEndpoint
from tests.helpers.waiting import wait_until_async


def closed_udp_port() -> tuple[str, int]:
    """An address where nothing listens (bound once, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()


async def test_a_closed_port_answering_our_datagram_is_reported_with_its_address() -> None:
    unreachable: list[tuple] = []
    received: list = []
    endpoint = UdpEndpoint(received.append, unreachable.append)
    port = await endpoint.bind("127.0.0.1", 0)
    try:
        dead = closed_udp_port()
        endpoint.send([(b"are you there", dead)])
        await wait_until_async(lambda: unreachable, 5.0, "the port unreachable error")
        assert unreachable[0][:2] == dead
        # The error queue is emptied: the socket still receives, and nothing else is reported.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"hello", ("127.0.0.1", port))
            await wait_until_async(lambda: received, 5.0, "a datagram after the error")
        assert received[0][0][0] == b"hello" and len(unreachable) == 1
    finally:
        endpoint.close()
        await asyncio.sleep(0)

