"""What a node tells its user as the mesh changes: one sentence per membership event. Pure.

The runtime says these (the terminal, the recent events of `status` and the
dashboard); the sentences name members by name, with a short id where a name
may not be known yet.
"""

from __future__ import annotations

from collections.abc import Callable

from ..identity import short_id
from ..wire.gossip import MemberInfo
from . import events
from .exclusion import Exclusion, exclusion_of
from .health import health_message


def event_message(event: events.Event, name_of: Callable[[bytes], str]) -> str | None:
    """The sentence for people about ``event``, or None when it has none (or the runtime composes it)."""
    match event:
        case events.MemberJoined(info=info, learned_via=via):
            how = f" (learned via gossip from {name_of(via)})" if via else ""
            return f"Connected to peer {info.name} ({short_id(info.node_id)}){how}"
        case events.MemberLost(node_id=node_id, reason=reason):
            return f"Lost peer {name_of(node_id)}: {reason}"
        case events.MemberLeft(node_id=node_id, reason=reason):
            return f"Peer {name_of(node_id)} left the mesh ({reason})"
        case events.MemberRemoved(node_id=node_id, by=by):
            return f"Peer {name_of(node_id)} was removed from the mesh by {name_of(by)}"
        case events.PeerDegraded() | events.PeerRecovered():
            return health_message(event, name_of(event.node_id))
    return None


class ExclusionNotices:
    """Tells the person at this node once per reason that a serving node leaves it out (gossip repeats it)."""

    def __init__(self) -> None:
        self._said: set[tuple[bytes, Exclusion]] = set()

    def new(self, own: MemberInfo, serving: MemberInfo) -> str | None:
        """The line to say when member ``serving`` serves and leaves this node (``own``) out for a reason
        not said yet; else None."""
        if not serving.serving or (found := exclusion_of(own, serving)) is None:
            return None
        if (serving.node_id, found) in self._said:
            return None
        self._said.add((serving.node_id, found))
        return found.message(own.name)
