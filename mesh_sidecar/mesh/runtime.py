"""The mesh as one node sees it: QUIC connections, membership, and one tunnel per peer.

This is the asyncio edge that joins the pure parts together:

    MeshTransport --admitted PeerConnection--> _serve_peer (one task per peer)
        kept or retired, its tunnel made (peers.py)
        its streams served by kind (net/peer_streams.py)
        each control frame -> gossip.decode_message -> Membership.receive
                              (Observed -> observed.py)
        Membership actions -> send_control / dial (dialer.py) / close
        Membership events  -> reactions.py: messages to people, tunnels closed,
                              mesh.json (saved.py); PeerLost (heartbeats, health.py)
                              -> close the connection; ``changes`` notified
    native data relay (data_paths.py) -> tcp+tls routes per peer, its reports -> tunnel counters
    heartbeat timer (heartbeats.py) -> Membership.heartbeat (pings; health judged inside)
    LanDialer (lan.py, with --lan) -> dial members found on the LAN
    serving node -> install_serving -> ServingVerdicts (serving.py)
    peer_views / mesh_view -> status.py (the `status` JSON, metrics, dashboard)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from ..errors import ConnectionClosedError, MeshError, PortInUseError
from ..net.addresses import reachable_addresses
from ..net.connection import PeerConnection
from ..net.data_plane.process import DataRelay, bind_data_port
from ..net.discovery import LanRecord, mesh_id
from ..net.model_transfer import fetch_model_over
from ..net.packet_relay import RelayCounters
from ..net.peer_streams import StreamServices, serve_streams
from ..net.streams import StreamPair
from ..net.transport import MeshTransport
from ..net.tunnel import TunnelCounters
from ..ports import DEFAULT_QUIC_PORT
from ..progress import ProgressCallback
from ..wire.auth import MESH_SECRET_BYTES
from ..wire.gossip import (
    MAX_ADDRESSES,
    MemberInfo,
    Observed,
    OfferedDevice,
    Rekey,
    ServedModel,
    decode_message,
    encode_message,
)
from ..wire.layer_share import LayersFetched, LayerShare
from ..wire.rpc_outputs import HISTORY_SAMPLES, MIN_HISTORY_SAMPLES, NORM_RATIO
from ..wire.ticket import MAX_TICKET_ADDRESSES, Ticket, encode_ticket
from .changes import Changes
from .config import MeshConfig
from .data_paths import DataPaths
from .dialer import Dialer
from .health import Sign
from .heartbeats import Heartbeats
from .lan import LanDialer
from .layer_exchange import LayerExchange
from .membership import Dial, Disconnect, MemberState, Send, find_member
from .observed import OwnAddresses
from .own_entry import OwnEntry
from .peers import LEAVE_GRACE_S, PeerTable
from .reactions import LEFT_FOR_GOOD_REASON, EventReactions, MeshSide
from .rpc_endpoints import RpcEndpoints
from .saved import SavedMesh
from .serving import OnRejected, ServingVerdicts
from .status import MeshView, PeerView, mesh_view, peer_views

log = logging.getLogger(__name__)

LISTEN_HOST = "0.0.0.0"
STOPPED_REASON = "node stopped"


class Mesh:
    """One node's membership in the mesh, from its QUIC port to its tunnel ports."""

    def __init__(self, config: MeshConfig) -> None:
        identity, name, home, rpc_port, say = config.identity, config.name, config.home, config.rpc_port, config.say
        timings, saved = config.timings, config.saved
        self.identity = identity
        self._timings = timings
        self._name = name
        self._home = home
        self._rpc_port = rpc_port
        self._say = say
        self._own = OwnEntry(config)  # what this node announces about itself
        self._saved = saved
        self.changes = Changes()  # a member joined, was lost or left, or a verdict changed
        self.layers = LayerExchange(self.changes)  # layers to fetch from the hub, and workers' reports
        self.relay_counters = RelayCounters()
        self._transport = MeshTransport(identity, saved.secret, self._serve_peer, dial_timeout_s=timings.dial_timeout_s,
                                        on_unreachable=lambda node_id: self.suspect(node_id, Sign.UNREACHABLE))
        self._transport.refuse_nodes(saved.removed)
        self._tasks: set[asyncio.Task[None]] = set()  # dials and deferred closes
        self._relay_task: asyncio.Task[None] | None = None  # the native data relay's, from run to close
        self._data_relay_binary = config.data_relay
        self._peers = PeerTable(identity.node_id, self._spawn, retire_idle_s=timings.retire_idle_s,
                                retire_poll_s=timings.retire_poll_s)
        self._addresses = OwnAddresses()
        self._leaving = False
        # The serving side: its output checks and the members it leaves out (install_serving).
        self.verdicts = ServingVerdicts(self._peers, lambda node_id: self._membership.info_of(node_id),
                                        self.name_of, say, self._verdicts_changed)
        self.data_paths = DataPaths(None, self.verdicts, self._peer_counters,
                                    on_reset=lambda node_id: self.suspect(node_id, Sign.RESET))
        self._peers.native = self.data_paths
        self._endpoints = RpcEndpoints(self._peers, rpc_port)  # members' rpc-servers by the serving nodes' orders
        self._streams = StreamServices(
            rpc_port, lambda sender, index: self._endpoints.resolve(self._membership, sender, index), self._own.offered,
            self._peers.open_relay_leg, self.relay_counters, self._transport.serve_circuit,
            config.local_api, config.forward_token)
        # Without a port yet, this node announces no addresses: start() adds them.
        self._membership = config.membership(self._self_info(), degraded_after_s=timings.degraded_after_s,
                                      lost_after_s=timings.lost_after_s,
                                      heartbeat_interval_s=timings.heartbeat_interval_s)
        self._heartbeats = Heartbeats(self._membership, self._peers, self.verdicts, timings.heartbeat_interval_s,
                                      process=self._process, refresh=self._refresh, leaving=lambda: self._leaving)
        # A sign that a member's process is gone: probed at once, judged when the probe's time is up.
        self.suspect = self._heartbeats.suspect
        # mDNS (lan.py): advertise this node, dial members whose records show up.
        self._lan = LanDialer(
            self._lan_record,
            lambda node_id: not (node_id in self._peers or node_id in self._saved.removed or self._leaving),
            lambda node_id, addresses: self._dialer.redial(node_id, addresses)) if config.lan else None
        self._reactions = EventReactions(MeshSide(
            # _say read at each line: tests listen by replacing it.
            self._peers, self.verdicts, self.changes, lambda line: self._say(line), self.name_of,
            lambda: self.self_info, self._remember, self._rekeyed, self._route, self.layers))
        self.detection_s = self._reactions.detection_s  # how long the last loss of a member took to know
        self._dialer = Dialer(identity.node_id, self._transport,
                              lambda: {node_id: peer.connection for node_id, peer in self._peers.items()},
                              self._spawn, say, self.name_of, self._disconnected, self._membership.info_of,
                              join_retry_s=timings.join_retry_s, join_patience_s=timings.join_patience_s)

    # --- lifecycle -------------------------------------------------------------

    async def start(self, port: int | None) -> None:
        """Listen on ``port`` (UDP); without one, the default port or else a free one."""
        try:
            await self._transport.start(LISTEN_HOST, DEFAULT_QUIC_PORT if port is None else port)
        except PortInUseError:
            if port is not None:
                raise
            await self._transport.start(LISTEN_HOST, 0)
            self._say(f"UDP port {DEFAULT_QUIC_PORT} is taken; listening for the mesh on {self.port} instead.")
        if self._data_relay_binary is not None:
            relay = DataRelay(self._data_relay_binary, self.identity, bind_data_port(self.port),
                              self.data_paths.on_report, self.data_paths.relay_exited,
                              guard=(HISTORY_SAMPLES, MIN_HISTORY_SAMPLES, NORM_RATIO),
                              take_back=self.data_paths.take_back)
            relay.set_rpc_port(self._rpc_port)
            self.data_paths.relay = relay
        self._membership.update_self(self._self_info())

    @property
    def port(self) -> int | None:
        """The UDP port this node listens on for the mesh; None before ``start``."""
        return self._transport.port

    def ticket(self) -> str:
        assert self.port is not None
        return encode_ticket(Ticket(self.identity.node_id, self._saved.secret,
                                    self._addresses.listing(self.port, MAX_TICKET_ADDRESSES)))

    def rotate_secret(self, remove: tuple[bytes, ...] = ()) -> str:
        """A new secret for every member except ``remove``; returns the new ticket."""
        self._membership.rotate_secret(secrets.token_bytes(MESH_SECRET_BYTES), remove, time.monotonic())
        self._process()
        return self.ticket()

    def find_member(self, which: str) -> bytes:
        """A member's id from its name, short id (node_...) or a hex prefix of its id (membership.py)."""
        return find_member(self._membership, which)

    async def join(self, ticket: Ticket) -> None:
        """Connect to the node a ticket names (dialer.py: patiently); gossip brings in everyone else."""
        await self._dialer.join(ticket)

    async def run(self) -> None:
        """Heartbeats, fresh capacity figures in gossip and (with mDNS) LAN presence, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            if self._lan is not None:
                tg.create_task(self._lan.run())
            tg.create_task(self._heartbeats.run())
            tg.create_task(self._dialer.punch_again())
            if self.data_paths.relay is not None:
                tg.create_task(self._run_relay(self.data_paths.relay))

    async def _run_relay(self, relay: DataRelay) -> None:
        """The relay outlives run (peers move their work off a leaving node through it; close() stops it)."""
        self._relay_task = asyncio.create_task(relay.run())
        await asyncio.shield(self._relay_task)

    def rejoin(self) -> int:
        """Dial every member remembered from an earlier run; how many."""
        return self._dialer.rejoin(self._saved.members)

    async def close(self, *, graceful: bool = True, for_good: bool = False) -> None:
        """Say goodbye to every peer, give them time to move off us, then close everything; ``for_good``
        (`mesh-inference leave`): peers forget this node, and it forgets the mesh."""
        self._leaving = True  # peers stop answering our Pings once we say Leave
        if for_good:
            SavedMesh.forget(self._home)
        self._membership.leave(LEFT_FOR_GOOD_REASON if for_good else STOPPED_REASON)
        self._process()
        if graceful and self._peers:
            self._say("Leaving the mesh: waiting for peers to move their work off this node...")
            await self._peers.wait_empty(LEAVE_GRACE_S)
        for task in self._tasks:
            task.cancel()
        if self._relay_task is not None and not self._relay_task.done():  # done: its failure ended run
            self._relay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._relay_task
        await self._peers.close_tunnels()
        await self._transport.close()

    # --- what the node needs -----------------------------------------------------

    def connected_members(self) -> list[MemberInfo]:
        """Peers with a live connection whose info we have, in a stable order (by id)."""
        return sorted((m.info for m in self._membership.members()
                       if m.state is MemberState.CONNECTED and m.info.node_id in self._peers),
                      key=lambda info: info.node_id)

    def reaches(self, node_id: bytes) -> bool:
        """Whether this node holds a connection to ``node_id`` (a member that is leaving keeps its own
        until what runs through it has ended; a lost one has none)."""
        return node_id in self._peers

    @property
    def model_sha256(self) -> str:
        """The model this node holds, as announced ("" when it holds none)."""
        return self._own.model_sha256

    @property
    def devices(self) -> tuple[OfferedDevice, ...]:
        """What our rpc-server offers, as announced."""
        return self._own.devices

    @property
    def self_info(self) -> MemberInfo:
        """What this node announces about itself now."""
        return self._membership.self_info

    def install_serving(self, check_outputs: bool, on_rejected: OnRejected) -> None:
        """This node serves, from now on: judge the float tensors every peer's rpc-server returns through
        its tunnel by the output rule (``check_outputs``; False: no check), report a rejected reply to
        ``on_rejected``. Once; the serving side then leaves members out through ``verdicts``."""
        self.verdicts.install(check_outputs, on_rejected)

    def new_serving_session(self) -> None:
        """llama-server starts again: the output rule's histories per worker begin anew, ours and the relay's."""
        self.verdicts.new_session()
        if (relay := self.data_paths.relay) is not None:
            relay.new_session()

    def announce_serving(self, serves: Callable[[], ServedModel | None]) -> None:
        """What this node serves, asked again at each announcement; announced now."""
        self._own.serves = serves
        self._announce_self()

    def serving_changed(self) -> None:
        """What this node serves changed (loading -> ready, a new plan): tell the members now."""
        self._announce_self()

    def devices_measured(self, devices: tuple[OfferedDevice, ...]) -> None:
        """Our devices' speeds were measured again (llama/calibration.py): tell the members, and our planning."""
        self._own.devices_measured(devices)
        self._announce_self()
        self.changes.notify()

    async def open_stream(self, node_id: bytes) -> StreamPair:
        """A new stream to member ``node_id`` (its kind byte is the caller's to write)."""
        peer = self._peers.get(node_id)
        if peer is None or peer.connection.closed:
            raise ConnectionClosedError(f"no connection to {self.name_of(node_id)} now")
        return await peer.connection.open_stream()

    def tunnel_endpoint(self, node_id: bytes) -> str:
        return self._peers.tunnel_endpoint(node_id)

    def announce_rpc_order(self, node_ids: tuple[bytes, ...]) -> None:
        self._membership.announce_rpc_order(node_ids)
        self._process()

    def send_layers(self, node_id: bytes, msg: LayerShare | LayersFetched) -> None:
        """A layer share to a worker (this node serves), or the report of one to its serving node."""
        self._membership.send_layers(node_id, msg)
        self._process()

    def held_for_peers_bytes(self) -> int:
        """Memory our rpc-server holds for other nodes' llama-servers (not ours: it connects locally)."""
        return self._peers.held_bytes()

    async def fetch_model(self, node_id: bytes, sha256: str, progress: ProgressCallback) -> Path:
        """Fetch the model ``sha256`` (its identity) from member ``node_id``, resuming a partial fetch;
        its path (a split model's first shard)."""
        peer = self._peers.get(node_id)
        return await fetch_model_over(None if peer is None else peer.connection, sha256,
                                      self.name_of(node_id), progress)

    def holds_model(self, sha256: str, path: Path) -> None:
        """This node now holds the model ``sha256`` (its identity) at ``path``: announce it, and offer its
        files (ModelError if they are not there)."""
        self._own.holds_model(sha256, path)
        self._announce_self()

    def name_of(self, node_id: bytes) -> str:
        return self._membership.name_of(node_id)

    def mesh_view(self) -> MeshView:
        """This node's side of the mesh, for `mesh-inference status` (status.py)."""
        return mesh_view(self.port, self.data_paths.port, self._saved, self.model_sha256, self._transport,
                         self.relay_counters, self._dialer.punch_counters,
                         None if self._lan is None else tuple(self._lan.records()))

    def peer_views(self) -> tuple[PeerView, ...]:
        """Every member we know of, as it stands now (status.py)."""
        return peer_views(self._membership, self._peers, self._transport.relay_of, self.data_paths.path_of)

    # --- internals ---------------------------------------------------------------

    def _announce_self(self) -> None:
        """Gossip what this node is now (its addresses, model, verdicts...)."""
        self._membership.update_self(self._self_info())
        self._process()

    def _verdicts_changed(self) -> None:
        self._announce_self()
        self.changes.notify()

    def _on_observed(self, node_id: bytes, address: str) -> None:
        """A peer says where it sees us: a new public address goes into gossip and the ticket."""
        if self._addresses.heard(node_id, address, self.port):
            self._say(f"{self.name_of(node_id)} sees this node at {address}: members elsewhere can dial it there "
                      "(it is in this node's gossip and `mesh-inference ticket` now).")
            self._announce_self()

    def _self_info(self) -> MemberInfo:
        return self._own.info(tuple(str(a) for a in self._addresses.listing(self.port, MAX_ADDRESSES)),
                              self._peers.held_entries(), self._saved.epoch, self.verdicts, self.data_paths.port)

    def _refresh(self, now: float) -> None:
        """Fresh capacity figures in gossip, and (with mDNS) on the LAN."""
        self._membership.update_self(self._self_info())
        if self._lan is not None:
            self._lan.offer_again(now)

    def _disconnected(self, node_id: bytes, reason: str) -> None:
        """Our connection to ``node_id`` ended, or (dialer.py) it could be reached neither directly nor relayed."""
        self._membership.peer_disconnected(node_id, time.monotonic(), reason)
        self._process()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _process(self) -> None:
        """Carry out what membership asks for, and act on what happened."""
        while (action := self._membership.next_action()) is not None:
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
        while (event := self._membership.next_event()) is not None:
            self._reactions.on_event(event)
        if (relay := self.data_paths.relay) is not None:
            relay.set_endpoints(self._endpoints.of_orders(self._membership))

    def _remember(self, node_id: bytes, addresses: tuple[str, ...] | None) -> None:
        """Keep (or, with None, drop) a member's addresses in mesh.json for the next start."""
        saved = self._saved.remembering(node_id, addresses)
        if saved is not self._saved:
            self._saved = saved
            saved.save(self._home)

    def _rekeyed(self, rekey: Rekey) -> None:
        """A member rotated the secret (this rotation won): adopt it, and say the new ticket."""
        self._saved = self._saved.rotated(rekey.secret, rekey.epoch, rekey.removed)
        self._saved.save(self._home)
        self._transport.set_secret(rekey.secret)
        self._transport.refuse_nodes(rekey.removed)
        self._membership.update_self(self._self_info())
        if self._lan is not None:
            self._lan.refresh()  # the mesh id follows the secret
        self._say(f"The mesh secret was rotated by {self.name_of(rekey.by)}: tickets printed "
                  f"before now admit no one. New ticket: {self.ticket()}")

    def _lan_record(self) -> LanRecord:
        assert self.port is not None
        return LanRecord(mesh_id(self._saved.secret), self.identity.node_id, self._name,
                         reachable_addresses(self.port))

    def _route(self, node_id: bytes) -> None:
        """Which data path a connected member's tunnels take (data_paths.py), on news of it or its connection."""
        peer, info = self._peers.get(node_id), self._membership.info_of(node_id)
        if peer is not None and info is not None:
            self.data_paths.peer_seen(node_id, peer.connection, info.data_port)

    def _peer_counters(self, node_id: bytes) -> TunnelCounters | None:
        peer = self._peers.get(node_id)
        return None if peer is None else peer.tunnel.counters

    async def _serve_peer(self, connection: PeerConnection) -> None:
        """One admitted connection's whole life; returning closes it."""
        node_id = connection.peer_id
        peer, joined = await self._peers.admit(connection, self.verdicts)
        serve_streams(connection, self._streams, peer.tunnel.counters)
        if self.data_paths.relay is not None:
            # Admitted: its relay may dial ours from now on, from where its QUIC connection comes.
            self.data_paths.relay.member(node_id, () if connection.relayed else (connection.remote_address[0],))
        self._route(node_id)
        reason = "connection closed"
        try:
            if joined:
                self._membership.peer_connected(node_id, time.monotonic())
                self._process()
            while True:
                msg = decode_message(await connection.receive_control())
                if isinstance(msg, Observed):
                    self._on_observed(node_id, msg.address)
                    continue
                self._membership.receive(node_id, msg, time.monotonic())
                self._process()
        except MeshError as exc:
            reason = connection.close_reason or str(exc)
        finally:
            # A close from our side (a lost heartbeat) cancels this task: its reason is the one.
            reason = connection.close_reason or reason
            if await self._peers.release(peer, connection):
                self.data_paths.peer_gone(node_id)
                self._disconnected(node_id, reason)
