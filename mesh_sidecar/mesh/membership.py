"""Who is in the mesh, as one node sees it: the membership state machine. Sans-I/O.

Nothing here touches a socket, a clock or an event loop. The mesh runtime
feeds it connections coming and going and the gossip messages they carry
(wire/gossip.py), passes the current time in as ``now`` (seconds, any monotonic
origin), and pulls out what to do (:meth:`Membership.next_action`) and what
happened (:meth:`Membership.next_event`, events.py).

A member's state, one transition a line::

    heard of in a peer's MemberList ..... known      a Dial goes out
    its connection is up ................ connected  (from known, lost or left)
    its connection ends, or Dial fails .. lost       info kept for a redial
    lost, and a peer lists it ........... known      dialed again
    lost, a peer still lists it, a while  known      dialed again (heartbeat, backing off)
    it says Leave ....................... left       only its own new connection brings it back
    a Rekey leaves it out ............... removed    final

Heartbeats: :meth:`Membership.heartbeat` pings every connected member and keeps
a PeerHealth (health.py) per connection, so round trips and degraded or lost
members come out as events, with no other RTT bookkeeping anywhere.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeAlias

from ..errors import UsageError
from ..identity import short_id
from ..wire.gossip import GossipMessage, Leave, MemberInfo, MemberList, Ping, Pong, Rekey, RpcOrder
from ..wire.layer_share import LayersFetched, LayerShare
from .events import (
    Event,
    LayersReported,
    LayersShared,
    LoopStalled,
    MemberJoined,
    MemberLeft,
    MemberLost,
    MemberRemoved,
    MemberUpdated,
    SecretRotated,
    UsedBy,
)
from .health import (
    DEGRADED_AFTER_S,
    HEARTBEAT_INTERVAL_S,
    LOOP_STALL_S,
    LOST_AFTER_S,
    HealthState,
    PeerHealth,
    Sign,
)

# A lost member that a connected peer still lists (so it is up, and only our path to it failed:
# a dial that timed out on a busy machine, a path that broke) is dialed again on a heartbeat
# after this, doubling up to the maximum: a peer re-sends its list only when its view changes.
REDIAL_FIRST_S = 2.0
REDIAL_MAX_S = 60.0

# --- actions, for the mesh runtime to carry out ------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send ``msg`` on our connection to ``to``."""

    to: bytes
    msg: GossipMessage


@dataclass(frozen=True)
class Dial:
    """Connect to a member we heard of; call ``peer_connected`` once it is up."""

    member: MemberInfo
    learned_via: bytes


@dataclass(frozen=True)
class Disconnect:
    """Close our connection to ``node_id`` once nothing runs through it."""

    node_id: bytes
    reason: str


Action: TypeAlias = Send | Dial | Disconnect


# --- the state machine --------------------------------------------------------------------


class MemberState(enum.StrEnum):
    CONNECTED = "connected"  # we have our own connection to it
    KNOWN = "known"  # heard of through gossip; a Dial is out
    LOST = "lost"  # was connected, or its Dial failed; info kept
    LEFT = "left"  # said Leave; only its own new connection brings it back
    REMOVED = "removed"  # a Rekey left it out: it no longer holds the secret


@dataclass(frozen=True)
class MemberStatus:
    """One row of :meth:`Membership.members`."""

    info: MemberInfo
    state: MemberState
    learned_via: bytes | None
    last_change: float  # ``now`` of the last change of state or info


@dataclass
class _Record:
    info: MemberInfo
    state: MemberState
    learned_via: bytes | None
    last_change: float
    # While connected: other addresses a third party announced for it (a NAT that remapped it),
    # and who said so. Not taken over its own word, but dialed at once if its connection is lost.
    moved_to: tuple[MemberInfo, bytes] | None = None
    # Connected peers whose latest MemberList lists it: they vouch that it is up.
    listed_by: set[bytes] = field(default_factory=set)
    redial_at: float = 0.0  # while lost: when the heartbeat may dial it again
    redial_backoff_s: float = REDIAL_FIRST_S


class Membership:
    """One node's view of the mesh, driven by the transport.

    The transport calls ``peer_connected``/``peer_disconnected`` as its
    connections (inbound, or made for a Dial) come and go, once per connection
    it keeps: settling two connections between the same pair is its job. It
    also calls ``peer_disconnected`` when a Dial fails. Messages from a node
    we hold no connection to are ignored (they race with our own close).

    Joins spread because a node re-sends its MemberList to all its peers
    whenever its own connections or the infos it holds change; a receiver dials
    the members it has never heard of. A lost member is dialed again when a
    peer lists it (that peer is connected to it), and on heartbeats, backing
    off, for as long as a connected peer's latest list still names it.
    """

    def __init__(self, self_info: MemberInfo, *, degraded_after_s: float = DEGRADED_AFTER_S,
                 lost_after_s: float = LOST_AFTER_S, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self._self = self_info
        self._degraded_after_s = degraded_after_s  # each peer's PeerHealth thresholds
        self._lost_after_s = lost_after_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._records: dict[bytes, _Record] = {}
        # Connected, but its MemberList (so its info) has not arrived yet.
        self._unidentified: set[bytes] = set()
        self._actions: deque[Action] = deque()
        self._events: deque[Event] = deque()
        # Per connected member, the last RpcOrder it sent (its --rpc order as a serving node). Never merged: a
        # REGISTER_PEER from member M is resolved with M's order only, so no member can remap another's.
        self._rpc_orders: dict[bytes, tuple[bytes, ...]] = {}
        self._announced_rpc_order: RpcOrder | None = None
        # One per connection we hold, identified or not; a new connection starts afresh.
        self._health: dict[bytes, PeerHealth] = {}
        self._next_nonce = 0
        self._last_heartbeat: float | None = None
        self._left = False
        self._rekey_rank: tuple[int, bytes] = (self_info.secret_epoch, b"")

    # --- outputs ---

    def next_action(self) -> Action | None:
        return self._actions.popleft() if self._actions else None

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    @property
    def self_info(self) -> MemberInfo:
        return self._self

    @property
    def rpc_orders(self) -> Mapping[bytes, tuple[bytes, ...]]:
        """Each connected member's own last RpcOrder (index i -> node id), by the member that sent it."""
        return MappingProxyType(self._rpc_orders)

    def rpc_order_of(self, node_id: bytes) -> tuple[bytes, ...]:
        """The last RpcOrder ``node_id`` itself sent (empty if none, or since its connection ended): what the
        peer indices of its REGISTER_PEERs mean."""
        return self._rpc_orders.get(node_id, ())

    def members(self) -> tuple[MemberStatus, ...]:
        """Every member we know of except ourselves, in the order we learned of them."""
        return tuple(
            MemberStatus(r.info, r.state, r.learned_via, r.last_change)
            for r in self._records.values()
        )

    def info_of(self, node_id: bytes) -> MemberInfo | None:
        """What member ``node_id`` last announced, if we know of it (not this node)."""
        record = self._records.get(node_id)
        return None if record is None else record.info

    def name_of(self, node_id: bytes) -> str:
        """The name of ``node_id`` (this node's too), or its short id while we know no info of it."""
        info = self._self if node_id == self._self.node_id else self.info_of(node_id)
        return short_id(node_id) if info is None else info.name

    def health(self, node_id: bytes) -> PeerHealth | None:
        """The heartbeat record of our connection to ``node_id`` (for reading), if we hold one."""
        return self._health.get(node_id)

    # --- inputs ---

    def peer_connected(self, node_id: bytes, now: float) -> None:
        if node_id == self._self.node_id:
            raise ValueError("a node cannot connect to itself")
        if self._left or self._is_connected(node_id):
            return
        self._health[node_id] = PeerHealth(node_id, degraded_after_s=self._degraded_after_s,
                                           lost_after_s=self._lost_after_s,
                                           heartbeat_interval_s=self._heartbeat_interval_s)
        record = self._records.get(node_id)
        if record is None:
            self._unidentified.add(node_id)
        else:
            self._set_state(record, MemberState.CONNECTED, now)
            self._events.append(MemberJoined(record.info, record.learned_via))
            self._broadcast_view(except_id=node_id)
        self._actions.append(Send(node_id, self._member_list()))
        if self._announced_rpc_order is not None:
            self._actions.append(Send(node_id, self._announced_rpc_order))

    def peer_disconnected(self, node_id: bytes, now: float, reason: str) -> None:
        if self._left:
            return
        self._unidentified.discard(node_id)
        self._health.pop(node_id, None)
        self._rpc_orders.pop(node_id, None)  # a new connection brings it again
        record = self._records.get(node_id)
        if record is None:
            return
        if record.state is MemberState.CONNECTED:
            self._set_state(record, MemberState.LOST, now)
            self._events.append(MemberLost(node_id, reason))
            self._broadcast_view(except_id=None)
            if record.moved_to is not None:
                # Its router gave it a new address while we were connected: go there now.
                (record.info, record.learned_via), record.moved_to = record.moved_to, None
                self._set_state(record, MemberState.KNOWN, now)
                self._actions.append(Dial(record.info, record.learned_via))
        elif record.state is MemberState.KNOWN:  # its Dial failed
            self._set_state(record, MemberState.LOST, now)

    def receive(self, from_id: bytes, msg: GossipMessage, now: float) -> None:
        if self._left and isinstance(msg, Leave) and msg.node_id == from_id:
            # Both of us are leaving: neither has work on the other to wait for, so close now
            # rather than each waiting out the other's leave grace.
            self._actions.append(Disconnect(from_id, msg.reason))
            return
        if self._left or not self._is_connected(from_id):
            return
        match msg:
            case MemberList():
                self._on_member_list(from_id, msg, now)
            case Leave():
                self._on_leave(from_id, msg, now)
            case RpcOrder():
                self._rpc_orders[from_id] = msg.node_ids  # the sender's own: the connection names it
                if self._self.node_id in msg.node_ids:
                    self._events.append(UsedBy(from_id))
            case Ping():
                self._actions.append(Send(from_id, Pong(msg.nonce, msg.sent_at)))
            case Pong():
                if (health := self._health.get(from_id)) is not None:
                    health.pong_received(msg.nonce, now)
            case Rekey():
                self._on_rekey(from_id, msg, now)
            case LayerShare():
                self._events.append(LayersShared(from_id, msg))
            case LayersFetched():
                self._events.append(LayersReported(from_id, msg))

    def update_self(self, info: MemberInfo) -> None:
        if info.node_id != self._self.node_id:
            raise ValueError("update_self cannot change the node id")
        if self._left or info == self._self:
            return
        self._self = info
        self._broadcast_view(except_id=None)

    def announce_rpc_order(self, node_ids: tuple[bytes, ...]) -> None:
        """As the serving node: tell every peer, now and on each later connect, our --rpc order."""
        if self._left:
            return
        self._announced_rpc_order = RpcOrder(node_ids)
        for peer in self._connected_ids():
            self._actions.append(Send(peer, self._announced_rpc_order))

    def send_layers(self, node_id: bytes, msg: LayerShare | LayersFetched) -> None:
        """Tell one connected member which layers to fetch (a serving node), or how the fetch ended (a worker)."""
        if not self._left and self._is_connected(node_id):
            self._actions.append(Send(node_id, msg))

    def heartbeat(self, now: float) -> None:
        """Ping every identified peer, then judge each by its unanswered Pings (health.py).

        Call once per heartbeat interval. Changes of health come out as events;
        after a stall of our own (LOOP_STALL_S) a LoopStalled instead.
        """
        if self._left:
            return
        gap_s = None if self._last_heartbeat is None else now - self._last_heartbeat
        self._last_heartbeat = now
        self._redial_vouched(now)
        pinged = [node_id for node_id, r in self._records.items() if r.state is MemberState.CONNECTED]
        for node_id in pinged:
            self._next_nonce += 1
            self._health[node_id].ping_sent(self._next_nonce, now)
            self._actions.append(Send(node_id, Ping(self._next_nonce, now)))
        if gap_s is not None and gap_s > LOOP_STALL_S:
            self._events.append(LoopStalled(gap_s))
            return
        self._judge(pinged, now)

    def heard_from(self, node_id: bytes, at: float) -> None:
        """A datagram of any kind came from ``node_id`` at ``at``: alive, whatever its heartbeats say."""
        if (health := self._health.get(node_id)) is not None:
            health.heard(at)

    def suspect(self, node_id: bytes, sign: Sign, now: float) -> float | None:
        """A sign that a connected peer's process is gone (its port unreachable, its data connection reset):
        probe it with a Ping now. Returns when to call ``judge`` (its probe's deadline), or None."""
        health = self._health.get(node_id)
        record = self._records.get(node_id)
        if self._left or health is None or record is None or record.state is not MemberState.CONNECTED:
            return None
        if health.suspect(sign, now):
            self._next_nonce += 1
            health.probed(self._next_nonce, now)
            self._actions.append(Send(node_id, Ping(self._next_nonce, now)))
        self._judge([node_id], now)  # its port unreachable after the probe: lost now
        return None if health.state is HealthState.LOST else now + health.confirm_s

    def judge(self, now: float) -> None:
        """Judge every connected peer now, between heartbeats (a suspected peer's probe deadline)."""
        self._judge([node_id for node_id, r in self._records.items() if r.state is MemberState.CONNECTED], now)

    def _judge(self, node_ids: list[bytes], now: float) -> None:
        for node_id in node_ids:
            if (health := self._health.get(node_id)) is not None and (event := health.tick(now)) is not None:
                self._events.append(event)

    def rotate_secret(self, secret: bytes, removed: tuple[bytes, ...], now: float) -> Rekey:
        """Give every member except ``removed`` a new secret; disconnect the removed ones."""
        if self._self.node_id in removed:
            raise ValueError("a node cannot remove itself; use leave")
        epochs = [self._rekey_rank[0]] + [r.info.secret_epoch for r in self._records.values()]
        rekey = Rekey(max(epochs) + 1, secret, removed, self._self.node_id)
        self._on_rekey(None, rekey, now)
        return rekey

    def leave(self, reason: str) -> None:
        """Say Leave to every peer, then ignore all input. Receivers close the connections."""
        if self._left:
            return
        for peer in self._connected_ids():
            self._actions.append(Send(peer, Leave(self._self.node_id, reason)))
        self._left = True

    # --- internals ---

    def _redial_vouched(self, now: float) -> None:
        connected = set(self._connected_ids())
        for record in self._records.values():
            vouchers = sorted(record.listed_by & connected)
            if record.state is MemberState.LOST and vouchers and now >= record.redial_at:
                record.learned_via = vouchers[0]
                self._set_state(record, MemberState.KNOWN, now)
                self._actions.append(Dial(record.info, vouchers[0]))

    def _on_member_list(self, from_id: bytes, msg: MemberList, now: float) -> None:
        own = next((m for m in msg.members if m.node_id == from_id), None)
        if own is None:
            self._actions.append(
                Disconnect(from_id, f"{short_id(from_id)} sent a member list without itself")
            )
            return
        changed = self._learn(own, from_id, now)
        for info in msg.members:
            if info.node_id not in (from_id, self._self.node_id):
                changed |= self._learn(info, from_id, now)
        listed = {info.node_id for info in msg.members}
        for node_id, record in self._records.items():
            if node_id in listed:
                record.listed_by.add(from_id)
            else:
                record.listed_by.discard(from_id)
        if changed:
            self._broadcast_view(except_id=from_id)

    def _learn(self, info: MemberInfo, via: bytes, now: float) -> bool:
        """Take in ``info`` as told by ``via``; True if our own view (connected infos) changed."""
        node_id = info.node_id
        direct = node_id == via
        if node_id in self._unidentified:
            self._unidentified.discard(node_id)
            learned_via = None if direct else via
            self._records[node_id] = _Record(info, MemberState.CONNECTED, learned_via, now)
            self._events.append(MemberJoined(info, learned_via))
            return True
        record = self._records.get(node_id)
        if record is None:
            self._records[node_id] = _Record(info, MemberState.KNOWN, via, now)
            self._actions.append(Dial(info, via))
        elif direct and record.info != info:
            # Only a member speaks for itself: a third party's copy may be stale.
            record.info = info
            record.moved_to = None
            record.last_change = now
            self._events.append(MemberUpdated(info))
            return True
        elif not direct and record.state is MemberState.CONNECTED and info.addresses != record.info.addresses:
            record.moved_to = (info, via)
        elif not direct and (record.state is MemberState.LOST or (
                record.state is MemberState.KNOWN and info.addresses != record.info.addresses)):
            # `via` holds a live connection to it, so its copy is worth a redial; so are new addresses
            # while a dial is out (a public one it just learned: the dial in flight may not reach it).
            record.info = info
            record.learned_via = via
            self._set_state(record, MemberState.KNOWN, now)
            self._actions.append(Dial(info, via))
        return False

    def _on_leave(self, from_id: bytes, msg: Leave, now: float) -> None:
        if msg.node_id != from_id:
            # Each member says its own Leave; a relayed one could not be told from a forged one.
            self._actions.append(
                Disconnect(from_id, f"{short_id(from_id)} sent a Leave for {short_id(msg.node_id)}")
            )
            return
        self._unidentified.discard(from_id)
        self._health.pop(from_id, None)
        self._rpc_orders.pop(from_id, None)
        record = self._records.get(from_id)
        if record is not None:
            self._set_state(record, MemberState.LEFT, now)
            self._events.append(MemberLeft(from_id, msg.reason))
            self._broadcast_view(except_id=None)
        self._actions.append(Disconnect(from_id, f"{short_id(from_id)} left: {msg.reason}"))

    def _on_rekey(self, from_id: bytes | None, msg: Rekey, now: float) -> None:
        if msg.rank <= self._rekey_rank or self._self.node_id in msg.removed:
            return  # seen it, or lost to a concurrent rotation; never adopt a key meant to exclude us
        self._rekey_rank = msg.rank
        self._events.append(SecretRotated(msg))
        for node_id in msg.removed:
            if self._is_connected(node_id):
                self._actions.append(Disconnect(node_id, f"removed from the mesh by {short_id(msg.by)}"))
            self._unidentified.discard(node_id)
            self._health.pop(node_id, None)
            self._rpc_orders.pop(node_id, None)
            if (record := self._records.get(node_id)) is not None:
                self._set_state(record, MemberState.REMOVED, now)
                self._events.append(MemberRemoved(node_id, msg.by))
        for peer in self._connected_ids():
            if peer != from_id:
                self._actions.append(Send(peer, msg))
        self._broadcast_view(except_id=None)

    def _is_connected(self, node_id: bytes) -> bool:
        record = self._records.get(node_id)
        return node_id in self._unidentified or (
            record is not None and record.state is MemberState.CONNECTED
        )

    def _connected_ids(self) -> list[bytes]:
        return [
            node_id for node_id, r in self._records.items() if r.state is MemberState.CONNECTED
        ] + sorted(self._unidentified)

    def _member_list(self) -> MemberList:
        return MemberList(
            (self._self,)
            + tuple(r.info for r in self._records.values() if r.state is MemberState.CONNECTED)
        )

    def _broadcast_view(self, except_id: bytes | None) -> None:
        view = self._member_list()
        for peer in self._connected_ids():
            if peer != except_id:
                self._actions.append(Send(peer, view))

    @staticmethod
    def _set_state(record: _Record, state: MemberState, now: float) -> None:
        record.state = state
        record.last_change = now
        if state is MemberState.LOST:
            record.redial_at = now + record.redial_backoff_s
            record.redial_backoff_s = min(REDIAL_MAX_S, 2 * record.redial_backoff_s)
        elif state is MemberState.CONNECTED:
            record.redial_backoff_s = REDIAL_FIRST_S


def find_member(membership: Membership, which: str) -> bytes:
    """A member's id from its name, short id (node_...) or a hex prefix of its id (8 digits or more).

    Removed members are not found. UsageError, saying what to do, when ``which``
    names this node, no member or several.
    """
    which = which.strip()
    own = membership.self_info
    if which in (own.name, short_id(own.node_id)):
        raise UsageError("That is this node. To take it out of the mesh, stop it (Ctrl-C).")
    matches = {m.info.node_id for m in membership.members()
               if m.state is not MemberState.REMOVED
               and (which in (m.info.name, short_id(m.info.node_id))
                    or (len(which) >= 8 and m.info.node_id.hex().startswith(which.lower())))}
    if not matches:
        raise UsageError(f"No member called {which!r}. `mesh-inference status` lists the members.")
    if len(matches) > 1:
        raise UsageError(f"{which!r} names {len(matches)} members: use the id from `mesh-inference status`.")
    return matches.pop()
