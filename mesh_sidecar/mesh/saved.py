"""What a node remembers of its mesh between runs: ``<home>/mesh.json``, readable by its user only.

    {"secret": hex, "epoch": int, "removed": [hex node id, ...],
     "members": {hex node id: ["host:port", ...], ...}}

The secret admits this node to its mesh after a restart without a ticket; the
members are dialed again (``Mesh.rejoin``); removed nodes are never admitted
again. `mesh-inference leave` deletes the file.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass, field

from ..errors import UsageError
from ..home import NodeHome, write_private_file
from ..net.discovery import mesh_id
from ..wire.auth import MESH_SECRET_BYTES
from ..wire.ticket import Ticket

MESH_FILE_NAME = "mesh.json"
MAX_REMEMBERED_MEMBERS = 64


@dataclass(frozen=True)
class SavedMesh:
    """What a node remembers of its mesh in ``<home>/mesh.json`` (mode 0600)."""

    secret: bytes
    epoch: int = 0  # rotations of the secret this node has taken part in
    removed: frozenset[bytes] = frozenset()  # node keys never admitted again
    # Members met, by id, with their last addresses: dialed again after a restart.
    members: dict[bytes, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def load(cls, home: NodeHome, ticket: Ticket | None) -> SavedMesh:
        """From the ticket when joining, else the one remembered, else a new mesh."""
        path = home.root / MESH_FILE_NAME
        if ticket is not None:
            saved = cls(ticket.mesh_secret)
        elif path.exists():
            try:
                data = json.loads(path.read_text())
                saved = cls(bytes.fromhex(data["secret"]), int(data.get("epoch", 0)),
                            frozenset(bytes.fromhex(n) for n in data.get("removed", [])),
                            {bytes.fromhex(n): tuple(str(a) for a in addresses)
                             for n, addresses in data.get("members", {}).items()})
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UsageError(f"{path} is damaged ({exc}); move it away to start a new mesh.") from exc
            if len(saved.secret) != MESH_SECRET_BYTES:
                raise UsageError(f"{path} holds a secret of the wrong length; move it away to start a new mesh.")
        else:
            saved = cls(secrets.token_bytes(MESH_SECRET_BYTES))
        saved.save(home)
        return saved

    def save(self, home: NodeHome) -> None:
        write_private_file(home.root / MESH_FILE_NAME, json.dumps({
            "secret": self.secret.hex(), "epoch": self.epoch,
            "removed": sorted(n.hex() for n in self.removed),
            "members": {n.hex(): list(a) for n, a in self.members.items()}}))

    def remembering(self, node_id: bytes, addresses: tuple[str, ...] | None) -> SavedMesh:
        """With a member's addresses kept (or, with None, dropped); the oldest go past the limit."""
        members = dict(self.members)
        members.pop(node_id, None)  # re-inserted last: the oldest are dropped first
        if addresses is not None:
            members[node_id] = addresses
            while len(members) > MAX_REMEMBERED_MEMBERS:
                members.pop(next(iter(members)))
        return self if members == self.members else dataclasses.replace(self, members=members)

    def rotated(self, secret: bytes, epoch: int, removed: tuple[bytes, ...]) -> SavedMesh:
        """After a Rekey: the new secret, and the removed members refused and forgotten."""
        return SavedMesh(secret, epoch, self.removed | frozenset(removed),
                         {n: a for n, a in self.members.items() if n not in removed})

    @staticmethod
    def remembered_mesh_id(home: NodeHome) -> str | None:
        """The public id of the mesh this home belongs to, if it remembers one (for `--lan`)."""
        try:
            return mesh_id(bytes.fromhex(json.loads((home.root / MESH_FILE_NAME).read_text())["secret"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @staticmethod
    def forget(home: NodeHome) -> None:
        """`mesh-inference leave`: the next start begins a new mesh."""
        (home.root / MESH_FILE_NAME).unlink(missing_ok=True)
