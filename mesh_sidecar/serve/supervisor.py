"""Serving the model: plan the layers over the mesh, run llama-server, keep the API up.

The serving node's loop::

    proxy up (holding) -> wait for --min-peers
    loop:
        plan the largest tier (--model, given once or more) the connected members hold
        (a bigger one than in service only once the step-up rules allow, tiers.py)
                                     --PlanError (no tier fits)-->  proxy refuses with the shortfall
        start llama-server on that tier with the plan's --rpc order and --tensor-split
        proxy serves
        wait for trouble: llama-server exited | a member of the plan is lost
                          | a worker returned a corrupt layer output (wire/rpc_outputs.py's rule)
                          | membership changed and the plan (or the tier) would change
                          | a bigger tier has fitted long enough
        drain (bounded; none when a member of the plan is unreachable), stop llama-server

The decisions (which tier and plan, whether to replan, whom to blame for a slow
stream) are replan.py's, pure over a snapshot; this module reads the live mesh
and the loop clock into that snapshot and does what the decisions say.

llama.cpp aborts on any RPC transport error and an idle llama-server only
notices at its next request, so a lost member of the plan is a reason to
restart at once. The API port never closes: requests wait while llama-server
comes back, and get an OpenAI-style 503 naming the shortfall when the mesh
cannot hold the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..environment import output_check
from ..errors import PlanError, ProcessError
from ..home import write_private_file
from ..identity import NodeIdentity
from ..llama.build import LlamaBinaries
from ..llama.capacity import Capacity
from ..llama.launch import ChildProcess, start_llama_server
from ..mesh.runtime import Mesh
from ..mesh.status import rtt_ms
from ..ports import LOOPBACK, free_tcp_port
from ..progress import ProgressCallback
from ..wire.gossip import MAX_SERVED_MEMBERS, ServedModel
from .catalog import LOADING, READY, UNAVAILABLE
from .estimates import cached_estimate, estimate_off_loop
from .exchange import ServingHooks
from .failover_timeline import FailoverTimeline
from .mesh_round import MeshRound, planning_members
from .metrics import Metrics
from .options import ServeOptions
from .plan_start import PlanAnnouncement, plan_argv, start_retry_delay
from .planner import Plan, PlanBy
from .proxy import ApiProxy
from .receipt import Generation
from .receipt_writer import ReceiptWriter
from .replan import (
    Replan,
    ServingSnapshot,
    StepUp,
    Tier,
    choose_plan,
    replan_reason,
    tier_index,
)
from .speculation import Speculation, choose
from .step_up import StepUpGate
from .tiers import TierView, model_id, tier_views
from .worker_watch import WatchedLoop, WorkerWatch

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0
RESTART_DELAY_S = 1.0
UPSTREAM_KEY_FILE = "llama-server.key"  # in the node's home, mode 0600

@dataclass(frozen=True)
class ServingHost:
    """What the serving loop uses of the node it runs in."""

    identity: NodeIdentity
    name: str
    mesh: Mesh
    binaries: LlamaBinaries
    rpc_port: int  # this node's own rpc-server, on loopback
    logs: Path  # the node's log directory; llama-server's key goes beside it, in the node's home
    metrics: Metrics
    proxy: ApiProxy  # the node's API: this node's llama-server is attached to it
    api_url: Callable[[], str | None]  # where people reach the API (None: --no-api)
    upstream_key: str  # llama-server's own key, known only to the proxy (see llama_server_argv)
    own_capacity: Callable[[], Capacity]  # what this node offers now
    say: Callable[[Any], None]  # a line (or a PlanAnnouncement) for the user
    # A fresh reporter per llama-server start, told its load stages; None: loads are silent.
    load_progress: Callable[[], ProgressCallback] | None = None
    # Before a plan's load: workers lacking a hub model's file fetch their layers (serve/layer_share.py).
    before_load: Callable[..., Awaitable[None]] | None = None


class ServingSupervisor:
    """Owns llama-server and the API port of a serving node."""

    def __init__(self, options: ServeOptions, host: ServingHost) -> None:
        self._options = options
        self._host = host
        self._identity = host.identity
        self._mesh = host.mesh
        self._metrics = host.metrics
        self._say = host.say
        self.model = options.models[0][0]  # the tier in service (or last planned)
        self.projector = options.projector(0)  # its --mmproj projector, if it has one
        self._in_service: Path | None = None  # the tier llama-server was last started on
        self._step_up = StepUpGate(options.step_up)
        self._recheck_at: float | None = None  # loop time to look again at a step up that must wait
        self.step_up_pending: tuple[str, float] | None = None  # (file name, loop time it may happen)
        self._receipts = (ReceiptWriter(options, host.identity, host.name, host.mesh)
                          if options.receipts is not None else None)
        self.speculation: Speculation | None = None
        # llama-server's own key, known only to our proxy (see llama_server_argv); its file is written in run().
        self._upstream_key_file = host.logs.parent / UPSTREAM_KEY_FILE
        self._wakeup = asyncio.Event()
        # What the traffic shows of the plan's workers: corrupt outputs, slow workers, their speeds.
        self._workers = WorkerWatch(host.mesh, host.identity, host.metrics, host.say, WatchedLoop(
            plan=lambda: self.plan, running=lambda: self.llama_server is not None, snapshot=self._snapshot,
            model_name=lambda: self.model.name, restart=self.request_restart, wake=self._wakeup.set))
        self.speeds = self._workers.speeds  # how much slower each worker runs than it announced
        # The node's API sends its requests for our model to our llama-server, with these hooks.
        self._proxy: ApiProxy = host.proxy
        self._proxy.attach(ServingHooks(on_stall=self.request_restart, on_slow=self._workers.on_slow,
                                        links_rtt_s=self._links_rtt_s, catalog=self.tier_views,
                                        planned_token_s=lambda: None if self.plan is None else self.plan.token_s,
                                        on_decoded=self._workers.on_decoded,
                                        split=lambda: self.plan is not None and not self.plan.alone,
                                        on_generation=None if self._receipts is None else self._write_receipt),
                           host.upstream_key)
        self.since = time.time()  # announced: serving nodes that began earlier pick their workers first
        self._state = LOADING  # what gossip says of our model: LOADING, READY or UNAVAILABLE
        self._round: MeshRound | None = None  # the last planning round's share of the mesh
        self._restart_reason: str | None = None
        self._speed_replanned_at: float | None = None  # loop time of the last replan for speed
        self.llama_server: ChildProcess | None = None
        self.llama_port: int | None = None
        self.plan: Plan | None = None
        self.outage: str | None = None  # why the API answers 503 now (no tier fits, llama-server did not start)
        self.restarts = 0
        self._start_failures = 0  # in a row; reset by a start that reaches the API
        self._failover: FailoverTimeline | None = None  # the failover under way, its phases so far

    # --- reading the mesh for the decisions (replan.py) ------------------------------

    def _snapshot(self) -> ServingSnapshot:
        """This node's share of the connected members, the tiers and the plan in service, at the loop's time now."""
        tiers = tuple(Tier(path, self._options.tier_estimate(
                          i, cached_estimate(path, self._options.ctx_size, kv_cache=self._options.kv_cache)))
                      for i, (path, _) in enumerate(self._options.models))
        self._round = planning_members(self._mesh, self._identity, self._host.name, self._own_for_planning(), tiers,
                                       since=self.since, spread=self._options.spread, by=self._options.plan_by,
                                       observed=self.speeds)
        return ServingSnapshot(asyncio.get_running_loop().time(), self._round.members, self._round.refused, tiers,
                               tier_index(tiers, self._in_service), self.plan, by=self._options.plan_by,
                               spread=self._options.spread, speed_replanned_at=self._speed_replanned_at,
                               unplanned=self._round.unplanned)

    def served(self) -> ServedModel:
        """What this node says in gossip of the model it serves (read at each announcement)."""
        needs = self._round.needs if self._round is not None else None
        return ServedModel(
            model=model_id(self.model.name), state=self._state, since=self.since, in_flight=self._proxy.in_flight,
            alone_bytes=needs.alone_bytes if needs else 0, margin_bytes=needs.margin_bytes if needs else 0,
            layer_bytes=needs.layer_bytes if needs else 0, spread=self._options.spread,
            members=self.plan.rpc_nodes()[:MAX_SERVED_MEMBERS] if self.plan else (),
            by_speed=self._options.plan_by is PlanBy.SPEED,
            projector_sha256=self.projector.sha256 if self.projector is not None else "")

    def _set_state(self, state: str) -> None:
        if state != self._state:
            self._state = state
            self._mesh.serving_changed()

    def _own_for_planning(self) -> Capacity:
        own = self._host.own_capacity()
        if self._options.draft_model is not None:
            # The draft runs on this node's CPU, beside its share of the big model; its cache
            # stays f16 (llama-server's --cache-type-k/-v are the main model's, -ctkd the draft's).
            draft = cached_estimate(self._options.draft_model, self._options.ctx_size)
            own = dataclasses.replace(own, usable_bytes=max(0, own.usable_bytes - draft.total_bytes))
        return own

    def tier_views(self) -> list[TierView]:
        """The tiers as clients see them (``/v1/models``), the one in service first, each weighed over its own
        claim (one too large, over every worker this node could use, with its shortfall)."""
        self._snapshot()
        assert self._round is not None
        serving = self._in_service if self.llama_server is not None and self.outage is None else None
        return tier_views(self._round.tiers, serving.name if serving is not None else None)

    def plan_in_service(self) -> Plan | None:
        """The plan llama-server runs (or loads), with every member's place as the mesh stands now (None: no plan)."""
        if self.plan is None or self._round is None:
            return self.plan
        return self._round.with_plan(self.plan, self.plan.model_name)

    def _keep_step_up(self, look: StepUp) -> None:
        """Keep the gate as a look at it left it; status says when a step up that must wait may happen."""
        self._step_up = look.gate
        self._recheck_at = look.ready_at
        self.step_up_pending = None if look.waiting is None or look.ready_at is None else (look.waiting, look.ready_at)

    def _choose_speculation(self, plan: Plan) -> Speculation:
        remote = {n.node_id for n in plan.nodes if n.node_id != self._identity.node_id}
        known = [view.rtt_typical_s for view in self._mesh.peer_views()
                 if view.node_id in remote and view.rtt_typical_s is not None]
        return choose(self._options.draft_model, rtt_ms(max(known)) if known else None, len(remote),
                      allowed=self._options.speculate)

    def _endpoint(self, node_id: bytes) -> str:
        if node_id == self._identity.node_id:
            return f"{LOOPBACK}:{self._host.rpc_port}"
        return self._mesh.tunnel_endpoint(node_id)

    # --- lifecycle -----------------------------------------------------------------

    async def run(self) -> None:
        await self._open()
        for path, _ in self._options.models:
            await estimate_off_loop(path, self._options.ctx_size, self._options.kv_cache)
        if self._receipts is not None:
            await self._receipts.ready()
        await self._wait_for_peers()
        loop = asyncio.get_running_loop()
        while True:
            await self._apply_plan()
            if self._failover is not None:
                self._failover_ended()
            replan = await self._trouble()
            self._say(f"{replan.reason}; replanning...")
            if replan.for_speed:
                self._speed_replanned_at = loop.time()
            if replan.failover:
                self._metrics.failovers.inc()
                self._failover = FailoverTimeline(loop.time(), self._detect_s())
            await self._proxy.drain(0.0 if self._plan_unreachable() else DRAIN_TIMEOUT_S)
            self._set_state(LOADING)
            if self.llama_server is not None:
                # A member of its plan gone, it cannot finish: a graceful SIGTERM costs the failover 0.3 s.
                await self.llama_server.stop(at_once=self._plan_unreachable())
                self.llama_server = None
                self.restarts += 1
                self._metrics.restarts.inc()
                await self._settle(RESTART_DELAY_S)
            if self._failover is not None:
                self._failover.lap("stop", loop.time())

    def _detect_s(self) -> float:
        """How long the mesh took to know the plan's lost members were gone (0: none is known lost yet)."""
        return max((self._mesh.detection_s(node_id) for node_id in self._unreachable_members()), default=0.0)

    async def _settle(self, timeout_s: float) -> None:
        """After llama-server stopped: wait until a member of the plan is known lost, or ``timeout_s``. A worker's
        death often ends llama-server a round trip or two before the mesh confirms it (health.py): planning at
        once would plan with the dead member."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._plan_unreachable() and (left_s := deadline - loop.time()) > 0:
            seen = self._mesh.changes.version
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._mesh.changes.wait_after(seen), left_s)

    def _failover_ended(self) -> None:
        """The plan after a failover is applied: its phases to /metrics and the log."""
        assert self._failover is not None
        timeline, self._failover = self._failover, None
        for phase, length_s in timeline.phases_s.items():
            self._metrics.failover_phases.labels(phase).observe(length_s)
        log.info("failover: %s", timeline.describe())

    async def _open(self) -> None:
        """Before the first plan: llama-server's key file, the output check, requests held, the claim announced."""
        write_private_file(self._upstream_key_file, self._host.upstream_key + "\n")
        self._mesh.install_serving(output_check(), self._workers.on_corrupt_output)
        self._proxy.hold()
        self._snapshot()  # the claim's figures, before the first announcement
        self._mesh.announce_serving(self.served)

    def _plan_unreachable(self) -> bool:
        """Whether a member of the plan has no connection left: what runs through it cannot finish, so
        a drain would only wait (with --b2b llama-server waits on the workers after it instead of
        failing); the proxy continues those requests on the new plan. A member leaving gracefully
        keeps its connection until its requests are done, and is drained as before."""
        return bool(self._unreachable_members())

    def _unreachable_members(self) -> set[bytes]:
        """The members of the plan this node no longer holds a connection to."""
        return {node.node_id for node in self.plan.nodes if node.node_id != self._identity.node_id
                and not self._mesh.reaches(node.node_id)} if self.plan is not None else set()

    def request_restart(self, reason: str) -> None:
        """Restart llama-server at once (the proxy saw it stall)."""
        self._restart_reason = reason
        self._wakeup.set()

    def _links_rtt_s(self) -> float:
        """The plan's workers' typical round trips, summed: a token crosses each of them."""
        workers = {n.node_id for n in self.plan.nodes} if self.plan is not None else set()
        return sum(view.rtt_typical_s or 0.0 for view in self._mesh.peer_views() if view.node_id in workers)

    async def close(self) -> None:
        # Held requests get their answer now instead of keeping the node alive.
        self._proxy.refuse("This node is shutting down; retry against another serving node or later.")
        if self.llama_server is not None:
            await self.llama_server.stop()

    async def _wait_for_peers(self) -> None:
        seen = self._mesh.changes.version
        while (missing := self._options.min_peers - len(self._mesh.connected_members())) > 0:
            self._say(f"Waiting for {missing} more peer(s) before loading the model...")
            seen = await self._mesh.changes.wait_after(seen)

    async def _apply_plan(self) -> None:
        """Start llama-server on a fresh plan, or make the proxy refuse with the reason."""
        snapshot = self._snapshot()
        try:
            choice = choose_plan(snapshot, self._step_up)
            if self._failover is not None:
                self._failover.lap("plan", asyncio.get_running_loop().time())
        except PlanError as exc:
            self.plan, self.outage = None, str(exc)
            self._say(f"Cannot load the model: {exc}")
            self._proxy.refuse(str(exc))
            self._set_state(UNAVAILABLE)
            return
        self._keep_step_up(choice.step_up)
        assert self._round is not None  # read by the snapshot just taken
        # The one plan object: --rpc below, gossip's members (the assignment every node computes), status, `plan`.
        self.plan, self.outage = self._round.with_plan(choice.plan, self._options.model_name(choice.tier)), None
        self._set_state(LOADING)
        path, sha256 = self._options.models[choice.tier]
        projector = self._options.projector(choice.tier)
        self.projector = projector
        if choice.switch is not None and self._in_service is not None:
            self._say(f"Switching model {choice.switch}: {self._in_service.name} -> {path.name} "
                      f"(the largest tier that {'has fitted long enough' if choice.switch == 'up' else 'fits now'})")
            self._metrics.model_switches.labels(choice.switch).inc()
            self._step_up = self._step_up.switched(snapshot.now)
        self.model = self._in_service = path
        self._metrics.model.info({"id": model_id(path.name), "file": path.name, "sha256": sha256})
        if sha256 != self._mesh.model_sha256:
            # Members compare their file with the one in service (weights_mismatch), and may fetch it.
            self._mesh.holds_model(sha256, path)
        self._say(PlanAnnouncement(self.plan.to_json()))
        self.speculation = self._choose_speculation(self.plan)
        if self.speculation.kind != "none":
            self._say(f"Speculative decoding: {self.speculation.reason}")
        self.llama_port = free_tcp_port()
        argv = plan_argv(self._host.binaries, self.model, self.plan, self._endpoint, self.llama_port,
                         key_file=self._upstream_key_file, options=self._options, speculation=self.speculation,
                         projector=projector)
        # Workers map REGISTER_PEER's peer ids through this order.
        self._mesh.announce_rpc_order(self.plan.rpc_nodes())
        if self._host.before_load is not None:  # a failover loads at once: the fetches help later loads
            await self._host.before_load(self.plan, path, sha256, wait=self._failover is None)
        load_progress = self._host.load_progress
        self._mesh.new_serving_session()  # the output rule's histories per worker begin anew
        try:
            self.llama_server = await start_llama_server(
                argv, self.llama_port, self._host.logs, load_progress() if load_progress else None)
        except ProcessError as exc:
            if self._failover is not None:
                self._failover.lap("load", asyncio.get_running_loop().time())
            self._start_failures += 1
            self.outage = f"llama-server failed to start: {exc}"
            self._say(f"{self.outage}\nTrying again in {start_retry_delay(self._start_failures):.0f} s.")
            self._proxy.refuse(self.outage)
            self._set_state(UNAVAILABLE)
            return
        self._start_failures = 0
        if self._failover is not None:
            self._failover.lap("load", asyncio.get_running_loop().time())
        self._proxy.serve(f"http://{LOOPBACK}:{self.llama_port}", model_id(path.name))
        self._set_state(READY)
        where = self._host.api_url()
        self._say(f"OpenAI-compatible API ready on {where}, serving {model_id(path.name)}" if where else
                  f"{model_id(path.name)} is ready (this node's API is off: members forward requests to it)")

    async def _trouble(self) -> Replan:
        """Wait until llama-server must be restarted (or started); say why, and if it is a failover."""
        exited = asyncio.ensure_future(self.llama_server.wait()) if self.llama_server else None
        loop = asyncio.get_running_loop()
        retry_at = (loop.time() + start_retry_delay(self._start_failures)
                    if self.llama_server is None and self.plan is not None and self._start_failures else None)
        try:
            while exited is None or not exited.done():
                if (trouble := self._replan_reason()) is not None:
                    return trouble
                if retry_at is not None and loop.time() >= retry_at:
                    return Replan("Starting llama-server again", False)
                seen = self._mesh.changes.version
                self._wakeup.clear()
                woken = {asyncio.ensure_future(self._mesh.changes.wait_after(seen)),
                         asyncio.ensure_future(self._wakeup.wait())}
                # A pending step up is looked at again when its wait is over.
                wake_at = min((t for t in (retry_at, self._recheck_at) if t is not None), default=None)
                await asyncio.wait(woken | ({exited} if exited else set()), return_when=asyncio.FIRST_COMPLETED,
                                   timeout=None if wake_at is None else max(0.0, wake_at - loop.time()))
                for task in woken:
                    task.cancel()
            assert self.llama_server is not None
            return Replan(str(self.llama_server.exited_error()), True)
        finally:
            if exited is not None:
                exited.cancel()

    def _replan_reason(self) -> Replan | None:
        """Why the current state should be replaced (and if that is a failover), or None."""
        self._recheck_at = None
        if self._restart_reason is not None:
            reason, self._restart_reason = self._restart_reason, None
            return Replan(reason, True)
        replan, look = replan_reason(self._snapshot(), self._step_up)
        if look is not None:
            self._keep_step_up(look)
        return replan

    def _write_receipt(self, generation: Generation) -> None:
        """--receipt DIR: one signed JSON per finished generation request (receipt_writer.py)."""
        assert self._receipts is not None and self.plan is not None
        self._receipts.write(generation, self.model, self.plan, self.speculation)

    def status(self) -> dict[str, Any]:
        return {
            "model": str(self.model),  # the tier in service, or the last one planned
            "projector": str(self.projector.path) if self.projector is not None else None,  # its --mmproj
            "step_up": ({"model": self.step_up_pending[0],
                         "in_s": round(max(0.0, self.step_up_pending[1] - asyncio.get_running_loop().time()), 1)}
                        if self.step_up_pending else None),
            "plan": plan.to_json() if (plan := self.plan_in_service()) is not None else None,
            "refusal": self.outage,
            "speculation": self.speculation.to_json() if self.speculation else None,
            "llama_server_restarts": self.restarts,
            "slowdowns": self.speeds.to_json(),  # each worker measured: how much slower than it announced
            "live": self._proxy.token_rate.to_json(time.monotonic()),
        }
