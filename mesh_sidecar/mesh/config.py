"""What a ``Mesh`` is made of, as one frozen value (``MeshConfig``): the node it runs for, what it
announces, what it hands streams to, and how long it waits (tests give shorter timings)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..home import NodeHome
from ..identity import NodeIdentity
from ..llama.capacity import Capacity
from ..net.api_forward import ApiServer
from ..wire.gossip import LlamaBuild, OfferedDevice
from .membership import Membership
from .saved import SavedMesh
from .timings import MeshTimings


def _no_local_api() -> ApiServer | None:
    return None


@dataclass(frozen=True)
class MeshConfig:
    """Everything a ``Mesh`` is given when it is made."""

    identity: NodeIdentity
    name: str  # announced to members
    home: NodeHome  # mesh.json lives here (saved.py)
    rpc_port: int  # this node's rpc-server, on loopback: peers' RPC streams reach only this port
    capacity: Callable[[], Capacity]  # what this node offers now, read at each announcement
    say: Callable[[str], None]  # a line for the user
    saved: SavedMesh  # the mesh's secret and remembered members (the ticket's, or the last run's)
    build: LlamaBuild  # announced; members and the serving node compare it (exclusion.py)
    serving: bool = False  # announced: this node serves a model
    model_sha256: str = ""  # the model file this node holds, announced; "" when it holds none
    model_file: Path | None = None  # that file (members may fetch it); None: none to offer
    lan: bool = False  # advertise on the LAN and dial members found there (mDNS, lan.py)
    local_api: Callable[[], ApiServer | None] = _no_local_api  # where members' forwarded requests go
    forward_token: str = ""  # what members' forwarded requests carry to our API
    timings: MeshTimings = MeshTimings()
    membership: type[Membership] = Membership  # tests put a faulty one in its place
    devices: tuple[OfferedDevice, ...] = ()  # what our rpc-server offers, as it listed them
    data_relay: Path | None = None  # the native relay's binary; None: every tunnel over QUIC
