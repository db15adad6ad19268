"""Peer health from heartbeats: round-trip times, missed heartbeats, connected/degraded/lost.

Sans-I/O like gossip: no clock, no event loop. Membership (membership.py) keeps one
:class:`PeerHealth` per connected member and tells it each Ping it sent
(``ping_sent``) and each Pong that came back (``pong_received``), passing ``now``
(seconds, the same monotonic clock throughout), and calls ``tick(now)`` once per
heartbeat to learn of changes of state, which it reports as its own events.

A peer's state follows the oldest Ping still waiting for its Pong (a Pong answers its
own Ping and every earlier one: the control stream is ordered, so the earlier Pongs
either came first or never will)::

    connected --(a Ping unanswered DEGRADED_AFTER_S)--> degraded --(LOST_AFTER_S)--> lost
        ^                                                   |
        +---------------(a Pong arrives)--------------------+

Heartbeats are not the only sign of life: any datagram from the peer (a QUIC acknowledgement, its own
Ping) says its machine and its process are there (``heard``). A peer is lost by silence when its
oldest Ping has waited ``lost_after_s`` and nothing at all came from it for as long: on a link that
drops one packet in five, a Ping and its retransmissions can all be lost for seconds while the
peer's other packets keep arriving. A peer that keeps sending but answers no Ping for
ANSWERED_WITHIN_LOST_AFTERS times that long is lost all the same (its mesh is hung, its QUIC not).

How long "lost" waits adapts to the link: a few heartbeats plus a few of its slowest round trips
(``lost_after_s``), never less than the floor (LOST_AFTER_S) that a Wi-Fi member's pauses and a
lossy link's retransmissions stay under. That is for a machine that vanished. A process that
died on a live machine shows itself at once: the kernel answers its port with "port
unreachable", its data connections are reset. Any such sign makes the peer *suspected*
(``suspect``): the mesh sends it a Ping at once, and a suspected peer is lost when its port is
unreachable after that probe (a dead port answers the probe at once) or when the probe goes
unanswered ``confirm_s`` (a few round trips, CONFIRM_FLOOR_S at least). A reset never confirms:
its data relay resets every tunnel connection at once when it alone dies or is stopped, and its
node still answers. A Pong clears the suspicion, so one stray ICMP message evicts no one.

``lost`` is final: the mesh closes the connection, and a new connection gets a new
PeerHealth. With nothing outstanding a peer stays connected, so a peer that is not
pinged (not yet identified, or leaving) is never judged.

The last MAX_OUTSTANDING_PINGS are kept, so a Pong slower than one heartbeat still
gives a sample and still counts as an answer. A heartbeat that comes LOOP_STALL_S
late means the node's own event loop stalled, not its peers: Membership judges no
one on it.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Sequence

from .events import HealthEvent, PeerDegraded, PeerLost, PeerRecovered

HEARTBEAT_INTERVAL_S = 0.5  # a Ping to every peer this often
DEGRADED_AFTER_S = 1.5  # a Ping this long without a Pong: the peer is degraded
# The least a Ping waits before its peer is lost: a QUIC stream's retransmissions on a link losing 20% of
# its packets, or a Wi-Fi member's power-save pauses, stay well under it.
LOST_AFTER_S = 2.5
# A peer heard from (any datagram) but answering no Ping is lost after this many times lost_after_s.
ANSWERED_WITHIN_LOST_AFTERS = 4
# Beyond the floor, lost after this many heartbeats plus this many of the link's slowest round trips (p95).
LOST_AFTER_HEARTBEATS = 4
LOST_AFTER_RTTS = 4
# A suspected peer (its port unreachable, its data connection reset) that leaves a probe unanswered this
# many of its slowest round trips, and at least CONFIRM_FLOOR_S, is lost.
CONFIRM_RTTS = 4
CONFIRM_FLOOR_S = 0.5
RTT_WINDOW = 64  # RTT samples kept for the percentiles
MAX_OUTSTANDING_PINGS = 64  # unanswered Pings remembered (32 s of heartbeats); older ones no longer count
# A heartbeat due after a gap longer than this means our own event loop stalled:
# Pongs may be waiting unread, so peers are not judged on that heartbeat.
LOOP_STALL_S = 2.0


class Sign(enum.Enum):
    """A sign that a peer's process is gone, as the log says it."""

    UNREACHABLE = "its port is unreachable"  # an ICMP error: its kernel answers for a closed port
    RESET = "its data connection was reset"  # by its data relay: the relay or its whole node died


class HealthState(enum.StrEnum):
    CONNECTED = "connected"  # every Ping answered within DEGRADED_AFTER_S
    DEGRADED = "degraded"  # a Ping has waited DEGRADED_AFTER_S or more
    LOST = "lost"  # a Ping has waited LOST_AFTER_S or more; final




def percentile(samples: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``samples``: always one of them; None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not between 0 and 100")
    if not samples:
        return None
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class PeerHealth:
    """Heartbeat bookkeeping for one connection to one peer."""

    def __init__(
        self,
        node_id: bytes,
        *,
        degraded_after_s: float = DEGRADED_AFTER_S,
        lost_after_s: float = LOST_AFTER_S,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        window: int = RTT_WINDOW,
        max_outstanding: int = MAX_OUTSTANDING_PINGS,
    ) -> None:
        if not 0 < degraded_after_s < lost_after_s:
            raise ValueError("need 0 < degraded_after_s < lost_after_s")
        if window < 1 or max_outstanding < 1:
            raise ValueError("window and max_outstanding must be at least 1")
        self.node_id = node_id
        self.degraded_after_s = degraded_after_s
        self.lost_floor_s = lost_after_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._max_outstanding = max_outstanding
        self._outstanding: OrderedDict[int, float] = OrderedDict()  # nonce -> sent at, oldest first
        self._rtts: deque[float] = deque(maxlen=window)
        self._state = HealthState.CONNECTED
        self._degraded_at: float | None = None
        self._missed = 0
        self._suspected: tuple[float, Sign] | None = None  # since when, and the first sign
        self._probed_at: float | None = None  # the Ping sent when it was suspected
        self._confirmed = False  # its port was unreachable after the probe
        self._heard_at: float | None = None  # the peer's last datagram of any kind
        self.pings_sent = 0
        self.pongs_received = 0

    # --- what it knows ---

    @property
    def state(self) -> HealthState:
        """As of the last ``tick``."""
        return self._state

    @property
    def missed(self) -> int:
        """Consecutive Pings not answered before the next one was sent."""
        return self._missed

    @property
    def rtt_samples(self) -> tuple[float, ...]:
        """The last RTT_WINDOW round trips, oldest first."""
        return tuple(self._rtts)

    @property
    def rtt_last_s(self) -> float | None:
        return self._rtts[-1] if self._rtts else None

    @property
    def rtt_p50_s(self) -> float | None:
        return percentile(self._rtts, 50)

    @property
    def rtt_p95_s(self) -> float | None:
        return percentile(self._rtts, 95)

    @property
    def lost_after_s(self) -> float:
        """How long a Ping may wait before the peer is lost: adapted to the link, never under the floor."""
        slowest = self.rtt_p95_s or 0.0
        return max(self.lost_floor_s, LOST_AFTER_HEARTBEATS * self.heartbeat_interval_s + LOST_AFTER_RTTS * slowest)

    @property
    def confirm_s(self) -> float:
        """How long a suspected peer has to answer the probe."""
        return max(CONFIRM_FLOOR_S, CONFIRM_RTTS * (self.rtt_p95_s or 0.0))

    @property
    def suspected(self) -> bool:
        return self._suspected is not None

    def silent_s(self, now: float) -> float:
        """How long the oldest unanswered Ping has waited; 0 when none is."""
        if not self._outstanding:
            return 0.0
        return max(0.0, now - next(iter(self._outstanding.values())))

    # --- inputs ---

    def ping_sent(self, nonce: int, now: float) -> None:
        """A Ping with ``nonce`` went out at ``now``. A nonce already waiting is ignored."""
        if self._state is HealthState.LOST or nonce in self._outstanding:
            return
        if self._outstanding:
            self._missed += 1
        self._outstanding[nonce] = now
        while len(self._outstanding) > self._max_outstanding:
            self._outstanding.popitem(last=False)
        self.pings_sent += 1

    def heard(self, at: float) -> None:
        """A datagram of any kind came from the peer at ``at``."""
        if self._heard_at is None or at > self._heard_at:
            self._heard_at = at

    def quiet_s(self, now: float) -> float:
        """How long the peer has given no sign of life: its oldest unanswered Ping's wait, or less if any
        datagram came from it since."""
        silent = self.silent_s(now)
        return silent if self._heard_at is None else min(silent, max(0.0, now - self._heard_at))

    def suspect(self, sign: Sign, now: float) -> bool:
        """A sign that the peer's process is gone. True when the caller is to send a probe Ping now
        (``probed``); its port unreachable after that probe confirms the loss (at the next ``tick``)."""
        if self._state is HealthState.LOST:
            return False
        if self._suspected is None:
            self._suspected = (now, sign)
            self._probed_at = None
            return True
        if sign is Sign.UNREACHABLE and self._probed_at is not None and now > self._probed_at:
            self._confirmed = True
        return False

    def probed(self, nonce: int, now: float) -> None:
        """The probe Ping for a suspicion went out."""
        self.ping_sent(nonce, now)
        self._probed_at = now

    def pong_received(self, nonce: int, now: float) -> float | None:
        """A Pong for ``nonce`` arrived; returns its RTT, or None if it was ignored.

        Ignored: a nonce never sent, already answered, forgotten (over
        MAX_OUTSTANDING_PINGS) or superseded by a later Pong, and anything once lost.
        """
        if self._state is HealthState.LOST or nonce not in self._outstanding:
            return None
        while True:  # this Ping and every earlier one are answered
            sent_nonce, sent_at = self._outstanding.popitem(last=False)
            if sent_nonce == nonce:
                break
        rtt = max(0.0, now - sent_at)
        self._rtts.append(rtt)
        self._suspected = self._probed_at = None  # it answers: whatever the sign was, it lives
        self._confirmed = False
        self.pongs_received += 1
        # The Pings after this one that were followed by another Ping are missed.
        self._missed = max(0, len(self._outstanding) - 1)
        return rtt

    def tick(self, now: float) -> HealthEvent | None:
        """Re-judge the state; the event if it changed."""
        if self._state is HealthState.LOST:
            return None
        silent = self.silent_s(now)
        if self._suspected is not None:
            since, sign = self._suspected
            if self._confirmed:
                self._state = HealthState.LOST
                after = f"a probe {1000 * (now - since):.0f} ms later"
                confirmed = f"again after {after}" if sign is Sign.UNREACHABLE else f"{after} found it unreachable"
                return PeerLost(self.node_id, silent, self._missed, f"{sign.value}, and {confirmed}", now - since)
            if self._probed_at is not None and now - self._probed_at >= self.confirm_s:
                self._state = HealthState.LOST
                return PeerLost(self.node_id, silent, self._missed,
                                f"{sign.value}, and no answer to a probe in {1000 * (now - self._probed_at):.0f} ms",
                                now - since)
        quiet = self.quiet_s(now)
        if quiet >= self.lost_after_s or silent >= ANSWERED_WITHIN_LOST_AFTERS * self.lost_after_s:
            self._state = HealthState.LOST
            return PeerLost(self.node_id, silent, self._missed)
        new = HealthState.DEGRADED if silent >= self.degraded_after_s else HealthState.CONNECTED
        if new is self._state:
            return None
        self._state = new
        if new is HealthState.DEGRADED:
            self._degraded_at = now
            return PeerDegraded(self.node_id, silent, self._missed)
        assert self._degraded_at is not None
        degraded_for = now - self._degraded_at
        self._degraded_at = None
        return PeerRecovered(self.node_id, degraded_for, self.rtt_last_s)


def lost_reason(event: PeerLost) -> str:
    """Why the connection to a lost member is closed; people see it as "Lost peer NAME: ..."."""
    return event.sign or f"no heartbeat answer for {event.silent_s:.1f} s"


def health_message(event: PeerDegraded | PeerRecovered, name: str) -> str:
    """The sentence for people about a member whose heartbeats slowed or came back."""
    match event:
        case PeerDegraded(silent_s=silent_s, missed=missed):
            return f"Peer {name} is slow to answer: no heartbeat answer for {silent_s:.1f} s ({missed} missed)"
        case PeerRecovered(rtt_s=rtt_s):
            rtt = "-" if rtt_s is None else f"{rtt_s * 1000:.1f} ms"
            return f"Peer {name} answers heartbeats again (round trip {rtt})"
