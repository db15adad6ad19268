"""The mesh as one node sees it: QUIC connections, membership, and one tunnel per peer.

This is the asyncio edge that joins the pure parts together:

    MeshTransport --admitted PeerConnection--> _serve_peer (one task per peer)
        each control frame -> gossip.decode_message -> Membership.receive
        Membership actions -> send_control / dial (dialer.py) / close
        Membership events  -> messages to people, tunnels opened and closed,
                              mesh.json (saved.py); PeerLost (heartbeats,
                              health.py) -> close the connection
    heartbeat timer -> Membership.heartbeat (pings; health judged inside)
    LanDialer (lan.py, with --lan) -> dial members found on the LAN
    inbound QUIC streams -> serve_inbound_stream -> local rpc-server,
                            serve_model_file (model_transfer.py)
    peer_views / mesh_view -> status.py (the `status` JSON, metrics, dashboard)

Two nodes may dial each other at once; both connections are admitted and the
one the transport marks ``preferred`` (dialed by the lower node id) carries the
peer from then on. The other is retired, not cut: llama-server aborts on any
transport error, so streams already on it run to their end before it closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..errors import MeshError, PortInUseError
from ..home import NodeHome
from ..identity import NodeIdentity, short_id
from ..progress import ProgressCallback
from ..llama.capacity import MAX_HELD_ENTRIES, Capacity, held_key
from ..net.addresses import reachable_addresses
from ..net.discovery import LanRecord, mesh_id
from ..net.model_transfer import fetch_model_over, serve_model_file
from ..net.connection import PeerConnection
from ..net.endpoint import format_address
from ..net.relay import RelayCounters, serve_relay_request
from ..net.streams import MeshStreamReader, MeshStreamWriter
from ..net.transport import MeshTransport
from ..net.tunnel import StreamKind, TunnelCounters, TunnelListener, serve_inbound_stream, serve_peer_stream
from ..ports import LOOPBACK
from ..wire.auth import MESH_SECRET_BYTES
from ..wire.gossip import (MAX_ADDRESSES, MAX_RUN_ID, CorruptOutput, LlamaBuild, MemberInfo, SlowWorker,
                           Observed, decode_message, encode_message)
from ..wire.rpc_outputs import Fault, OutputRejected, TensorMeasured
from ..wire.ticket import MAX_TICKET_ADDRESSES, PeerAddress, Ticket, encode_ticket
from . import events
from .dialer import Dialer, peer_addresses
from .health import HealthState, health_message, lost_reason
from .lan import LanDialer
from .membership import Dial, Disconnect, Membership, MemberState, Send, find_member
from .refusal import SLOW_REFUSAL_S, Refusal, refusal
from .verdicts import Verdicts
from .saved import SavedMesh
from .status import PATH_DIRECT, PATH_RELAYED, MeshView, PeerView

log = logging.getLogger(__name__)

DEFAULT_QUIC_PORT = 47470
LISTEN_HOST = "0.0.0.0"
HEARTBEAT_INTERVAL_S = 1.0
CAPACITY_REFRESH_S = 5.0
# A graceful leave: the leaver waits this long for its peers to close, and a peer
# closes once nothing runs through its tunnel to the leaver (the serving node first
# drains its requests and moves its layers off). Longer than serving's drain.
LEAVE_GRACE_S = 40.0
# A connection replaced by a simultaneous one closes after carrying no stream this
# long: both ends have moved new streams to the kept one well before then.
RETIRE_IDLE_S = 10.0
RETIRE_POLL_S = 1.0
REPLACED_REASON = "replaced by a simultaneous connection"
STOPPED_REASON = "node stopped"
LEFT_FOR_GOOD_REASON = "left the mesh for good"  # `mesh-inference leave`: members forget it


@dataclass
class _Peer:
    """A member we hold a kept connection to."""

    connection: PeerConnection
    tunnel: TunnelListener
    # Connections to it replaced by a simultaneous one, still finishing their streams.
    retired: set[PeerConnection] = field(default_factory=set)
    told_address: str | None = None  # the address we last told it we see it at (Observed)

    def close(self, reason: str) -> None:
        for connection in (self.connection, *self.retired):
            connection.close(reason)

    async def close_when_idle(self, reason: str) -> None:
        # Requests still running through this peer finish first (a leaving
        # node waits for us); the serving node's replan ends them soon.
        await self.tunnel.wait_idle(LEAVE_GRACE_S)
        self.close(reason)


async def _close_when_unused(connection: PeerConnection) -> None:
    """Close a retired connection once it has carried no stream for RETIRE_IDLE_S."""
    idle_s = 0.0
    while idle_s < RETIRE_IDLE_S and not connection.closed:
        await asyncio.sleep(RETIRE_POLL_S)
        idle_s = 0.0 if connection.open_streams else idle_s + RETIRE_POLL_S
    connection.close(REPLACED_REASON)


class Mesh:
    """One node's membership in the mesh, from its QUIC port to its tunnel ports."""

    def __init__(
        self,
        identity: NodeIdentity,
        name: str,
        home: NodeHome,
        rpc_port: int,
        capacity: Callable[[], Capacity],
        say: Callable[[str], None],
        *,
        saved: SavedMesh,
        build: LlamaBuild,
        serving: bool = False,
        model_sha256: str = "",
        model_file: Path | None = None,
        lan: bool = False,
    ) -> None:
        self.identity = identity
        self._name = name
        self._home = home
        self._rpc_port = rpc_port
        self._capacity = capacity
        self._say = say
        self._serving = serving
        self.build = build  # announced; members and the serving node compare it (refusal.py)
        self.model_sha256 = model_sha256
        self.model_file = model_file  # offered to members that fetch it by its sha256
        self._saved = saved
        self._transport = MeshTransport(identity, saved.secret, self._serve_peer)
        self._transport.refuse_nodes(saved.removed)
        self._peers: dict[bytes, _Peer] = {}
        self._membership: Membership | None = None
        self._tasks: set[asyncio.Task] = set()  # dials and deferred closes
        self._leaving = False
        self._refusals_said: set[tuple[bytes, Refusal]] = set()
        self.run_id = secrets.randbelow(MAX_RUN_ID) + 1  # announced: a new one tells members this node restarted
        # Serving: members left out for corrupt outputs or slowness in their current run (announced; refusal.py).
        self._verdicts = Verdicts()
        self._output_judge: Callable[[bytes, TensorMeasured], Fault | None] | None = None
        self._on_rejected: Callable[[bytes, OutputRejected], None] = lambda node_id, event: None
        self.port: int | None = None
        self.relay_counters = RelayCounters()
        # What address each peer says it sees us at (gossip Observed): behind a NAT, our public mapping.
        self._seen_at: dict[bytes, PeerAddress] = {}
        self.changed = asyncio.Event()  # set whenever a member joins, is lost or leaves
        # mDNS (lan.py): advertise this node, dial members whose records show up.
        self._lan = LanDialer(
            self._lan_record,
            lambda node_id: not (node_id in self._peers or node_id in self._saved.removed or self._leaving),
            lambda node_id, addresses: self._dialer.redial(node_id, addresses)) if lan else None
        self._dialer = Dialer(identity.node_id, self._transport,
                              lambda: {node_id: peer.connection for node_id, peer in self._peers.items()},
                              self._spawn, say, self.name_of, self._unreachable, self._gossiped_addresses)

    # --- lifecycle -------------------------------------------------------------

    async def start(self, port: int | None) -> None:
        """Listen on ``port`` (UDP); without one, the default port or else a free one."""
        try:
            self.port = await self._transport.start(LISTEN_HOST, DEFAULT_QUIC_PORT if port is None else port)
        except PortInUseError:
            if port is not None:
                raise
            self.port = await self._transport.start(LISTEN_HOST, 0)
            self._say(f"UDP port {DEFAULT_QUIC_PORT} is taken; listening for the mesh on {self.port} instead.")
        self._dialer.port = self.port
        self._membership = Membership(self._self_info())

    def ticket(self) -> str:
        assert self.port is not None
        return encode_ticket(Ticket(self.identity.node_id, self._saved.secret, self._own_addresses(MAX_TICKET_ADDRESSES)))

    def rotate_secret(self, remove: tuple[bytes, ...] = ()) -> str:
        """A new secret for every member except ``remove``; returns the new ticket."""
        assert self._membership is not None
        self._membership.rotate_secret(secrets.token_bytes(MESH_SECRET_BYTES), remove, time.monotonic())
        self._process()
        return self.ticket()

    def find_member(self, which: str) -> bytes:
        """A member's id from its name, short id (node_...) or a hex prefix of its id (membership.py)."""
        assert self._membership is not None
        return find_member(self._membership, which)

    async def join(self, ticket: Ticket) -> None:
        """Connect to the node a ticket names (dialer.py: patiently); gossip brings in everyone else."""
        await self._dialer.join(ticket)

    async def run(self) -> None:
        """Heartbeats, fresh capacity figures in gossip and (with mDNS) LAN presence, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            if self._lan is not None:
                tg.create_task(self._lan.run())
            tg.create_task(self._heartbeats())
            tg.create_task(self._dialer.punch_again())

    async def _heartbeats(self) -> None:
        assert self._membership is not None
        last_refresh = time.monotonic()
        while True:
            now = time.monotonic()
            self._membership.heartbeat(now)
            self._forgive_slow(now)
            self._tell_observed_addresses()
            if now - last_refresh >= CAPACITY_REFRESH_S:
                self._membership.update_self(self._self_info())
                if self._lan is not None:
                    self._lan.offer_again(now)
                last_refresh = now
            self._process()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def rejoin(self) -> int:
        """Dial every member remembered from an earlier run; how many."""
        remembered = [(n, a) for n, a in self._saved.members.items() if n != self.identity.node_id]
        for node_id, texts in remembered:
            self._dialer.redial(node_id, peer_addresses(texts))
        return len(remembered)

    async def close(self, *, graceful: bool = True, for_good: bool = False) -> None:
        """Say goodbye to every peer, give them time to move off us, then close everything.

        ``for_good`` (`mesh-inference leave`): peers forget this node, and it forgets the mesh.
        """
        self._leaving = True  # peers stop answering our Pings once we say Leave
        if for_good:
            SavedMesh.forget(self._home)
        if self._membership is not None:
            self._membership.leave(LEFT_FOR_GOOD_REASON if for_good else STOPPED_REASON)
            self._process()
            if graceful and self._peers:
                self._say("Leaving the mesh: waiting for peers to move their work off this node...")
                deadline = time.monotonic() + LEAVE_GRACE_S
                while self._peers and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
        for task in self._tasks:
            task.cancel()
        for peer in list(self._peers.values()):
            await peer.tunnel.close()
        await self._transport.close()

    # --- what the node needs -----------------------------------------------------

    def connected_members(self) -> list[MemberInfo]:
        """Peers with a live connection whose info we have, in a stable order (by id)."""
        assert self._membership is not None
        return sorted((m.info for m in self._membership.members()
                       if m.state is MemberState.CONNECTED and m.info.node_id in self._peers),
                      key=lambda info: info.node_id)

    def reaches(self, node_id: bytes) -> bool:
        """Whether this node holds a connection to ``node_id`` (a member that is leaving keeps its own
        until what runs through it has ended; a lost one has none)."""
        return node_id in self._peers

    @property
    def self_info(self) -> MemberInfo:
        """What this node announces about itself now."""
        assert self._membership is not None
        return self._membership.self_info

    def refusal(self, info: MemberInfo) -> Refusal | None:
        """Why this node, serving, leaves member ``info`` out; or why ``info``, serving, leaves this node out."""
        own = self.self_info
        if own.serving:
            return refusal(info, own)
        return refusal(own, info) if info.serving else None

    def check_outputs(self, judge: Callable[[bytes, TensorMeasured], Fault | None],
                      on_rejected: Callable[[bytes, OutputRejected], None]) -> None:
        """Serving: check the float tensors every peer's rpc-server returns through its tunnel with
        ``judge(peer, tensor)``; a rejected reply is kept from llama-server and reported to ``on_rejected``."""
        self._output_judge, self._on_rejected = judge, on_rejected
        for node_id, peer in self._peers.items():
            self._check_tunnel(node_id, peer.tunnel)

    def _check_tunnel(self, node_id: bytes, tunnel: TunnelListener) -> None:
        if (judge := self._output_judge) is None:
            return
        tunnel.judge = lambda tensor: judge(node_id, tensor)
        tunnel.on_rejected = lambda event: self._on_rejected(node_id, event)

    def refuse_corrupt(self, node_id: bytes, fault: str) -> None:
        """Leave ``node_id`` out, as corrupt_output, until it restarts; announced in gossip so it hears why."""
        if (info := self._member_info(node_id)) is not None:
            self._verdicts.corrupt_found(CorruptOutput(node_id, info.run_id, fault))
            self._verdicts_changed()

    def refuse_slow(self, node_id: bytes, owed_s: float, window_s: float, token_s: float) -> None:
        """Leave ``node_id`` out, as slow, until it restarts or for SLOW_REFUSAL_S; announced in gossip."""
        if (info := self._member_info(node_id)) is not None:
            self._verdicts.slow_found(SlowWorker(node_id, info.run_id, round(owed_s * 1000), round(window_s * 1000),
                                                 max(1, round(token_s * 1000))), time.monotonic())
            self._verdicts_changed()

    def reply_waits_s(self, since: float) -> dict[bytes, float]:
        """Per peer, the seconds since ``since`` (monotonic) its rpc-server owed our llama-server a reply."""
        now = time.monotonic()
        return {node_id: peer.tunnel.reply_waits.owed_s(since, now) for node_id, peer in self._peers.items()}

    def _member_info(self, node_id: bytes) -> MemberInfo | None:
        assert self._membership is not None
        return next((m.info for m in self._membership.members() if m.info.node_id == node_id), None)

    def _verdicts_changed(self) -> None:
        assert self._membership is not None
        self._membership.update_self(self._self_info())
        self._process()
        self.changed.set()

    def _forgive_restarted(self, info: MemberInfo) -> None:
        """A member left out as corrupt_output or slow that restarted (a new run id) may be given layers again."""
        if (reason := self._verdicts.forgive_restarted(info)) is not None:
            self._say(f"{info.name} restarted: it may be given layers again (it was left out as {reason})")
            self._verdicts_changed()

    def _forgive_slow(self, now: float) -> None:
        for node_id in self._verdicts.expire(now):
            self._say(f"{self.name_of(node_id)} may be given layers again: it was left out as slow "
                      f"{SLOW_REFUSAL_S / 60:.0f} minutes ago")
            self._verdicts_changed()

    def tunnel_endpoint(self, node_id: bytes) -> str:
        port = self._peers[node_id].tunnel.port
        return f"{LOOPBACK}:{port}"

    def announce_rpc_order(self, node_ids: tuple[bytes, ...]) -> None:
        assert self._membership is not None
        self._membership.announce_rpc_order(node_ids)
        self._process()

    def mesh_view(self) -> MeshView:
        """This node's side of the mesh, for `mesh-inference status` (status.py)."""
        return MeshView(self.port, self._saved.epoch, tuple(sorted(self._saved.removed)),
                        self._transport.ignored_datagrams, self._transport.refused_connections,
                        self._transport.unadmitted_streams, self.model_sha256, mesh_id(self._saved.secret),
                        self.relay_counters, self._dialer.punch_counters,
                        None if self._lan is None else tuple(self._lan.records()))

    def peer_views(self) -> tuple[PeerView, ...]:
        """Every member we know of, as it stands now (status.py)."""
        assert self._membership is not None
        return tuple(self._peer_view(member.info, member.state, member.learned_via)
                     for member in self._membership.members())

    def _address_in_use(self, peer: _Peer) -> str:
        """Where our packets to ``peer`` go: its address, or for a relayed path the relay's."""
        relay = self._peers.get(self._transport.relay_of(peer.connection) or b"")
        connection = relay.connection if relay is not None else peer.connection
        return str(PeerAddress(*connection.remote_address))

    def _relay_name(self, peer: _Peer | None) -> str | None:
        relay_id = self._transport.relay_of(peer.connection) if peer is not None else None
        return self.name_of(relay_id) if relay_id is not None else None

    def _peer_view(self, info: MemberInfo, state: MemberState, learned_via: bytes | None) -> PeerView:
        assert self._membership is not None
        peer = self._peers.get(info.node_id)
        # Heartbeats run on an identified connection; a member that left keeps its until it closes.
        health = self._membership.health(info.node_id) if peer is not None else None
        counters = peer.tunnel.counters if peer is not None else None
        return PeerView(
            node_id=info.node_id, name=info.name, state=state,
            address=self._address_in_use(peer) if peer is not None else (info.addresses or [None])[0],
            path=None if peer is None else PATH_RELAYED if peer.connection.relayed else PATH_DIRECT,
            via=self._relay_name(peer),
            health=(health.state if health is not None
                    else HealthState.LOST if state is MemberState.LOST else None),
            rtt_last_s=health.rtt_last_s if health else None,
            rtt_p50_s=health.rtt_p50_s if health else None,
            rtt_p95_s=health.rtt_p95_s if health else None,
            quic_rtt_s=peer.connection.rtt if peer else None,
            datagram_bytes=peer.connection.datagram_size if peer else None,
            missed_heartbeats=health.missed if health else None,
            tunnel_port=peer.tunnel.port if peer else None,
            rpc_server_up=info.rpc_ready, serving=info.serving, capacity=dict(info.capacity),
            model_sha256=info.model_sha256, secret_epoch=info.secret_epoch,
            refused=self.refusal(info),
            learned_via=learned_via,
            tunnel=TunnelCounters() if counters is None else dataclasses.replace(counters),
        )

    # --- internals ---------------------------------------------------------------

    def _own_addresses(self, limit: int) -> tuple[PeerAddress, ...]:
        """Where members can dial this node: its interfaces', then those members see it at
        (behind a NAT, its public mappings), then loopback, at most ``limit``."""
        assert self.port is not None
        *interfaces, loopback = reachable_addresses(self.port)
        seen = [address for address in dict.fromkeys(self._seen_at.values())
                if address not in interfaces and address != loopback]
        # Loopback (last) is kept: it is how nodes on one machine meet.
        return (*(interfaces + seen)[: limit - 1], loopback)

    def _tell_observed_addresses(self) -> None:
        """Tell each peer the address its datagrams come from, once and again after it changes (a NAT
        rebinding, a migration)."""
        for peer in self._peers.values():
            if peer.connection.closed or peer.connection.relayed:
                continue  # a relayed path's address is a stand-in (net/relay.py), not where it sees us
            address = format_address(peer.connection.remote_address)
            if address != peer.told_address:
                peer.told_address = address
                peer.connection.send_control(encode_message(Observed(address)))

    def _on_observed(self, node_id: bytes, address: str) -> None:
        """A peer says where it sees us: a new public address goes into gossip and the ticket."""
        try:
            parsed = PeerAddress.parse(address)
        except ValueError:
            return
        if parsed.host == LOOPBACK:
            return
        known = set(self._own_addresses(MAX_TICKET_ADDRESSES))
        self._seen_at[node_id] = parsed
        if parsed in known:
            return
        self._say(f"{self.name_of(node_id)} sees this node at {address}: members elsewhere can dial it there "
                  "(it is in this node's gossip and `mesh-inference ticket` now).")
        assert self._membership is not None
        self._membership.update_self(self._self_info())
        self._process()

    def _self_info(self) -> MemberInfo:
        assert self.port is not None
        addresses = tuple(str(a) for a in self._own_addresses(MAX_ADDRESSES))
        return MemberInfo(
            node_id=self.identity.node_id,
            name=self._name,
            addresses=addresses,
            version=__version__,
            capacity=dataclasses.replace(self._capacity(), held=self._held_for_peers()).to_gossip(),
            serving=self._serving,
            rpc_ready=True,
            llama_build=self.build,
            model_sha256=self.model_sha256,
            secret_epoch=self._saved.epoch,
            run_id=self.run_id,
            corrupt_outputs=self._verdicts.corrupt,
            slow_workers=self._verdicts.slow,
        )

    def held_for_peers_bytes(self) -> int:
        """Memory our rpc-server holds for other nodes' llama-servers (not ours: it connects locally)."""
        return sum(peer.tunnel.counters.inbound_held_bytes for peer in self._peers.values())

    def _held_for_peers(self) -> tuple[tuple[str, int], ...]:
        held = sorted(((held_key(node_id), peer.tunnel.counters.inbound_held_bytes)
                       for node_id, peer in self._peers.items() if peer.tunnel.counters.inbound_held_bytes > 0),
                      key=lambda entry: -entry[1])
        return tuple(sorted(held[:MAX_HELD_ENTRIES]))

    def _unreachable(self, node_id: bytes, reason: str) -> None:
        """A member we heard of could be reached neither directly nor relayed (dialer.py)."""
        assert self._membership is not None
        self._membership.peer_disconnected(node_id, time.monotonic(), reason)
        self._process()

    def _gossiped_addresses(self, node_id: bytes) -> tuple[str, ...] | None:
        info = self._member_info(node_id)
        return None if info is None else info.addresses

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _process(self) -> None:
        """Carry out what membership asks for, and act on what happened."""
        membership = self._membership
        assert membership is not None
        while (action := membership.next_action()) is not None:
            match action:
                case Send(to=to, msg=msg):
                    peer = self._peers.get(to)
                    if peer is not None and not peer.connection.closed:
                        peer.connection.send_control(encode_message(msg))
                case Dial():
                    self._dialer.start(action)
                case Disconnect(node_id=node_id, reason=reason):
                    if (peer := self._peers.get(node_id)) is not None:
                        self._spawn(peer.close_when_idle(reason))
        while (event := membership.next_event()) is not None:
            self._on_event(event)

    def _on_event(self, event: events.Event) -> None:
        """Tell people what happened, keep mesh.json current, and close what must close."""
        match event:
            case events.MemberJoined(info=info, learned_via=via):
                how = f" (learned via gossip from {self.name_of(via)})" if via else ""
                self._say(f"Connected to peer {info.name} ({short_id(info.node_id)}){how}")
                self._say_refusal(info)
                self._forgive_restarted(info)
                self._remember(info.node_id, info.addresses)
                self.changed.set()
            case events.MemberLost(node_id=node_id, reason=reason):
                self._say(f"Lost peer {self.name_of(node_id)}: {reason}")
                self.changed.set()
            case events.MemberLeft(node_id=node_id, reason=reason):
                self._say(f"Peer {self.name_of(node_id)} left the mesh ({reason})")
                if reason == LEFT_FOR_GOOD_REASON:
                    self._remember(node_id, None)
                self.changed.set()
            case events.MemberRemoved(node_id=node_id, by=by):
                # At once, not when idle: a removed member must lose its access now.
                if (peer := self._peers.get(node_id)) is not None:
                    peer.close(f"removed from the mesh by {self.name_of(by)}")
                self._remember(node_id, None)
                self._say(f"Peer {self.name_of(node_id)} was removed from the mesh by {self.name_of(by)}")
                self.changed.set()
            case events.SecretRotated(rekey=rekey):
                self._adopt(rekey.secret, rekey.epoch, rekey.removed)
                self._say(f"The mesh secret was rotated by {self.name_of(rekey.by)}: tickets printed "
                          f"before now admit no one. New ticket: {self.ticket()}")
            case events.MemberUpdated(info=info):
                self._say_refusal(info)
                self._forgive_restarted(info)
                self._remember(info.node_id, info.addresses)
            case events.PeerDegraded() | events.PeerRecovered():
                message = health_message(event, self.name_of(event.node_id))
                log.log(logging.WARNING if isinstance(event, events.PeerDegraded) else logging.INFO,
                        "%s (%s)", message, short_id(event.node_id))
                self._say(message)
            case events.PeerLost(node_id=node_id, missed=missed):
                reason = lost_reason(event)
                log.warning("peer %s lost: %s (%d missed)", short_id(node_id), reason, missed)
                # _serve_peer sees the close, marks the member lost and closes its tunnel.
                if (peer := self._peers.get(node_id)) is not None:
                    peer.close(reason)
            case events.LoopStalled(gap_s=gap_s):
                log.warning("event loop stalled for %.1f s; peer health not judged on this heartbeat", gap_s)

    def _remember(self, node_id: bytes, addresses: tuple[str, ...] | None) -> None:
        """Keep (or, with None, drop) a member's addresses in mesh.json for the next start."""
        saved = self._saved.remembering(node_id, addresses)
        if saved is not self._saved:
            self._saved = saved
            saved.save(self._home)

    def _say_refusal(self, info: MemberInfo) -> None:
        """Tell the person at a member that serving node ``info`` leaves it out, and why; once per refusal."""
        if not info.serving or (found := refusal(self.self_info, info)) is None:
            return
        if (info.node_id, found) in self._refusals_said:
            return
        self._refusals_said.add((info.node_id, found))
        message = found.message(self._name)
        log.error("%s", message)
        self._say(message)

    async def fetch_model(self, node_id: bytes, sha256: str, destination: Path,
                          progress: ProgressCallback) -> Path:
        """Fetch the model file ``sha256`` from member ``node_id`` (resuming a partial one)."""
        peer = self._peers.get(node_id)
        return await fetch_model_over(None if peer is None else peer.connection, sha256, destination,
                                      self.name_of(node_id), progress)

    def holds_model(self, sha256: str, path: Path) -> None:
        """This node now holds the model file ``sha256`` at ``path``: announce it, and offer it."""
        self.model_sha256, self.model_file = sha256, path
        assert self._membership is not None
        self._membership.update_self(self._self_info())
        self._process()

    def _adopt(self, secret: bytes, epoch: int, removed: tuple[bytes, ...]) -> None:
        self._saved = self._saved.rotated(secret, epoch, removed)
        self._saved.save(self._home)
        self._transport.set_secret(secret)
        self._transport.refuse_nodes(removed)
        assert self._membership is not None
        self._membership.update_self(self._self_info())
        if self._lan is not None:
            self._lan.refresh()  # the mesh id follows the secret

    # --- the LAN (mDNS, lan.py) ------------------------------------------------------

    def _lan_record(self) -> LanRecord:
        assert self.port is not None
        return LanRecord(mesh_id(self._saved.secret), self.identity.node_id, self._name,
                         reachable_addresses(self.port))

    def name_of(self, node_id: bytes) -> str:
        assert self._membership is not None
        if node_id == self.identity.node_id:
            return self._name
        info = self._member_info(node_id)
        return info.name if info is not None else short_id(node_id)

    def _resolve_endpoint(self, peer_index: int) -> str | None:
        """REGISTER_PEER's peer id -> the endpoint that reaches that member from here."""
        assert self._membership is not None
        order = self._membership.rpc_order
        if not 0 <= peer_index < len(order):
            return None
        node_id = order[peer_index]
        if node_id == self.identity.node_id:
            return f"{LOOPBACK}:{self._rpc_port}"
        return self.tunnel_endpoint(node_id) if node_id in self._peers else None

    async def _serve_peer(self, connection: PeerConnection) -> None:
        """One admitted connection's whole life; returning closes it."""
        node_id = connection.peer_id
        membership = self._membership
        assert membership is not None
        peer = self._peers.get(node_id)
        joined = peer is None or peer.connection.closed
        if joined:
            tunnel = TunnelListener(connection)
            self._check_tunnel(node_id, tunnel)
            await tunnel.start()
            peer = _Peer(connection, tunnel)
            self._peers[node_id] = peer
        elif (peer.connection.relayed and not connection.relayed) or (
                connection.preferred and not (connection.relayed and not peer.connection.relayed)):
            # Both ends move to this one (a direct path beats a relayed one, else the lower id's
            # dial wins); the tunnel port stays.
            log.info("peer %s: keeping the new %s connection", short_id(node_id),
                     "relayed" if connection.relayed else "direct")
            self._retire(peer, peer.connection)
            peer.connection = connection
            peer.tunnel.use(connection)
        else:
            log.info("peer %s dialed us as we dialed it: keeping the first connection", short_id(node_id))
            self._retire(peer, connection)
        self._serve_streams(peer, connection)
        reason = "connection closed"
        try:
            if joined:
                membership.peer_connected(node_id, time.monotonic())
                self._process()
            while True:
                msg = decode_message(await connection.receive_control())
                if isinstance(msg, Observed):
                    self._on_observed(node_id, msg.address)
                    continue
                membership.receive(node_id, msg, time.monotonic())
                self._process()
        except MeshError as exc:
            reason = connection.close_reason or str(exc)
        finally:
            # A close from our side (a lost heartbeat) cancels this task: its reason is the one.
            reason = connection.close_reason or reason
            peer.retired.discard(connection)
            if peer.connection is connection:  # not retired: the peer is gone from here
                await peer.tunnel.close()
                if self._peers.get(node_id) is peer:
                    del self._peers[node_id]
                    membership.peer_disconnected(node_id, time.monotonic(), reason)
                    self._process()

    def _serve_streams(self, peer: _Peer, connection: PeerConnection) -> None:
        """Streams the peer opens on ``connection``: RPC tunnels and model files."""
        name = short_id(connection.peer_id)
        servers = {
            StreamKind.RPC: lambda reader, writer: serve_inbound_stream(
                reader, writer, self._rpc_port, self._resolve_endpoint, name, counters=peer.tunnel.counters),
            # Only the file we announce, and only while we announce it.
            StreamKind.MODEL_FILE: lambda reader, writer: serve_model_file(
                reader, writer, lambda sha256: self.model_file if sha256 == self.model_sha256 else None, name),
            StreamKind.RELAY_REQUEST: lambda reader, writer: serve_relay_request(
                reader, writer, connection.peer_id, self._open_relay_leg, self.relay_counters),
            StreamKind.RELAY_DELIVERY: lambda reader, writer: self._transport.serve_circuit(
                reader, writer, connection.peer_id),
        }
        connection.set_stream_handler(lambda reader, writer: serve_peer_stream(reader, writer, servers, name))

    async def _open_relay_leg(self, source_id: bytes, target_id: bytes) -> tuple[MeshStreamReader, MeshStreamWriter] | str:
        """For a member asking us to relay: a stream to ``target_id``, or why not (relay.py)."""
        if target_id == source_id or target_id == self.identity.node_id:
            return "a relay carries packets between two other members"
        peer = self._peers.get(target_id)
        if peer is None or peer.connection.closed:
            return f"{short_id(target_id)} is not a member this node is connected to"
        if peer.connection.relayed:
            return f"this node reaches {short_id(target_id)} only through a relay itself"
        reader, writer = await peer.connection.open_stream()
        writer.write(bytes((StreamKind.RELAY_DELIVERY,)) + source_id)
        return reader, writer

    def _retire(self, peer: _Peer, connection: PeerConnection) -> None:
        """No new streams on ``connection``; close it once its streams have ended."""
        peer.retired.add(connection)
        self._spawn(_close_when_unused(connection))
