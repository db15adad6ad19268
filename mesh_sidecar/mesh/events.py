"""What happened in the mesh, as one node's Membership saw it: frozen dataclasses.

The mesh runtime drains them with ``Membership.next_event()``, tells people, and acts on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from ..wire.gossip import MemberInfo, Rekey
from ..wire.layer_share import LayersFetched, LayerShare


@dataclass(frozen=True)
class MemberJoined:
    """We now have our own connection to this member, and know its info."""

    info: MemberInfo  # as the member itself (or the peer that listed it) sent it
    learned_via: bytes | None  # None: it reached us before anyone mentioned it


@dataclass(frozen=True)
class MemberUpdated:
    """A connected member sent new info about itself."""

    info: MemberInfo  # the new info


@dataclass(frozen=True)
class MemberLost:
    """Our connection to a member ended without a Leave; its info is kept for a redial."""

    node_id: bytes  # the member
    reason: str  # why the connection ended, for people


@dataclass(frozen=True)
class MemberLeft:
    """A member said Leave: it is not redialed."""

    node_id: bytes  # the member
    reason: str  # the reason its Leave gave


@dataclass(frozen=True)
class MemberRemoved:
    """A Rekey removed this member: disconnected, never redialed."""

    node_id: bytes  # the member removed
    by: bytes  # the node that rotated the secret without it


@dataclass(frozen=True)
class SecretRotated:
    """The mesh secret changed: admit new connections with ``rekey.secret`` from now on."""

    rekey: Rekey  # the winning rotation: its secret, epoch and removed members


@dataclass(frozen=True)
class _PeerSilent:
    """A member's heartbeats go unanswered (the fields PeerDegraded and PeerLost share)."""

    node_id: bytes  # the member
    silent_s: float  # how long the oldest unanswered Ping has waited
    missed: int  # Pings in a row sent while an earlier one was unanswered


@dataclass(frozen=True)
class PeerDegraded(_PeerSilent):
    """A connected member's oldest heartbeat has gone unanswered DEGRADED_AFTER_S (health.py)."""


@dataclass(frozen=True)
class PeerRecovered:
    """A degraded member answers heartbeats again."""

    node_id: bytes  # the member
    degraded_for_s: float  # from the heartbeat that saw it degraded to the one that saw it recover
    rtt_s: float | None  # the last round trip


@dataclass(frozen=True)
class PeerLost(_PeerSilent):
    """A member's heartbeat has gone unanswered too long, or a sign that its process is gone was confirmed
    (health.py): its connection is to be closed."""

    # The confirmed sign, if any: "its data connection was reset, and a probe 2 ms later found it unreachable".
    sign: str = ""
    suspected_s: float = 0.0  # from that sign's first coming to its confirmation

    @property
    def detect_s(self) -> float:
        """How long the loss took to know: from the first sign, or the heartbeat's silence."""
        return self.suspected_s if self.sign else self.silent_s


@dataclass(frozen=True)
class LoopStalled:
    """A heartbeat came LOOP_STALL_S or more late: our own event loop stalled, so Pongs may
    wait unread and no member was judged on this heartbeat."""

    gap_s: float  # time since the heartbeat before


@dataclass(frozen=True)
class UsedBy:
    """A serving node announced an --rpc order that names this node: its next load uses our rpc-server."""

    node_id: bytes  # the serving node


@dataclass(frozen=True)
class LayersShared:
    """A serving node asked this node to fetch its layers of a hub model (wire/layer_share.py)."""

    node_id: bytes  # the serving node: the connection names it
    share: LayerShare


@dataclass(frozen=True)
class LayersReported:
    """A worker said how fetching the layers this node shared with it ended."""

    node_id: bytes  # the worker
    report: LayersFetched


HealthEvent: TypeAlias = PeerDegraded | PeerRecovered | PeerLost
Event: TypeAlias = (MemberJoined | MemberUpdated | MemberLost | MemberLeft | MemberRemoved | SecretRotated
                    | HealthEvent | LoopStalled | UsedBy | LayersShared | LayersReported)
