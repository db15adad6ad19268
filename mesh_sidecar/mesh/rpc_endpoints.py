"""Where each member's rpc-server is reached from here, by the serving nodes' rpc orders (gossip's
``RpcOrder``): the peer ids of a REGISTER_PEER a member sends (``--b2b``), mapped by that member's own
order only, and every order's endpoints as the native data relay is told them."""

from __future__ import annotations

from .membership import Membership
from .peers import PeerTable


class RpcEndpoints:
    """A serving node's peer index -> the endpoint (tunnel port, or our own rpc-server) that reaches it."""

    def __init__(self, peers: PeerTable, rpc_port: int) -> None:
        self._peers = peers
        self._rpc_port = rpc_port  # ours, on loopback

    def of_order(self, order: tuple[bytes, ...]) -> dict[int, str]:
        """A serving node's rpc order: peer index -> the endpoint that reaches that member from here."""
        return {index: endpoint for index, node_id in enumerate(order)
                if (endpoint := self._peers.rpc_endpoint(node_id, self._rpc_port)) is not None}

    def of_orders(self, membership: Membership) -> dict[bytes, dict[int, str]]:
        """Every serving node's order as membership last heard it, each mapped to endpoints here."""
        return {sender: self.of_order(order) for sender, order in membership.rpc_orders.items()}

    def resolve(self, membership: Membership, sender: bytes, peer_index: int) -> str | None:
        """The peer id of a REGISTER_PEER that member ``sender`` sent -> the endpoint that reaches that member
        from here, by ``sender``'s own rpc order only: another member's order never remaps its indices."""
        order = membership.rpc_order_of(sender)
        return self._peers.rpc_endpoint(order[peer_index], self._rpc_port) if 0 <= peer_index < len(order) else None
