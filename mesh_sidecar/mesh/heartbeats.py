"""The mesh's clock for peer health: a heartbeat every interval (what each peer was last heard, pings and
health judged by membership, verdicts expired, observed addresses told, this node's figures refreshed in
gossip every ``CAPACITY_REFRESH_S``), and a suspected peer's probe judged when its time is up. health.py
and membership.py decide; this module only keeps their time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..identity import short_id
from .health import Sign
from .membership import Membership
from .observed import tell_observed_addresses
from .peers import PeerTable
from .serving import ServingVerdicts

log = logging.getLogger(__name__)

CAPACITY_REFRESH_S = 5.0


class Heartbeats:
    """Keeps membership's health judgement on time: the heartbeat loop, and the probes of suspected peers."""

    def __init__(self, membership: Membership, peers: PeerTable, verdicts: ServingVerdicts, interval_s: float, *,
                 process: Callable[[], None], refresh: Callable[[float], None], leaving: Callable[[], bool]) -> None:
        self._membership = membership
        self._peers = peers
        self._verdicts = verdicts
        self._interval_s = interval_s
        self._process = process  # carry out what membership asks for now
        self._refresh = refresh  # announce this node's figures again (the loop time now)
        self._leaving = leaving  # once leaving, peers are judged no more

    async def run(self) -> None:
        """Beat until cancelled."""
        last_refresh = time.monotonic()
        while True:
            now = time.monotonic()
            for peer in self._peers.values():
                if (heard_s := peer.connection.last_heard_s) is not None:
                    self._membership.heard_from(peer.connection.peer_id, heard_s)
            self._membership.heartbeat(now)
            self._verdicts.expire(now)
            tell_observed_addresses(self._peers.values())
            if now - last_refresh >= CAPACITY_REFRESH_S:
                self._refresh(now)
                last_refresh = now
            self._process()
            await asyncio.sleep(self._interval_s)

    def suspect(self, node_id: bytes, sign: Sign) -> None:
        """A sign that ``node_id``'s process is gone (its port unreachable, a data connection reset): probe it
        at once, and judge it when the probe's time is up (health.py); a member lost so is known within a
        round trip or two, not a heartbeat timeout."""
        if self._leaving():
            return
        log.debug("peer %s suspected: %s", short_id(node_id), sign.value)
        deadline = self._membership.suspect(node_id, sign, time.monotonic())
        self._process()
        if deadline is not None:
            asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), self._judge)

    def _judge(self) -> None:
        if not self._leaving():
            self._membership.judge(time.monotonic())
            self._process()
