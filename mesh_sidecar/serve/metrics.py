"""Prometheus metrics of a node, served on the API port at /metrics.

Counters and histograms are updated where things happen (the proxy, the
serving loop); mesh-wide gauges (members, per-peer RTT and bytes) are read from
the mesh's peer views at scrape time, the same values `status` shows.
llama-server's own metrics (``llamacpp:*``) are appended by the proxy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..mesh.membership import MemberState
from ..mesh.status import MeshView, PeerView

PREFIX = "mesh_"
FIRST_TOKEN_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
FAILOVER_PHASE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30)
TOKENS_PER_SECOND_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)


class _MeshCollector(Collector):
    def __init__(self, peer_views: Callable[[], Sequence[PeerView]],
                 mesh_view: Callable[[], MeshView | None]) -> None:
        self._peer_views = peer_views
        self._mesh_view = mesh_view

    def collect(self) -> Iterator[Any]:
        peers = self._peer_views()
        members = GaugeMetricFamily(PREFIX + "members", "Mesh members connected to this node, itself included")
        members.add_metric([], 1 + sum(p.state is MemberState.CONNECTED for p in peers))
        yield members
        rtt = GaugeMetricFamily(PREFIX + "peer_rtt_seconds", "Last heartbeat round trip to a peer", labels=["peer"])
        sent = CounterMetricFamily(PREFIX + "peer_tunnel_bytes", "Bytes through the tunnel to a peer",
                                   labels=["peer", "direction"])
        for peer in peers:
            if peer.rtt_last_s is not None:
                rtt.add_metric([peer.name], peer.rtt_last_s)
            sent.add_metric([peer.name, "to_peer"], peer.tunnel.bytes_to_peer)
            sent.add_metric([peer.name, "from_peer"], peer.tunnel.bytes_from_peer)
        yield rtt
        yield sent
        mesh = self._mesh_view()
        if mesh is None:
            return
        for name, help_text, value in (
            ("relayed_bytes", "Bytes this node relayed between two other members", mesh.relay.relayed_bytes),
            ("relay_refused", "Relay requests refused (not towards a member this node reaches)", mesh.relay.refused),
            ("punch_attempts", "Direct dials to members learned through others (hole punching)",
             mesh.punch.attempts),
            ("punch_successes", "Of those, the ones that got through", mesh.punch.successes),
        ):
            family = CounterMetricFamily(PREFIX + name, help_text)
            family.add_metric([], value)
            yield family


class Metrics:
    """One node's registry."""

    def __init__(self, peer_views: Callable[[], Sequence[PeerView]],
                 mesh_view: Callable[[], MeshView | None] = lambda: None) -> None:
        """``peer_views``: the mesh's ``peer_views()`` (none before the mesh starts); ``mesh_view``:
        its ``mesh_view()`` (None before it starts)."""
        self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "API requests by path and HTTP status",
                                ["path", "status"], registry=self.registry)
        self.failovers = Counter(PREFIX + "failovers", "llama-server restarts forced by a lost member or its death",
                                 registry=self.registry)
        self.retries = Counter(PREFIX + "retries", "Requests retried or streams replayed after a failover",
                               registry=self.registry)
        self.resumed = Counter(PREFIX + "streams_resumed", "Streams that went on after a failover, by how: "
                               "continued from the tokens delivered, or replayed", ["how"], registry=self.registry)
        self.restarts = Counter(PREFIX + "restarts", "llama-server restarts for any reason (replans included)",
                                registry=self.registry)
        self.first_token = Histogram(PREFIX + "first_token_seconds", "Time to the first streamed text",
                                     buckets=FIRST_TOKEN_BUCKETS_S, registry=self.registry)
        self.failover_phases = Histogram(PREFIX + "failover_phase_seconds", "Each phase of a failover: detect (the "
                                         "first sign of a member's death to its loss), stop, plan, load, resume (a "
                                         "continued stream's first new token)", ["phase"],
                                         buckets=FAILOVER_PHASE_BUCKETS_S, registry=self.registry)
        self.tokens_per_second = Histogram(PREFIX + "tokens_per_second", "Decode speed per request",
                                           buckets=TOKENS_PER_SECOND_BUCKETS, registry=self.registry)
        self.model_switches = Counter(PREFIX + "model_switches", "Switches between model tiers (--model given "
                                      "several times)", ["direction"], registry=self.registry)
        self.corrupt_outputs = Counter(PREFIX + "corrupt_outputs", "Layer outputs a worker returned that failed the "
                                       "check (NaN/Inf or far off its norm); the worker is left out",
                                       registry=self.registry)
        self.slow_workers = Counter(PREFIX + "slow_workers", "Workers left out for holding tokens up far past "
                                    "a token's usual time", registry=self.registry)
        self.forwarded = Counter(PREFIX + "forwarded_requests", "API requests sent over the mesh to the member "
                                 "serving their model, by model and serving node", ["model", "node"],
                                 registry=self.registry)
        self.forward_errors = Counter(PREFIX + "forward_errors", "Forwarded requests whose serving node failed "
                                      "under them (its connection lost, or it answered nothing), by model and "
                                      "serving node", ["model", "node"], registry=self.registry)
        self.model = Info(PREFIX + "model", "The model in service: id, file and sha256", registry=self.registry)
        self.registry.register(_MeshCollector(peer_views, mesh_view))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def summary(self) -> dict[str, float]:
        """The counters people care about, for `status`."""
        get = self.registry.get_sample_value
        requests = sum(s.value for m in self.requests.collect() for s in m.samples if s.name.endswith("_total"))
        return {
            "requests": requests,
            "failovers": get(PREFIX + "failovers_total") or 0,
            "retries": get(PREFIX + "retries_total") or 0,
            "restarts": get(PREFIX + "restarts_total") or 0,
            "corrupt_outputs": get(PREFIX + "corrupt_outputs_total") or 0,
            "slow_workers": get(PREFIX + "slow_workers_total") or 0,
            "forwarded": sum(s.value for m in self.forwarded.collect() for s in m.samples if s.name.endswith("_total")),
        }
