"""The mesh on the LAN (``--lan``): advertise this node, dial members whose mDNS records show up.

net/discovery.py speaks mDNS; this decides which records are worth a dial. A
record's claim to be of our mesh is not trusted: the handshake admits a node
only if it holds the secret. The dial itself is the mesh's, through a callback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..identity import short_id
from ..net.discovery import LanPresence, LanRecord
from ..wire.ticket import PeerAddress

log = logging.getLogger(__name__)

# A member seen on the LAN is dialed at most this often (its record may be re-announced often).
LAN_REDIAL_S = 10.0


class LanDialer:
    """This node's presence on the LAN, and the dials its sightings call for."""

    def __init__(self, own_record: Callable[[], LanRecord], may_dial: Callable[[bytes], bool],
                 dial: Callable[[bytes, list[PeerAddress]], None]) -> None:
        """``may_dial(node_id)``: False for a member already connected, a removed one, or while leaving."""
        self._own_record = own_record
        self._may_dial = may_dial
        self._dial = dial
        self._presence = LanPresence(own_record, lambda record: self.seen(record, time.monotonic()))
        self._dialed: dict[bytes, float] = {}  # node id -> when a LAN record last made us dial it

    async def run(self) -> None:
        await self._presence.run()

    def refresh(self) -> None:
        """Advertise again: the mesh id follows the secret, which may have rotated."""
        self._presence.refresh()

    def records(self) -> list[LanRecord]:
        """Every other node's record on the LAN now, of any mesh."""
        return self._presence.seen()

    def offer_again(self, now: float) -> None:
        """Reconsider every record: a dial may have failed (the member was still starting)."""
        for record in self._presence.seen():
            self.seen(record, now)

    def seen(self, record: LanRecord, now: float) -> None:
        """A node's record: dial it if it claims our mesh and ``may_dial`` agrees, paced per node."""
        node_id = record.node_id
        if record.mesh_id != self._own_record().mesh_id or not self._may_dial(node_id):
            return
        if now - self._dialed.get(node_id, -LAN_REDIAL_S) < LAN_REDIAL_S:
            return
        self._dialed[node_id] = now
        log.info("LAN: %s (%s) advertises this mesh at %s; dialing", record.name, short_id(node_id),
                 ", ".join(map(str, record.addresses)))
        self._dial(node_id, list(record.addresses))
