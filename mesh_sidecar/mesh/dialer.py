"""How a node reaches members: dials at their addresses, a member's relay when those fail, and
direct again later for relayed peers (the mesh runtime's outbound half).

A dial to a member learned through gossip is also a hole punch: behind NATs, each side's
packets open its own router for the other's. When two members learn of each other at once,
the lower id dials first and the higher one a moment later (HIGHER_ID_DIAL_DELAY_S).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping

from ..errors import MeshError, PeerConnectionError, UsageError
from ..identity import short_id
from ..net.addresses import reachable_addresses
from ..net.connection import PeerConnection
from ..net.transport import MeshTransport
from ..wire.gossip import MemberInfo
from ..wire.ticket import PeerAddress, Ticket
from .membership import Dial
from .status import PunchCounters

log = logging.getLogger(__name__)

# When two members learn of each other at once, the lower id dials; the higher
# one dials only if no connection came in this long (a lost or blocked dial). Behind
# NATs the lower's packets are dropped by the higher's router but open its own; the
# higher's dial then passes through that opening (the punch), so this is kept short.
HIGHER_ID_DIAL_DELAY_S = 1.0
# A relayed peer is dialed directly again after this, doubling up to the maximum (a punch may work later).
PUNCH_RETRY_FIRST_S = 5.0
PUNCH_RETRY_MAX_S = 60.0
PUNCH_CHECK_S = 1.0  # how often relayed peers are looked at
# Joining: a member that does not answer the ticket's dial is dialed again every JOIN_RETRY_S
# for this long before the node gives up (it may be starting, or busy for a moment).
JOIN_PATIENCE_S = 60.0
JOIN_RETRY_S = 2.0


def peer_addresses(texts: tuple[str, ...]) -> list[PeerAddress]:
    """The addresses among ``texts`` that parse (gossip and mesh.json are checked, but not by this build)."""
    addresses = []
    for text in texts:
        try:
            addresses.append(PeerAddress.parse(text))
        except ValueError:
            continue
    return addresses


class Dialer:
    """Outbound connections for one node.

    ``connections`` maps a member's id to the connection this node keeps with it (the runtime's
    peers); ``spawn`` runs a task the runtime owns; ``lost(node_id, reason)`` reports a member that
    could be reached neither directly nor relayed; ``info_of(node_id)`` is what gossip last
    said of a member (None: not a member).
    """

    def __init__(
        self,
        node_id: bytes,
        transport: MeshTransport,
        connections: Callable[[], Mapping[bytes, PeerConnection]],
        spawn: Callable[[Coroutine], None],
        say: Callable[[str], None],
        name_of: Callable[[bytes], str],
        lost: Callable[[bytes, str], None],
        info_of: Callable[[bytes], MemberInfo | None],
        *,
        join_retry_s: float = JOIN_RETRY_S,
        join_patience_s: float = JOIN_PATIENCE_S,
    ) -> None:
        self._node_id = node_id
        self._join_retry_s = join_retry_s
        self._join_patience_s = join_patience_s
        self._transport = transport
        self._connections = connections
        self._spawn = spawn
        self._say = say
        self._name_of = name_of
        self._lost = lost
        self._info_of = info_of
        self.punch_counters = PunchCounters()

    async def dial(self, node_id: bytes, addresses: list[PeerAddress] | tuple[PeerAddress, ...]) -> None:
        # A member's loopback (or LAN) address with our own port is this node: machines in different
        # homes all listen on the default port.
        port = self._transport.port
        own = set(reachable_addresses(port)) if port is not None else set()
        await self._transport.connect([(a.host, a.port) for a in addresses if a not in own], node_id)

    async def join(self, ticket: Ticket) -> None:
        """Connect to the node a ticket names.

        A member that does not answer is dialed again for ``join_patience_s``: it may be starting, or
        too busy to answer within one dial's timeout. A wrong secret or key is final at once.
        """
        if ticket.node_id == self._node_id:
            raise UsageError("That ticket is this node's own. Use the ticket printed by another node.")
        give_up_at = time.monotonic() + self._join_patience_s
        told = False
        while True:
            try:
                await self.dial(ticket.node_id, ticket.addresses)
                return
            except PeerConnectionError as exc:
                if time.monotonic() + self._join_retry_s >= give_up_at:
                    raise PeerConnectionError(
                        f"{exc}. Nothing answered for {self._join_patience_s:g} s: check that the member whose ticket "
                        "this is still runs (`mesh-inference status` there) and that its UDP port is reachable "
                        "from here, or ask a member for a fresh ticket (`mesh-inference ticket`).") from None
                if not told:
                    self._say(f"No answer from {short_id(ticket.node_id)} yet ({exc}); trying again for up to "
                              f"{self._join_patience_s:g} s.")
                    told = True
            await asyncio.sleep(self._join_retry_s)

    def rejoin(self, members: Mapping[bytes, tuple[str, ...]]) -> int:
        """Dial every member remembered from an earlier run (mesh.json); how many."""
        remembered = [(n, a) for n, a in members.items() if n != self._node_id]
        for node_id, texts in remembered:
            self.redial(node_id, peer_addresses(texts))
        return len(remembered)

    def redial(self, node_id: bytes, addresses: list[PeerAddress]) -> None:
        """Dial a member we knew (or saw on the LAN) in the background; silence is only logged."""
        async def redial() -> None:
            try:
                await self.dial(node_id, addresses)
            except MeshError as exc:
                log.info("member %s did not answer at %s: %s", short_id(node_id), ", ".join(map(str, addresses)), exc)

        self._spawn(redial())

    def start(self, action: Dial) -> None:
        """Carry out membership's Dial: direct (a punch), else relayed by whoever told us of it."""
        addresses = peer_addresses(action.member.addresses)
        node_id = action.member.node_id

        async def dial() -> None:
            if self._node_id > node_id:
                await asyncio.sleep(HIGHER_ID_DIAL_DELAY_S)
                if node_id in self._connections():
                    return
            # Learned through a member, it may be behind a NAT: a dial to it is a punch.
            self.punch_counters.attempts += 1
            try:
                await self.dial(node_id, addresses)
                self.punch_counters.successes += 1
                return
            except MeshError as exc:
                if node_id in self._connections():
                    return  # it reached us meanwhile (its dial, or one of ours with newer addresses)
                if await self._dial_through(action.learned_via, node_id, exc):
                    return
                log.warning("could not reach %s: %s", short_id(node_id), exc)
                self._lost(node_id, str(exc))

        self._spawn(dial())

    async def _dial_through(self, relay_id: bytes, node_id: bytes, direct_failure: MeshError) -> bool:
        """After a failed direct dial: reach ``node_id`` relayed by ``relay_id``; whether that worked."""
        connections = self._connections()
        relay = connections.get(relay_id)
        if relay is None or relay.closed or relay.relayed or node_id in connections:
            return node_id in connections
        try:
            await self._transport.connect_via(relay, node_id)
        except MeshError as exc:
            if node_id in self._connections():
                return True
            log.info("could not reach %s through %s either: %s", short_id(node_id), self._name_of(relay_id), exc)
            return False
        log.info("reaching %s through %s (direct: %s)", short_id(node_id), self._name_of(relay_id), direct_failure)
        return True

    async def punch_again(self) -> None:
        """Relayed peers: dial their own addresses now and then (backing off), to move to a direct path."""
        next_try: dict[bytes, tuple[float, float]] = {}  # node id -> (when, backoff)
        while True:
            now = time.monotonic()
            relayed = [node_id for node_id, connection in self._connections().items() if connection.relayed]
            for node_id in set(next_try) - set(relayed):
                del next_try[node_id]
            for node_id in relayed:
                when, backoff = next_try.setdefault(node_id, (now + PUNCH_RETRY_FIRST_S, PUNCH_RETRY_FIRST_S))
                if now >= when:
                    backoff = min(PUNCH_RETRY_MAX_S, backoff * 2)
                    next_try[node_id] = (now + backoff, backoff)
                    self._spawn(self._punch(node_id))
            await asyncio.sleep(PUNCH_CHECK_S)

    async def _punch(self, node_id: bytes) -> None:
        info = self._info_of(node_id)
        if info is None:
            return
        self.punch_counters.attempts += 1
        try:
            await self.dial(node_id, peer_addresses(info.addresses))
        except MeshError as exc:
            log.info("%s is still out of direct reach: %s", short_id(node_id), exc)
            return
        self.punch_counters.successes += 1
