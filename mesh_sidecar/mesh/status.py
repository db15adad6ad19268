"""The mesh as `mesh-inference status` shows it: typed views, and the one place they become JSON.

:func:`peer_views` builds a :class:`PeerView` per member the mesh knows of from
its membership and its peer table; the mesh runtime adds a :class:`MeshView` of
its own side (``Mesh.peer_views``, ``Mesh.mesh_view``).
Code that decides things (the serving supervisor, metrics, the dashboard) reads
these typed values; :func:`peer_json` and :func:`mesh_json` turn them into the
dicts that ``status --json`` prints and tests read, in milliseconds where the
JSON names them so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..identity import short_id
from ..net.connection import PeerConnection
from ..net.discovery import LanRecord, lan_record_json, mesh_id
from ..net.packet_relay import RelayCounters
from ..net.transport import MeshTransport
from ..net.tunnel import TunnelCounters
from ..wire.gossip import OfferedDevice
from ..wire.ticket import PeerAddress
from .exclusion import Exclusion, exclusion_between
from .health import HealthState
from .membership import Membership, MemberState, MemberStatus
from .peers import Peer
from .saved import SavedMesh


def rtt_ms(seconds: float | None) -> float | None:
    """A round trip as status JSON and receipts show it: milliseconds, to 0.01 ms."""
    return None if seconds is None else round(seconds * 1000, 2)


PATH_DIRECT = "direct"
PATH_RELAYED = "relayed"  # through a member both reach (net/packet_relay.py)


@dataclass(frozen=True)
class PeerView:
    """One member this node knows of, as it stands now. Connection figures are None (counters
    0) when this node holds no connection to it."""

    node_id: bytes
    name: str
    state: MemberState
    address: str | None  # the connection's remote address, else the first the member announced
    path: str | None  # PATH_DIRECT or PATH_RELAYED while this node holds a connection to it, else None
    via: str | None  # with PATH_RELAYED: the relaying member's name
    # How RPC reaches it: "tcp+tls" (native relay), "quic" or "relayed via NAME"; None: no connection.
    data_path: str | None
    data_port: int  # the TCP port its native data relay listens on, as it announces it (0: it runs none)
    health: HealthState | None  # from heartbeats; LOST for a lost member without a connection
    rtt_last_s: float | None  # the last heartbeat's round trip
    rtt_p50_s: float | None
    rtt_p95_s: float | None
    quic_rtt_s: float | None  # QUIC's smoothed estimate
    datagram_bytes: int | None  # as probed (path_mtu.py)
    missed_heartbeats: int | None
    tunnel_port: int | None
    rpc_server_up: bool
    serving: bool
    capacity: dict[str, int]
    devices: tuple[OfferedDevice, ...]  # what its rpc-server offers
    model_sha256: str  # "" when it holds no model file
    secret_epoch: int
    excluded: Exclusion | None  # why the serving node (this one, or it) leaves it (or this one) out
    learned_via: bytes | None
    # Bytes and RPC commands through its tunnels both ways, as of this view (a copy).
    tunnel: TunnelCounters = field(default_factory=TunnelCounters)

    @property
    def rtt_typical_s(self) -> float | None:
        """The median heartbeat round trip, or the last one before there is a median."""
        return self.rtt_p50_s if self.rtt_p50_s is not None else self.rtt_last_s


@dataclass
class PunchCounters:
    """Direct dials to members learned through others (hole punching), and how many got through."""

    attempts: int = 0
    successes: int = 0


@dataclass(frozen=True)
class MeshView:
    """This node's side of the mesh."""

    quic_port: int | None
    data_port: int  # the native data path's TCP port (0: no relay)
    secret_epoch: int
    removed: tuple[bytes, ...]  # node keys this node refuses, sorted
    ignored_datagrams: int
    refused_connections: int
    unadmitted_streams: int
    model_sha256: str
    mesh_id: str
    relay: RelayCounters  # as a relay for others
    punch: PunchCounters
    lan: tuple[LanRecord, ...] | None  # records seen on the LAN; None without --lan


def devices_json(devices: Sequence[OfferedDevice]) -> list[dict[str, Any]]:
    """Devices as `status --json` shows them (a member's from gossip, or this node's own)."""
    return [{"name": d.name, "total_bytes": d.total_bytes, "free_bytes": d.free_bytes,
             "decode_bytes_per_s": d.decode_bytes_per_s or None, "prefill_bytes_per_s": d.prefill_bytes_per_s or None}
            for d in devices]


def mesh_view(port: int | None, data_port: int, saved: SavedMesh, model_sha256: str, transport: MeshTransport,
              relay: RelayCounters, punch: PunchCounters, lan: tuple[LanRecord, ...] | None) -> MeshView:
    """This node's side of the mesh, listening on ``port`` (None before it starts) and ``data_port``."""
    return MeshView(port, data_port, saved.epoch, tuple(sorted(saved.removed)), transport.ignored_datagrams,
                    transport.admission.refused_connections, transport.admission.unadmitted_streams,
                    model_sha256, mesh_id(saved.secret), relay, punch, lan)


def peer_json(view: PeerView) -> dict[str, Any]:
    """One entry of ``status --json``'s "peers"."""
    return {
        "id": view.node_id.hex(),
        "short_id": short_id(view.node_id),
        "name": view.name,
        "state": view.state.value,
        "address": view.address,
        # How our packets reach it: "direct" (our own QUIC connection) and where, or None when not connected.
        "path": view.path,
        "via": view.via,
        "data_path": view.data_path,
        "data_port": view.data_port or None,
        "addr": view.address if view.path is not None else None,
        "health": None if view.health is None else view.health.value,
        "rtt_ms": rtt_ms(view.rtt_last_s),
        "rtt_p50_ms": rtt_ms(view.rtt_p50_s),
        "rtt_p95_ms": rtt_ms(view.rtt_p95_s),
        "quic_rtt_ms": rtt_ms(view.quic_rtt_s),
        "datagram_bytes": view.datagram_bytes,
        "missed_heartbeats": view.missed_heartbeats,
        "tunnel_port": view.tunnel_port,
        "rpc_server_up": view.rpc_server_up,
        "serving": view.serving,
        "capacity": dict(view.capacity),
        "devices": devices_json(view.devices),
        "model_sha256": view.model_sha256 or None,
        "secret_epoch": view.secret_epoch,
        "refused": None if view.excluded is None else view.excluded.reason,
        "refused_detail": None if view.excluded is None else view.excluded.detail,
        "learned_via": short_id(view.learned_via) if view.learned_via else None,
        # Our tunnel to its rpc-server...
        "bytes_to_peer": view.tunnel.bytes_to_peer,
        "bytes_from_peer": view.tunnel.bytes_from_peer,
        # ...and its streams into ours: bytes and RPC commands.
        "bytes_from_peer_in": view.tunnel.inbound_bytes_from_peer,
        "bytes_to_peer_in": view.tunnel.inbound_bytes_to_peer,
        "rpc_commands": view.tunnel.rpc_commands,
        # Of those, the bytes that moved layer outputs (both ways): from the serving node
        # without --b2b, from the worker before us in the plan with it.
        "activation_bytes_in": view.tunnel.inbound_activation_bytes,
    }


def peers_json(views: Sequence[PeerView]) -> list[dict[str, Any]]:
    """``status --json``'s "peers": one entry per member this node knows of."""
    return [peer_json(view) for view in views]


def mesh_json(view: MeshView) -> dict[str, Any]:
    """``status --json``'s "mesh"."""
    return {"quic_port": view.quic_port, "data_port": view.data_port or None, "secret_epoch": view.secret_epoch,
            "removed": [short_id(n) for n in view.removed],
            "ignored_datagrams": view.ignored_datagrams,
            "refused_connections": view.refused_connections,
            "unadmitted_streams": view.unadmitted_streams,
            "model_sha256": view.model_sha256 or None,
            "mesh_id": view.mesh_id,
            "relay": dataclasses.asdict(view.relay),
            "punch": dataclasses.asdict(view.punch),
            "lan": None if view.lan is None else [
                {**lan_record_json(r), "this_mesh": r.mesh_id == view.mesh_id} for r in view.lan]}


def peer_views(membership: Membership, peers: Mapping[bytes, Peer],
               relay_of: Callable[[PeerConnection], bytes | None],
               data_path_of: Callable[[bytes], str]) -> tuple[PeerView, ...]:
    """Every member ``membership`` knows of, as it stands now; ``peers``: those we hold a connection to,
    ``relay_of``: the member relaying a connection (net/transport.py)."""

    def address_in_use(peer: Peer) -> str:
        """Where our packets to ``peer`` go: its address, or for a relayed path the relay's."""
        relay_id = relay_of(peer.connection)
        via = peers.get(relay_id) if relay_id is not None else None
        return str(PeerAddress(*(via or peer).connection.remote_address))

    def view(member: MemberStatus) -> PeerView:
        info, state = member.info, member.state
        peer = peers.get(info.node_id)
        # Heartbeats run on an identified connection; a member that left keeps its until it closes.
        health = membership.health(info.node_id) if peer is not None else None
        relay_id = relay_of(peer.connection) if peer is not None else None
        return PeerView(
            node_id=info.node_id, name=info.name, state=state,
            address=address_in_use(peer) if peer is not None else (info.addresses or [None])[0],
            path=None if peer is None else PATH_RELAYED if peer.connection.relayed else PATH_DIRECT,
            via=membership.name_of(relay_id) if relay_id is not None else None,
            data_path=(None if peer is None else f"relayed via {membership.name_of(relay_id)}"
                       if relay_id is not None else data_path_of(info.node_id)),
            data_port=info.data_port,
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
            devices=info.devices, model_sha256=info.model_sha256, secret_epoch=info.secret_epoch,
            excluded=exclusion_between(membership.self_info, info),
            learned_via=member.learned_via,
            tunnel=TunnelCounters() if peer is None else dataclasses.replace(peer.tunnel.counters),
        )

    return tuple(view(member) for member in membership.members())
