"""In-process meshes for tests: real QUIC on loopback, no llama.cpp processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mesh_sidecar.home import NodeHome
from mesh_sidecar.identity import NodeIdentity, generate_identity
from mesh_sidecar.llama.capacity import Capacity
from mesh_sidecar.mesh.config import MeshConfig
from mesh_sidecar.mesh.runtime import Mesh
from mesh_sidecar.mesh.saved import SavedMesh
from mesh_sidecar.mesh.status import peers_json
from mesh_sidecar.wire.gossip import LlamaBuild
from mesh_sidecar.wire.rpc_hello import RpcVersion
from mesh_sidecar.wire.ticket import PeerAddress, Ticket
from tests.helpers.waiting import wait_until_async

HANG_S = 15.0  # a wait that only fails if something hangs
# What a node of the pinned stock build announces.
PINNED_BUILD = LlamaBuild(RpcVersion(7, 0, 0), False, "llama-cpp-python 0.3.36 stock")


def tiny_capacity() -> Capacity:
    return Capacity(1, 1, 1)


def make_mesh(root: Path, name: str, secret: bytes, say: Callable[[str], None] = lambda _m: None,
              rpc_port: int = 1, identity: NodeIdentity | None = None, **options) -> Mesh:
    """A Mesh with its own home under ``root``; by default rpc port 1 (nothing listens there)."""
    home = NodeHome(root / name)
    home.create()
    saved = SavedMesh(secret)
    saved.save(home)
    return Mesh(MeshConfig(identity or generate_identity(), name, home, rpc_port, tiny_capacity, say, saved=saved,
                           **{"build": PINNED_BUILD, **options}))


def ticket_of(mesh: Mesh, secret: bytes) -> Ticket:
    assert mesh.port is not None
    return Ticket(mesh.identity.node_id, secret, (PeerAddress("127.0.0.1", mesh.port),))


def row(mesh: Mesh, peer: Mesh) -> dict:
    """``mesh``'s status row for ``peer``; empty until ``mesh`` knows it."""
    return next((r for r in peers_json(mesh.peer_views()) if r["id"] == peer.identity.node_id.hex()), {})


async def wait_for(predicate, what: str, timeout_s: float = HANG_S) -> None:
    """``waiting.wait_until_async`` with the bound these tests use when only a hang should fail them."""
    await wait_until_async(predicate, timeout_s, what)
