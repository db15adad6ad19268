"""What the mesh does on each membership event: people told (sentences.py), members remembered in
mesh.json or forgotten, a removed or lost member's connection closed, a rotated secret adopted, and those
waiting on ``changes`` woken when membership or planning news changed."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..identity import short_id
from ..wire.gossip import MemberInfo, Rekey, ServedModel
from . import events
from .changes import Changes
from .health import lost_reason
from .layer_exchange import LayerExchange
from .peers import PeerTable
from .sentences import ExclusionNotices, event_message
from .serving import ServingVerdicts

log = logging.getLogger(__name__)

LEFT_FOR_GOOD_REASON = "left the mesh for good"  # `mesh-inference leave`: members forget it


@dataclass(frozen=True)
class MeshSide:
    """What the reactions act on: the rest of the running mesh (runtime.py)."""

    peers: PeerTable
    verdicts: ServingVerdicts
    changes: Changes
    say: Callable[[str], None]
    name_of: Callable[[bytes], str]
    self_info: Callable[[], MemberInfo]  # what this node announces now
    remember: Callable[[bytes, tuple[str, ...] | None], None]  # a member's addresses kept (None: dropped)
    rekeyed: Callable[[Rekey], None]  # a member rotated the secret: adopt it
    route: Callable[[bytes], None]  # which data path a member's tunnels take, looked at again
    layers: LayerExchange  # layer shares received (a worker), and workers' reports of them (a serving node)


class EventReactions:
    """Acts on each membership event, and keeps what the mesh learns from them."""

    def __init__(self, side: MeshSide) -> None:
        self._side = side
        self._exclusion_notices = ExclusionNotices()
        self._detections: dict[bytes, float] = {}  # per member lost: how long its loss took to know
        # What each member serves and its devices' speeds, as last heard: news for planning when they change.
        self._planning_said: dict[bytes, tuple[ServedModel | None, tuple[tuple[int, bool], ...]]] = {}

    def detection_s(self, node_id: bytes) -> float:
        """How long the last loss of ``node_id`` took to know (health.py), 0 if none was judged here."""
        return self._detections.get(node_id, 0.0)

    def on_event(self, event: events.Event) -> None:
        """Tell people what happened, keep mesh.json current, and close what must close."""
        side = self._side
        if (message := event_message(event, side.name_of)) is not None:
            side.say(message)
        match event:
            case events.MemberJoined(info=info) | events.MemberUpdated(info=info):
                # Say if it leaves us out, forgive a restart, remember it.
                if (notice := self._exclusion_notices.new(side.self_info(), info)) is not None:
                    log.error("%s", notice)
                    side.say(notice)
                side.verdicts.member_seen(info)
                side.remember(info.node_id, info.addresses)
                side.route(info.node_id)
            case events.MemberLeft(node_id=node_id, reason=reason) if reason == LEFT_FOR_GOOD_REASON:
                side.remember(node_id, None)
            case events.MemberRemoved(node_id=node_id, by=by):
                # At once, not when idle: a removed member must lose its access now.
                if (peer := side.peers.get(node_id)) is not None:
                    peer.close(f"removed from the mesh by {side.name_of(by)}")
                side.remember(node_id, None)
            case events.SecretRotated(rekey=rekey):
                side.rekeyed(rekey)
            case events.PeerDegraded() | events.PeerRecovered():
                log.log(logging.WARNING if isinstance(event, events.PeerDegraded) else logging.INFO,
                        "%s (%s)", message, short_id(event.node_id))
            case events.PeerLost(node_id=node_id, missed=missed):
                reason = lost_reason(event)
                log.warning("peer %s lost: %s (%d missed)", short_id(node_id), reason, missed)
                self._detections[node_id] = event.detect_s
                # The peer's task sees the close, marks the member lost and closes its tunnel.
                if (peer := side.peers.get(node_id)) is not None:
                    peer.close(reason)
            case events.UsedBy(node_id=node_id):
                side.layers.used_by(node_id)
            case events.LayersShared(node_id=node_id, share=share):
                side.layers.shared(node_id, share)
            case events.LayersReported(node_id=node_id, report=report):
                side.layers.reported(node_id, report)
            case events.LoopStalled(gap_s=gap_s):
                log.warning("event loop stalled for %.1f s; peer health not judged on this heartbeat", gap_s)
        joined_or_gone = (events.MemberJoined, events.MemberLost, events.MemberLeft, events.MemberRemoved)
        if isinstance(event, joined_or_gone) or (isinstance(event, events.MemberUpdated)
                                                 and self._planning_news(event.info)):
            side.changes.notify()

    def _planning_news(self, info: MemberInfo) -> bool:
        """Whether a member's update changes what it serves (its model, state, claim) or its devices' speeds
        (measured again, settled), not just its load or free memory."""
        said = (None if info.serves is None else dataclasses.replace(info.serves, in_flight=0),
                tuple((device.decode_bytes_per_s, device.settled) for device in info.devices))
        before = self._planning_said.get(info.node_id)
        self._planning_said[info.node_id] = said
        return said != before
