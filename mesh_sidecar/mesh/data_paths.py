"""Which path each peer's RPC tunnels take, and what the native relay reports about them.

Two paths lead to a peer's rpc-server (docs/architecture.md, "Data paths"):

- ``tcp+tls``: the native relay (net/data_plane/process.py): TLS 1.3 over TCP, relayed, checked and
  timed outside Python. Taken for a peer that announces a data port in gossip, that this node
  reaches directly (not through a relay), and whose relay answered a probe: its key checked and
  an answer back. Probed again whenever the peer's connection or announcement changes, and after
  our relay restarts.
- ``quic``: the QUIC tunnels (net/tunnel.py). Every other peer, a peer relayed through a member,
  every peer while our relay is missing or dead, and everyone with ``--data-path quic``.

A connection keeps the path it started on; a switch applies to connections made after it (the
serving node's next llama-server), so a stream in flight is never cut by one. A relay that dies
takes its connections with it: llama-server sees them reset, and serving's recovery continues
the stream on a new llama-server, over QUIC until the relay is back and probed.

The relay checks a serving node's tunnels by the output rule in C (judge.c); a fault it reports is
read back in the Python rule's words (rpc_outputs.rejected_natively) and blamed through the same
OutputChecks.rejected as the QUIC path's (docs/architecture.md, "The output check").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..identity import short_id
from ..net.connection import PeerConnection
from ..net.data_plane import control_lines as reports
from ..net.data_plane.process import DataRelay
from ..net.tunnel import OutputChecks, TunnelCounters, TunnelListener
from ..wire.rpc_framing import EndpointRewritten, EndpointUnresolved
from ..wire.rpc_outputs import rejected_natively

log = logging.getLogger(__name__)

PATH_NATIVE = "tcp+tls"
PATH_QUIC = "quic"
# A probe that failed (the peer's sidecar may not have named us to its relay yet) is tried again
# after this long, doubling while it fails.
PROBE_RETRY_FIRST_S = 0.5
PROBE_RETRY_MAX_S = 30.0
# Connections our data port refused are logged at once for a reason not logged in the last minute, else
# summed into one line a minute (the relay sums them each second): a stranger's flood costs the log a
# line a minute.
REFUSED_LOG_INTERVAL_S = 60.0


@dataclass
class _Route:
    """A peer's native route: where its relay listens, and whether it answered our probe."""

    host: str
    port: int
    ready: bool = False
    retry_s: float = PROBE_RETRY_FIRST_S
    retry: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        if self.retry is not None:
            self.retry.cancel()
            self.retry = None


@dataclass
class _Inbound:
    """A member's connection into our rpc-server through the relay."""

    node_id: bytes
    counters: TunnelCounters
    held_bytes: int = 0


@dataclass
class _Refusals:
    """What the data port refused since the last warning."""

    count: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    address: str = ""  # the last one's source
    minute_s: float = -float("inf")  # when the interval of the last warnings began
    told: set[str] = field(default_factory=set)  # the reasons logged in it
    later: asyncio.TimerHandle | None = None

    def add(self, refused: reports.Refused, now_s: float) -> bool:
        """Counted; whether to log now (a reason not logged in this interval, or the interval is over)."""
        self.count += refused.count
        self.reasons.update(dict(refused.reasons))
        self.address = refused.address
        return now_s - self.minute_s >= REFUSED_LOG_INTERVAL_S or not self.told.issuperset(self.reasons)

    def log(self, now_s: float) -> None:
        self.later = None
        if now_s - self.minute_s >= REFUSED_LOG_INTERVAL_S:
            self.minute_s, self.told = now_s, set()
        if self.count:
            log.warning("data port: refused %d connection(s) (%s), the last from %s", self.count,
                        ", ".join(f"{why} {n}" for why, n in self.reasons.most_common()), self.address)
        self.told.update(self.reasons)
        self.count, self.reasons = 0, Counter()


class DataPaths:
    """The native relay's side of the mesh: routes per peer, connections, their reports."""

    def __init__(self, relay: DataRelay | None, checks: OutputChecks,
                 counters_of: Callable[[bytes], TunnelCounters | None],
                 on_reset: Callable[[bytes], None] = lambda _: None) -> None:
        self.relay = relay
        self._on_reset = on_reset  # a tunnel to this member was reset: a sign its relay (its sidecar) died
        self._checks = checks
        self._counters_of = counters_of  # a peer's tunnel counters, for what it sends our rpc-server
        self._routes: dict[bytes, _Route] = {}
        self._tunnels: dict[int, tuple[bytes, TunnelListener]] = {}
        self._opened: set[int] = set()  # tunnels that reached the peer's relay
        self._inbound: dict[int, _Inbound] = {}
        self._ids = itertools.count(1)
        self._refusals = _Refusals()

    @property
    def port(self) -> int:
        """The data port announced in gossip; 0 without a relay."""
        return 0 if self.relay is None else self.relay.port

    def path_of(self, node_id: bytes) -> str:
        route = self._routes.get(node_id)
        return PATH_NATIVE if route is not None and route.ready and self._running() else PATH_QUIC

    def _running(self) -> bool:
        return self.relay is not None and self.relay.running

    # --- membership, as the mesh sees it --------------------------------------------------------

    def peer_seen(self, node_id: bytes, connection: PeerConnection, data_port: int) -> None:
        """``node_id`` is connected (directly or not) and announces ``data_port`` (0: none): route it."""
        relay = self.relay
        if relay is None:
            return
        host = None if connection.relayed else connection.remote_address[0]
        relay.member(node_id, () if host is None else (host,))  # where its relay dials ours from
        route = self._routes.get(node_id)
        if host is None or not data_port:
            self._drop(node_id)
            return
        if route is None or (route.host, route.port) != (host, data_port):
            self._drop(node_id)
            self._routes[node_id] = _Route(host, data_port)
            relay.probe(node_id, host, data_port)

    def _drop(self, node_id: bytes) -> None:
        if (route := self._routes.pop(node_id, None)) is not None:
            route.cancel()

    def peer_gone(self, node_id: bytes) -> None:
        """No connection to ``node_id`` any more (lost, left, kicked): its relayed connections close now."""
        self._drop(node_id)
        if self.relay is not None:
            self.relay.forget(node_id)

    def relay_restarted(self) -> None:
        """Probe every route again: nothing is known of the new relay's reach."""
        for node_id, route in self._routes.items():
            route.ready = False
            route.cancel()
            route.retry_s = PROBE_RETRY_FIRST_S
            if self.relay is not None:
                self.relay.probe(node_id, route.host, route.port)

    def relay_exited(self) -> None:
        for route in self._routes.values():
            route.ready = False
        for conn_id, (_, tunnel) in list(self._tunnels.items()):
            tunnel.native_closed(conn_id)
        self._tunnels.clear()
        self._opened.clear()
        for conn_id in list(self._inbound):
            self._inbound_closed(conn_id)

    # --- the tunnel listeners' NativePath ---------------------------------------------------

    def hand_over(self, node_id: bytes, sock: socket.socket, check: bool, tunnel: TunnelListener) -> bool:
        route = self._routes.get(node_id)
        if self.relay is None or route is None or not route.ready:
            return False
        conn_id = next(self._ids)
        if not self.relay.tunnel(conn_id, node_id, route.host, route.port, check, sock):
            return False
        self._tunnels[conn_id] = (node_id, tunnel)
        tunnel.native_opened(conn_id)
        return True

    # --- reports ------------------------------------------------------------------------------

    def on_report(self, report: reports.Report) -> None:
        match report:
            case reports.Stats():
                self._stats(report)
            case reports.Hello(port=port):
                log.info("native data relay running, data port TCP %d", port)
                self.relay_restarted()
            case reports.ProbeResult(node_id=node_id, ok=ok):
                route = self._routes.get(node_id)
                if route is not None:
                    route.ready = ok
                    if not ok:
                        self._probe_later(node_id, route)
                log.log(logging.INFO if ok else logging.WARNING, "data path to %s: %s", short_id(node_id),
                        f"{PATH_NATIVE} (answered in {report.rtt_us} us)" if ok
                        else f"{PATH_QUIC}, its relay did not answer ({report.why})")
            case reports.Closed(id=conn_id, why=why):
                if conn_id in self._inbound:
                    self._inbound_closed(conn_id)
                elif (entry := self._tunnels.pop(conn_id, None)) is not None:
                    entry[1].native_closed(conn_id)
                    if why not in ("ended", "forgotten"):
                        log.warning("tunnel to %s (native) closed: %s", short_id(entry[0]), why)
                    if why == "reset":
                        self._on_reset(entry[0])
                    if conn_id not in self._opened:
                        self._unreachable(entry[0])
                    self._opened.discard(conn_id)
            case reports.Opened(id=conn_id):
                self._opened.add(conn_id)
            case reports.Inbound(id=conn_id, node_id=node_id):
                counters = self._counters_of(node_id) or TunnelCounters()
                counters.inbound_streams += 1
                self._inbound[conn_id] = _Inbound(node_id, counters)
            case reports.Rejected():
                self._rejected(report)
            case reports.Event():
                self._event(report)
            case reports.Refused():
                refusals, now_s = self._refusals, time.monotonic()
                if refusals.add(report, now_s):
                    refusals.log(now_s)
                elif refusals.later is None:
                    refusals.later = asyncio.get_running_loop().call_later(
                        refusals.minute_s + REFUSED_LOG_INTERVAL_S - now_s, lambda: refusals.log(time.monotonic()))
            case reports.RelayError(text=text):
                log.error("native data relay: %s", text)

    def take_back(self, handed: reports.HandedBack, sock: socket.socket) -> None:
        """A tunnel connection the relay could not carry (the peer's relay did not answer), unread: it takes
        the QUIC path after all, and so do the next until a probe says the peer's relay is back."""
        entry = self._tunnels.pop(handed.id, None)
        if entry is None:
            sock.close()
            return
        node_id, tunnel = entry
        log.warning("tunnel to %s: its relay did not answer (%s); this connection goes over QUIC",
                    short_id(node_id), handed.why)
        self._unreachable(node_id)
        tunnel.native_closed(handed.id)
        tunnel.take_back(sock)

    def _unreachable(self, node_id: bytes) -> None:
        if (route := self._routes.get(node_id)) is not None:
            route.ready = False
            self._probe_later(node_id, route)

    def _probe_later(self, node_id: bytes, route: _Route) -> None:
        def probe() -> None:
            route.retry = None
            if self.relay is not None and self._routes.get(node_id) is route:
                self.relay.probe(node_id, route.host, route.port)

        route.cancel()
        route.retry = asyncio.get_running_loop().call_later(route.retry_s, probe)
        route.retry_s = min(route.retry_s * 2, PROBE_RETRY_MAX_S)

    def _stats(self, stats: reports.Stats) -> None:
        if (entry := self._tunnels.get(stats.id)) is not None:
            entry[1].count_native(stats.from_client_bytes, stats.from_server_bytes, stats.owed_us / 1e6,
                                  time.monotonic())
        elif (inbound := self._inbound.get(stats.id)) is not None:
            counters = inbound.counters
            counters.inbound_bytes_from_peer += stats.from_client_bytes
            counters.inbound_bytes_to_peer += stats.from_server_bytes
            counters.rpc_commands += stats.frames
            counters.inbound_activation_bytes += stats.activation_bytes
            counters.inbound_held_bytes += stats.allocated_bytes
            inbound.held_bytes += stats.allocated_bytes

    def _event(self, event: reports.Event) -> None:
        """Logged as the QUIC path logs the same event (rpc_framing.py's events), so one grep finds both."""
        inbound = self._inbound.get(event.id)
        words = event.text.split(" ")
        if inbound is not None and event.what == "rewritten" and len(words) == 3 and words[0].isdigit():
            # The original endpoint comes escaped (rpc_watch.c), as the QUIC path's event holds it.
            log.info("tunnel from %s: %s", short_id(inbound.node_id),
                     EndpointRewritten(int(words[0]), words[1], words[2]))
        elif inbound is not None and event.what == "unresolved" and words[0].isdigit():
            log.info("tunnel from %s: %s", short_id(inbound.node_id), EndpointUnresolved(int(words[0])))
        elif event.what == "dropped":
            log.warning("native tunnel %d: %s of its events were lost (too many in one read)", event.id, event.text)
        else:
            log.info("native tunnel %d: %s %s", event.id, event.what, event.text)

    def _inbound_closed(self, conn_id: int) -> None:
        inbound = self._inbound.pop(conn_id)
        inbound.counters.inbound_held_bytes -= inbound.held_bytes  # rpc-server freed this client's buffers

    def _rejected(self, report: reports.Rejected) -> None:
        entry = self._tunnels.get(report.id)
        if entry is None:
            return
        self._checks.rejected(entry[0], rejected_natively(report.kind, report.name, report.values, report.rms,
                                                          report.max_abs, (report.low, report.high, report.count)))
