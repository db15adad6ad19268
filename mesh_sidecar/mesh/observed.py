"""Where this node can be dialed: its interfaces, and the addresses its peers see it at (gossip Observed).

Behind a NAT a node does not know its public address; each peer tells it the
address its datagrams come from (``Observed``), once and again after it changes
(a NAT rebinding, a migration). A public address heard that way goes into this
node's gossip and its ticket, so members elsewhere can dial it there.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..net.addresses import reachable_addresses
from ..net.endpoint import format_address
from ..ports import LOOPBACK
from ..wire.gossip import Observed, encode_message
from ..wire.ticket import MAX_TICKET_ADDRESSES, PeerAddress
from .peers import Peer


class OwnAddresses:
    """The addresses this node gives out: its interfaces', then those peers see it at, then loopback."""

    def __init__(self) -> None:
        self._seen_at: dict[bytes, PeerAddress] = {}  # what each peer says it sees us at

    def listing(self, port: int | None, limit: int) -> tuple[PeerAddress, ...]:
        """At most ``limit`` addresses for UDP ``port``; none before the node listens."""
        if port is None:
            return ()
        *interfaces, loopback = reachable_addresses(port)
        seen = [address for address in dict.fromkeys(self._seen_at.values())
                if address not in interfaces and address != loopback]
        # Loopback (last) is kept: it is how nodes on one machine meet.
        return (*(interfaces + seen)[: limit - 1], loopback)

    def heard(self, node_id: bytes, address: str, port: int | None) -> bool:
        """Peer ``node_id`` sees us at ``address``; True when the ticket did not list it yet."""
        try:
            parsed = PeerAddress.parse(address)
        except ValueError:
            return False
        if parsed.host == LOOPBACK:
            return False
        known = self.listing(port, MAX_TICKET_ADDRESSES)
        self._seen_at[node_id] = parsed
        return parsed not in known


def tell_observed_addresses(peers: Iterable[Peer]) -> None:
    """Tell each peer the address its datagrams come from, once and again after it changes."""
    for peer in peers:
        if peer.connection.closed or peer.connection.relayed:
            continue  # a relayed path's address is a stand-in (net/packet_relay.py), not where it sees us
        address = format_address(peer.connection.remote_address)
        if address != peer.told_address:
            peer.told_address = address
            peer.connection.send_control(encode_message(Observed(address)))
