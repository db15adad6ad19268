"""The members this node holds a connection to: one kept connection each, its tunnel, what it carries.

Two nodes may dial each other at once; both connections are admitted and one
carries the peer from then on: a direct path beats a relayed one, else the one
the transport marks ``preferred`` (dialed by the lower node id). The other is
retired, not cut: llama-server aborts on any transport error, so streams already
on it run to their end before it closes (RETIRE_IDLE_S).

A member's tunnel port (net/tunnel.py) stays while its connection is replaced;
the serving node's output checks (mesh/serving.py) are given to each tunnel as
it is made. This table also serves as a relay for members (``open_relay_leg``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..identity import short_id
from ..llama.capacity import MAX_HELD_ENTRIES, held_key
from ..net.connection import PeerConnection
from ..net.peer_streams import open_relay_delivery
from ..net.streams import StreamPair
from ..net.tunnel import NativePath, OutputChecks, TunnelListener
from ..ports import LOOPBACK

log = logging.getLogger(__name__)

# A graceful leave: the leaver waits this long for its peers to close, and a peer
# closes once nothing runs through its tunnel to the leaver (the serving node first
# drains its requests and moves its layers off). Longer than serving's drain.
LEAVE_GRACE_S = 40.0
LEAVE_POLL_S = 0.1
# A connection replaced by a simultaneous one closes after carrying no stream this
# long: both ends have moved new streams to the kept one well before then.
RETIRE_IDLE_S = 10.0
RETIRE_POLL_S = 1.0
REPLACED_REASON = "replaced by a simultaneous connection"

Spawn = Callable[[Coroutine[Any, Any, None]], None]


@dataclass
class Peer:
    """A member we hold a kept connection to."""

    connection: PeerConnection
    tunnel: TunnelListener
    # Connections to it replaced by a simultaneous one, still finishing their streams.
    retired: set[PeerConnection] = field(default_factory=set)
    told_address: str | None = None  # the address we last told it we see it at (observed.py)

    def close(self, reason: str) -> None:
        for connection in (self.connection, *self.retired):
            connection.close(reason)

    async def close_when_idle(self, reason: str) -> None:
        # Requests still running through this peer finish first (a leaving
        # node waits for us); the serving node's replan ends them soon.
        await self.tunnel.wait_idle(LEAVE_GRACE_S)
        self.close(reason)


async def _close_when_unused(connection: PeerConnection, retire_idle_s: float, retire_poll_s: float) -> None:
    """Close a retired connection once it has carried no stream for ``retire_idle_s``."""
    idle_s = 0.0
    while idle_s < retire_idle_s and not connection.closed:
        await asyncio.sleep(retire_poll_s)
        idle_s = 0.0 if connection.open_streams else idle_s + retire_poll_s
    connection.close(REPLACED_REASON)


class PeerTable(Mapping[bytes, Peer]):
    """Node id -> Peer, for every member this node holds a connection to."""

    def __init__(self, own_id: bytes, spawn: Spawn, *, retire_idle_s: float = RETIRE_IDLE_S,
                 retire_poll_s: float = RETIRE_POLL_S) -> None:
        self._own_id = own_id
        self._spawn = spawn  # a task the mesh owns (retired connections closing)
        self._retire_idle_s = retire_idle_s
        self._retire_poll_s = retire_poll_s
        self._peers: dict[bytes, Peer] = {}
        self.native: NativePath | None = None  # the native data relay, offered every tunnel connection

    def __getitem__(self, node_id: bytes) -> Peer:
        return self._peers[node_id]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._peers)

    def __len__(self) -> int:
        return len(self._peers)

    async def admit(self, connection: PeerConnection, checks: OutputChecks) -> tuple[Peer, bool]:
        """The peer ``connection`` belongs to, and whether it is new here; of two connections to
        one peer, one is kept and the other retired (the module docstring)."""
        node_id = connection.peer_id
        peer = self._peers.get(node_id)
        if peer is None or peer.connection.closed:
            tunnel = TunnelListener(connection, checks, self.native)
            await tunnel.start()
            peer = self._peers[node_id] = Peer(connection, tunnel)
            return peer, True
        if (peer.connection.relayed and not connection.relayed) or (
                connection.preferred and not (connection.relayed and not peer.connection.relayed)):
            # Both ends move to this one; the tunnel port stays.
            log.info("peer %s: keeping the new %s connection", short_id(node_id),
                     "relayed" if connection.relayed else "direct")
            self._retire(peer, peer.connection)
            peer.connection = connection
            peer.tunnel.use(connection)
        else:
            log.info("peer %s dialed us as we dialed it: keeping the first connection", short_id(node_id))
            self._retire(peer, connection)
        return peer, False

    async def release(self, peer: Peer, connection: PeerConnection) -> bool:
        """``connection`` to ``peer`` has ended; True when it was the kept one and the peer is gone from here."""
        peer.retired.discard(connection)
        if peer.connection is not connection:
            return False
        await peer.tunnel.close()
        if self._peers.get(connection.peer_id) is not peer:
            return False
        del self._peers[connection.peer_id]
        return True

    def _retire(self, peer: Peer, connection: PeerConnection) -> None:
        """No new streams on ``connection``; close it once its streams have ended."""
        peer.retired.add(connection)
        self._spawn(_close_when_unused(connection, self._retire_idle_s, self._retire_poll_s))

    def tunnel_endpoint(self, node_id: bytes) -> str:
        """Where our llama-server reaches ``node_id``'s rpc-server: its tunnel's port."""
        return f"{LOOPBACK}:{self._peers[node_id].tunnel.port}"

    def rpc_endpoint(self, node_id: bytes, own_rpc_port: int) -> str | None:
        """Where member ``node_id``'s rpc-server is reached from here: ours on loopback, else its tunnel."""
        if node_id == self._own_id:
            return f"{LOOPBACK}:{own_rpc_port}"
        return self.tunnel_endpoint(node_id) if node_id in self._peers else None

    def reply_waits_s(self, since: float, now: float) -> dict[bytes, float]:
        """Per peer, the seconds within [since, now] its rpc-server owed our llama-server a reply."""
        return {node_id: peer.tunnel.reply_waits.owed_s(since, now) for node_id, peer in self._peers.items()}

    def held_bytes(self) -> int:
        """Memory our rpc-server holds for other nodes' llama-servers (not ours: it connects locally)."""
        return sum(peer.tunnel.counters.inbound_held_bytes for peer in self._peers.values())

    def held_entries(self) -> tuple[tuple[str, int], ...]:
        """The largest of those per peer, as gossip's capacity carries them."""
        held = sorted(((held_key(node_id), peer.tunnel.counters.inbound_held_bytes)
                       for node_id, peer in self._peers.items() if peer.tunnel.counters.inbound_held_bytes > 0),
                      key=lambda entry: -entry[1])
        return tuple(sorted(held[:MAX_HELD_ENTRIES]))

    async def open_relay_leg(self, source_id: bytes, target_id: bytes) -> StreamPair | str:
        """For a member asking us to relay: a stream to ``target_id``, or why not (net/packet_relay.py)."""
        if target_id == source_id or target_id == self._own_id:
            return "a relay carries packets between two other members"
        peer = self._peers.get(target_id)
        if peer is None or peer.connection.closed:
            return f"{short_id(target_id)} is not a member this node is connected to"
        if peer.connection.relayed:
            return f"this node reaches {short_id(target_id)} only through a relay itself"
        return await open_relay_delivery(peer.connection, source_id)

    async def wait_empty(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no peer is left: they close once they moved off us."""
        deadline = time.monotonic() + timeout_s
        while self._peers and time.monotonic() < deadline:
            await asyncio.sleep(LEAVE_POLL_S)

    async def close_tunnels(self) -> None:
        for peer in list(self._peers.values()):
            await peer.tunnel.close()
