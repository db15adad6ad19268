"""What a serving node concludes about its workers from its own traffic: a worker whose layer output
failed the output check is left out; one holding tokens up is left out when the model fits without it
(replan.py's ``blame_slow`` decides); each request's decode measures how much slower each worker runs
than it announced (speeds.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..identity import NodeIdentity, short_id
from ..mesh.exclusion import SLOW_EXCLUSION_S
from ..mesh.runtime import Mesh
from ..wire.rpc_outputs import OutputRejected
from .metrics import Metrics
from .pace import Slow
from .planner import Plan
from .replan import Blame, ServingSnapshot, blame_slow
from .speeds import ObservedSpeeds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchedLoop:
    """What the watch reads of the serving loop, and what it asks of it."""

    plan: Callable[[], Plan | None]  # the plan in service (None: none)
    running: Callable[[], bool]  # whether llama-server runs
    snapshot: Callable[[], ServingSnapshot]  # the serving loop's reading of the mesh now
    model_name: Callable[[], str]  # the file in service, for the messages
    restart: Callable[[str], None]  # replace llama-server at once, for this reason
    wake: Callable[[], None]  # look at the plan again (replan.py decides)


class WorkerWatch:
    """Verdicts on the plan's workers from what the serving node's own requests showed."""

    def __init__(self, mesh: Mesh, identity: NodeIdentity, metrics: Metrics, say: Callable[[str], None],
                 loop: WatchedLoop) -> None:
        self._mesh = mesh
        self._identity = identity
        self._metrics = metrics
        self._say = say
        self._loop = loop
        self.speeds = ObservedSpeeds()  # how much slower each worker runs than it announced
        self._slow_kept: set[bytes] = set()  # slow workers kept because the model needs them (said once)

    def slowdowns(self) -> dict[bytes, float]:
        """Each connected member's slowdown as the traffic showed it (1.0: as it announced)."""
        return {info.node_id: self.speeds.slowdown(info.node_id) for info in self._mesh.connected_members()}

    def _seen_running(self) -> frozenset[bytes]:
        """The connected members whose speed the traffic has shown (ObservedSpeeds.observed_bytes_per_s)."""
        return frozenset(info.node_id for info in self._mesh.connected_members()
                         if self.speeds.observed_bytes_per_s(info.node_id) is not None)

    def on_decoded(self, tokens: int, decode_s: float) -> None:
        """A request's decode just ended: what each worker of the plan owed over it is a measurement."""
        if (plan := self._loop.plan()) is None:
            return
        since = time.monotonic() - decode_s
        before, seen = self.slowdowns(), self._seen_running()
        self.speeds.observe(plan, self._identity.node_id, tokens, self._mesh.verdicts.reply_waits_s(since))
        after = self.slowdowns()
        if self._seen_running() != seen:
            self._loop.wake()  # a speed of one calibration is confirmed now (speeds.weighable_speeds)
        if after == before:
            return
        for info in self._mesh.connected_members():
            if after.get(info.node_id, 1.0) != before.get(info.node_id, 1.0):
                slowdown = after.get(info.node_id, 1.0)
                self._say(f"{info.name} ({short_id(info.node_id)}) runs "
                          + ("as measured again" if slowdown == 1.0
                             else f"{slowdown:.1f}x slower than its baseline (the median of its last requests)"))
        self._loop.wake()  # the plan may be worth changing (replan.py decides)

    def on_corrupt_output(self, node_id: bytes, event: OutputRejected) -> None:
        """A worker's reply failed the output check (its tunnel connection is already reset)."""
        name = self._mesh.name_of(node_id)
        self._metrics.corrupt_outputs.inc()
        log.error("corrupt layer output from %s (%s): %s", name, short_id(node_id), event.fault.detail)
        self._say(f"{name} returned a corrupt layer output ({event.fault.detail}): it is left out as "
                  "corrupt_output until it restarts")
        self._mesh.verdicts.exclude_corrupt(node_id, event.fault.kind)
        # The request in flight is retried (or its stream replayed) by the proxy on the new plan.
        self._loop.restart(f"{name} returned a corrupt layer output")

    def on_slow(self, slow: Slow) -> bool:
        """A stream fell far behind a token's time: leave out the worker whose replies held it up for most of
        it, when the model in service fits without it. True when llama-server is being replaced."""
        if self._loop.plan() is None or not self._loop.running():
            return False
        verdict = blame_slow(slow, self._mesh.verdicts.reply_waits_s(slow.since), self._loop.snapshot(),
                             {w.node_id for w in self._mesh.self_info.slow_workers})
        if verdict.node_id is None:
            return False
        node_id, owed_s = verdict.node_id, verdict.owed_s
        name = self._mesh.name_of(node_id)
        if verdict.blame is Blame.ALREADY_LEFT_OUT:
            return True  # the next llama-server runs without it
        if verdict.blame is Blame.NOT_ENOUGH:
            log.info("a stream fell behind (%s), but no worker held it up: %s owed replies for %.1f s of it",
                     slow.describe(), name, owed_s)
            return False
        if verdict.blame is Blame.NEEDED:
            if node_id not in self._slow_kept:
                self._slow_kept.add(node_id)
                self._say(f"{name} is holding tokens up ({slow.describe()}; {owed_s:.1f} s waiting for its "
                          f"replies), but {self._loop.model_name()} does not fit without it: it stays in the plan")
            return False
        self._metrics.slow_workers.inc()
        self._say(f"{name} is holding tokens up ({slow.describe()}; {owed_s:.1f} s waiting for its replies): "
                  f"it is left out as slow for {SLOW_EXCLUSION_S / 60:.0f} minutes or until it restarts")
        self._mesh.verdicts.exclude_slow(node_id, owed_s, slow.window_s, slow.expected_s)
        # The stream goes on where it was (continuation) on the plan without it.
        self._loop.restart(f"{name} was holding tokens up")
        return True
