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
                          | a worker returned a corrupt layer output (output_guard.py)
                          | membership changed and the plan (or the tier) would change
                          | a bigger tier has fitted long enough
        drain (bounded; none when a member of the plan is unreachable), stop llama-server

llama.cpp aborts on any RPC transport error and an idle llama-server only
notices at its next request, so a lost member of the plan is a reason to
restart at once. The API port never closes: requests wait while llama-server
comes back, and get an OpenAI-style 503 naming the shortfall when the mesh
cannot hold the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from datetime import datetime, timezone
import functools
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import dashboard
from ..llama.capacity import Capacity
from ..errors import PlanError, PortInUseError, ProcessError
from ..home import write_private_file
from ..llama.estimate import ModelEstimate, estimate_model
from ..identity import NodeIdentity, short_id
from ..llama.launch import ChildProcess, llama_server_argv, start_llama_server
from ..llama.build import LlamaBinaries
from ..mesh.refusal import SLOW_REFUSAL_S, Refusal, refusal
from ..mesh.runtime import Mesh
from ..mesh.status import rtt_ms
from .metrics import Metrics
from .output_guard import OutputGuard
from .pace import SLOW_BLAME_SHARE, Slow
from ..environment import output_check
from ..wire.rpc_outputs import OutputRejected
from .planner import NodeCapacity, Plan, TierAssessment, assess_tiers, choose_tier, tier_needs_bytes
from ..ports import LOOPBACK, free_tcp_port
from ..progress import ProgressCallback
from .access import OPEN_ACCESS, ApiAccess
from .proxy import ApiProxy, Generation
from . import receipt
from ..llama.model import model_sha256
from .speculation import Speculation, choose
from .tiers import StepUpGate, StepUpRules, TierView, model_id, tier_views

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0
RESTART_DELAY_S = 1.0
# A llama-server that dies while loading (a tunnel torn down under it, say) is
# started again after this, doubling per failure in a row up to the maximum.
START_RETRY_FIRST_S = 2.0
START_RETRY_MAX_S = 60.0
UPSTREAM_KEY_FILE = "llama-server.key"  # in the node's home, mode 0600
UPSTREAM_KEY_BYTES = 32

# A node asks for the estimate on every membership change; the first read of a GGUF
# takes seconds (its tokenizer arrays), so it is cached and first made off the event loop.
cached_estimate = functools.lru_cache(maxsize=8)(estimate_model)


async def estimate_off_loop(model: Path, ctx_size: int) -> ModelEstimate:
    """The cached estimate, computed in a thread the first time: heartbeats keep flowing meanwhile."""
    return await asyncio.to_thread(cached_estimate, model, ctx_size)


@dataclass(frozen=True)
class PlanAnnouncement:
    """Said to the user when llama-server starts on a new plan; the CLI draws it as a table."""

    plan_json: dict[str, Any]  # Plan.to_json()
    title: str

    def __str__(self) -> str:
        """One line, for the recent events (`status --json`, the dashboard) and logs."""
        nodes = ", ".join(f"{n['name']} [{n['layers'][0]}, {n['layers'][1]})" for n in self.plan_json["nodes"])
        return f"{self.title}: {self.plan_json['n_layers']} layers over {nodes}"


def planning_members(mesh: Mesh, identity: NodeIdentity, name: str, own: Capacity,
                     without: bytes | None = None) -> tuple[list[NodeCapacity], tuple[tuple[NodeCapacity, Refusal], ...]]:
    """The members to plan over (less ``without``), and those refused with the reason.

    Peers come first (by id) and this node last: llama.cpp puts the output
    layer on the last device, so the logits (vocabulary x 4 bytes a token)
    stay on loopback instead of crossing the network.
    """
    members, refused = [], []
    for info in mesh.connected_members():
        if info.node_id == without:
            continue
        # Less what the member's rpc-server holds for other serving nodes (they run their own models).
        member = NodeCapacity(info.node_id, info.name,
                              Capacity.from_gossip(dict(info.capacity)).usable_for(identity.node_id))
        # As if this node served, so `plan` on any node shows what serving there would leave out.
        if (why := refusal(info, mesh.self_info)) is not None:
            refused.append((member, why))
        else:
            members.append(member)
    # The tier planning takes each tier's input embeddings off this node's share.
    members.append(NodeCapacity(identity.node_id, name, max(0, own.usable_bytes - mesh.held_for_peers_bytes())))
    return members, tuple(refused)


def plan_over_mesh(mesh: Mesh, identity: NodeIdentity, name: str, own: Capacity,
                   tiers: Sequence[tuple[Path, ModelEstimate]], at_most_bytes: int | None = None,
                   without: bytes | None = None) -> tuple[int, Plan]:
    """The index of the largest tier the members connected now (less ``without``) can hold, and its plan.

    PlanError if they cannot hold any of ``tiers``. ``at_most_bytes``: see ``choose_tier``.
    """
    members, refused = planning_members(mesh, identity, name, own, without)
    index, plan = choose_tier([(path.name, estimate) for path, estimate in tiers], members,
                              at_most_bytes=at_most_bytes)
    return index, dataclasses.replace(plan, refused=refused)


class ServingSupervisor:
    """Owns llama-server and the API port of a serving node."""

    def __init__(
        self,
        *,
        identity: NodeIdentity,
        name: str,
        mesh: Mesh,
        binaries: LlamaBinaries,
        models: Sequence[tuple[Path, str]],
        ctx_size: int,
        serve_port: int,
        min_peers: int,
        rpc_port: int,
        own_capacity: Callable[[], Capacity],
        logs: Path,
        metrics: Metrics,
        say: Callable[[Any], None],
        node_status: Callable[[], dict[str, Any]],
        access: ApiAccess = OPEN_ACCESS,
        draft_model: Path | None = None,
        receipts: Path | None = None,
        speculate: bool = True,
        load_progress: Callable[[], ProgressCallback] | None = None,
        step_up: StepUpRules = StepUpRules(),
    ) -> None:
        self._identity = identity
        # A fresh reporter per llama-server start, told its load stages; None: loads are silent.
        self._load_progress = load_progress
        self._name = name
        self._mesh = mesh
        self._binaries = binaries
        # The tier list: (path, sha256) of every --model, in the order given.
        self._models = tuple(models)
        self.model = self._models[0][0]  # the tier in service (or last planned)
        self._in_service: Path | None = None  # the tier llama-server was last started on
        self._step_up = StepUpGate(step_up)
        self._recheck_at: float | None = None  # loop time to look again at a step up that must wait
        self.step_up_pending: tuple[str, float] | None = None  # (file name, loop time it may happen)
        self._ctx_size = ctx_size
        self._serve_port = serve_port
        self._min_peers = min_peers
        self._rpc_port = rpc_port
        self._own_capacity = own_capacity
        self._logs = logs
        self._say = say
        self._metrics = metrics
        self._access = access
        self._draft_model = draft_model
        self._speculate = speculate
        self._draft_sha256: str | None = None
        self._receipts = receipts
        self.speculation: Speculation | None = None
        # llama-server's own key, known only to our proxy (see llama_server_argv).
        upstream_key = secrets.token_hex(UPSTREAM_KEY_BYTES)
        self._upstream_key_file = logs.parent / UPSTREAM_KEY_FILE
        write_private_file(self._upstream_key_file, upstream_key + "\n")
        self._proxy = ApiProxy(metrics, self.request_restart, access=access, upstream_key=upstream_key,
                               on_generation=self._write_receipt if receipts is not None else None,
                               catalog=self.tier_views, on_slow=self._on_slow, links_rtt_s=self._links_rtt_s)
        dashboard.add_routes(self._proxy.app, node_status, mesh.peer_views)
        self._restart_reason: str | None = None
        self._slow_kept: set[bytes] = set()  # slow workers kept because the model needs them (said once)
        self._wakeup = asyncio.Event()
        if output_check():
            mesh.check_outputs(OutputGuard().judge, self._on_corrupt_output)
        self.llama_server: ChildProcess | None = None
        self.llama_port: int | None = None
        self.plan: Plan | None = None
        self.refusal: str | None = None
        self.restarts = 0
        self._start_failures = 0  # in a row; reset by a start that reaches the API

    # --- planning ------------------------------------------------------------------

    def compute_plan(self, at_most_bytes: int | None = None, without: bytes | None = None) -> tuple[int, Plan]:
        """The index in the tier list of the model to serve now, and its plan; ``at_most_bytes``: see choose_tier;
        ``without``: a member left out of this plan."""
        return plan_over_mesh(self._mesh, self._identity, self._name, self._own_for_planning(),
                              self._tier_estimates(), at_most_bytes, without)

    def _own_for_planning(self) -> Capacity:
        own = self._own_capacity()
        if self._draft_model is not None:
            # The draft runs on this node's CPU, beside its share of the big model.
            draft = cached_estimate(self._draft_model, self._ctx_size)
            own = dataclasses.replace(own, usable_bytes=max(0, own.usable_bytes - draft.total_bytes))
        return own

    def _tier_estimates(self) -> list[tuple[Path, ModelEstimate]]:
        return [(path, cached_estimate(path, self._ctx_size)) for path, _ in self._models]

    def _needs_bytes(self, model: Path) -> int:
        return tier_needs_bytes(cached_estimate(model, self._ctx_size))

    def assess_tiers(self) -> TierAssessment:
        """Every tier against the members connected now."""
        members, _ = planning_members(self._mesh, self._identity, self._name, self._own_for_planning())
        return assess_tiers([(path.name, estimate) for path, estimate in self._tier_estimates()], members)

    def tier_views(self) -> list[TierView]:
        """The tiers as clients see them (``/v1/models``), the one in service first."""
        serving = self.llama_server is not None and self.refusal is None and self._in_service is not None
        return tier_views(self.assess_tiers().fits, self._in_service.name if serving else None)

    def _step_up_allowed(self, tier: int) -> bool:
        """Whether ``tier`` may replace the tier in service now (always, unless it is a bigger one)."""
        if self._in_service is None or self._needs_bytes(self._models[tier][0]) <= self._needs_bytes(self._in_service):
            self._step_up.bigger_gone()
            self.step_up_pending = None
            return True
        now = asyncio.get_running_loop().time()
        wait_s = self._step_up.bigger_fits(now)
        if wait_s > 0:
            self._recheck_at = now + wait_s
            self.step_up_pending = (self._models[tier][0].name, now + wait_s)
            return False
        self.step_up_pending = None
        return True

    def _choose_speculation(self, plan: Plan) -> Speculation:
        remote = {n.node_id for n in plan.nodes if n.node_id != self._identity.node_id}
        known = [view.rtt_typical_s for view in self._mesh.peer_views()
                 if view.node_id in remote and view.rtt_typical_s is not None]
        return choose(self._draft_model, rtt_ms(max(known)) if known else None, len(remote),
                      allowed=self._speculate)

    def _endpoint(self, node_id: bytes) -> str:
        if node_id == self._identity.node_id:
            return f"{LOOPBACK}:{self._rpc_port}"
        return self._mesh.tunnel_endpoint(node_id)

    # --- lifecycle -----------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._proxy.start(self._serve_port)
        except OSError as exc:
            raise PortInUseError(
                f"Cannot listen on port {self._serve_port} ({exc.strerror}). "
                "Stop the program holding it or choose another with --serve PORT."
            ) from exc
        for path, _ in self._models:
            await estimate_off_loop(path, self._ctx_size)
        if self._draft_model is not None:
            self._draft_sha256 = await asyncio.to_thread(model_sha256, self._draft_model, lambda *_: None)
        await self._wait_for_peers()
        while True:
            await self._apply_plan()
            reason, failover = await self._trouble()
            self._say(f"{reason}; replanning...")
            if failover:
                self._metrics.failovers.inc()
            await self._proxy.drain(0.0 if self._plan_unreachable() else DRAIN_TIMEOUT_S)
            if self.llama_server is not None:
                await self.llama_server.stop()
                self.llama_server = None
                self.restarts += 1
                self._metrics.restarts.inc()
                await asyncio.sleep(RESTART_DELAY_S)

    def _plan_unreachable(self) -> bool:
        """Whether a member of the plan has no connection left: what runs through it cannot finish, so
        a drain would only wait (with --b2b llama-server waits on the workers after it instead of
        failing); the proxy continues those requests on the new plan. A member leaving gracefully
        keeps its connection until its requests are done, and is drained as before."""
        return self.plan is not None and any(
            node.node_id != self._identity.node_id and not self._mesh.reaches(node.node_id) for node in self.plan.nodes)

    def request_restart(self, reason: str) -> None:
        """Restart llama-server at once (the proxy saw it stall)."""
        self._restart_reason = reason
        self._wakeup.set()

    def _on_corrupt_output(self, node_id: bytes, event: OutputRejected) -> None:
        """A worker's reply failed the output check (its tunnel connection is already reset)."""
        name = self._mesh.name_of(node_id)
        self._metrics.corrupt_outputs.inc()
        log.error("corrupt layer output from %s (%s): %s", name, short_id(node_id), event.fault.detail)
        self._say(f"{name} returned a corrupt layer output ({event.fault.detail}): it is left out as "
                  "corrupt_output until it restarts")
        self._mesh.refuse_corrupt(node_id, event.fault.kind)
        # The request in flight is retried (or its stream replayed) by the proxy on the new plan.
        self.request_restart(f"{name} returned a corrupt layer output")

    def _on_slow(self, slow: Slow) -> bool:
        """A stream fell far behind a token's time: leave out the worker whose replies held it up for most of
        it, when the model in service fits without it. True when llama-server is being replaced."""
        plan = self.plan
        if plan is None or self.llama_server is None:
            return False
        workers = {n.node_id for n in plan.nodes if n.node_id != self._identity.node_id}
        waits = {node_id: s for node_id, s in self._mesh.reply_waits_s(slow.since).items() if node_id in workers}
        if not waits:
            return False
        node_id, owed_s = max(waits.items(), key=lambda wait: wait[1])
        name = self._mesh.name_of(node_id)
        if any(w.node_id == node_id for w in self._mesh.self_info.slow_workers):
            return True  # already left out: the next llama-server runs without it
        if owed_s < SLOW_BLAME_SHARE * slow.window_s:
            log.info("a stream fell behind (%s), but no worker held it up: %s owed replies for %.1f s of it",
                     slow.describe(), name, owed_s)
            return False
        try:
            tier, _ = self.compute_plan(without=node_id)
        except PlanError:
            tier = None
        if tier is None or self._models[tier][0] != self._in_service:
            if node_id not in self._slow_kept:
                self._slow_kept.add(node_id)
                self._say(f"{name} is holding tokens up ({slow.describe()}; {owed_s:.1f} s waiting for its "
                          f"replies), but {self.model.name} does not fit without it: it stays in the plan")
            return False
        self._metrics.slow_workers.inc()
        self._say(f"{name} is holding tokens up ({slow.describe()}; {owed_s:.1f} s waiting for its replies): "
                  f"it is left out as slow for {SLOW_REFUSAL_S / 60:.0f} minutes or until it restarts")
        self._mesh.refuse_slow(node_id, owed_s, slow.window_s, slow.expected_s)
        # The stream goes on where it was (continuation) on the plan without it.
        self.request_restart(f"{name} was holding tokens up")
        return True

    def _links_rtt_s(self) -> float:
        """The plan's workers' typical round trips, summed: a token crosses each of them."""
        workers = {n.node_id for n in self.plan.nodes} if self.plan is not None else set()
        return sum(view.rtt_typical_s or 0.0 for view in self._mesh.peer_views() if view.node_id in workers)

    async def close(self) -> None:
        # Held requests get their answer now instead of keeping the node alive.
        self._proxy.refuse("This node is shutting down; retry against another serving node or later.")
        await self._proxy.close()
        if self.llama_server is not None:
            await self.llama_server.stop()

    async def _wait_for_peers(self) -> None:
        while (missing := self._min_peers - len(self._mesh.connected_members())) > 0:
            self._say(f"Waiting for {missing} more peer(s) before loading the model...")
            self._mesh.changed.clear()
            await self._mesh.changed.wait()

    async def _apply_plan(self) -> None:
        """Start llama-server on a fresh plan, or make the proxy refuse with the reason."""
        try:
            tier, self.plan = self.compute_plan()
            if not self._step_up_allowed(tier):
                assert self._in_service is not None
                tier, self.plan = self.compute_plan(at_most_bytes=self._needs_bytes(self._in_service))
        except PlanError as exc:
            self.plan, self.refusal = None, str(exc)
            self._say(f"Cannot load the model: {exc}")
            self._proxy.refuse(str(exc))
            return
        self.refusal = None
        path, sha256 = self._models[tier]
        if self._in_service is not None and path != self._in_service:
            direction = "up" if self._needs_bytes(path) > self._needs_bytes(self._in_service) else "down"
            self._say(f"Switching model {direction}: {self._in_service.name} -> {path.name} "
                      f"(the largest tier that {'has fitted long enough' if direction == 'up' else 'fits now'})")
            self._metrics.model_switches.labels(direction).inc()
            self._step_up.switched(asyncio.get_running_loop().time())
        self.model = self._in_service = path
        self._metrics.model.info({"id": model_id(path.name), "file": path.name, "sha256": sha256})
        if sha256 != self._mesh.model_sha256:
            # Members compare their file with the one in service (weights_mismatch), and may fetch it.
            self._mesh.holds_model(sha256, path)
        self._say(PlanAnnouncement(self.plan.to_json(), title=f"Plan for {path.name}"))
        self.speculation = self._choose_speculation(self.plan)
        if self.speculation.kind != "none":
            self._say(f"Speculative decoding: {self.speculation.reason}")
        self.llama_port = free_tcp_port()
        argv = llama_server_argv(
            self._binaries, self.model, [self._endpoint(n.node_id) for n in self.plan.nodes], self.llama_port,
            tensor_split=self.plan.tensor_split(), api_key_file=self._upstream_key_file,
            extra=["--ctx-size", str(self._ctx_size), *self.speculation.llama_server_args()],
        )
        # Workers map REGISTER_PEER's peer ids through this order.
        self._mesh.announce_rpc_order(tuple(n.node_id for n in self.plan.nodes))
        try:
            self.llama_server = await start_llama_server(
                argv, self.llama_port, self._logs, self._load_progress() if self._load_progress else None)
        except ProcessError as exc:
            self._start_failures += 1
            self.refusal = f"llama-server failed to start: {exc}"
            self._say(f"{self.refusal}\nTrying again in {start_retry_delay(self._start_failures):.0f} s.")
            self._proxy.refuse(self.refusal)
            return
        self._start_failures = 0
        self._proxy.serve(f"http://{LOOPBACK}:{self.llama_port}", model_id(path.name))
        self._say(f"OpenAI-compatible API ready on http://localhost:{self._serve_port}/v1"
                  + (" (requires the API key: Authorization: Bearer KEY)" if self._access.api_key is not None else ""))

    async def _trouble(self) -> tuple[str, bool]:
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
                    return "Starting llama-server again", False
                self._mesh.changed.clear()
                self._wakeup.clear()
                woken = {asyncio.ensure_future(self._mesh.changed.wait()), asyncio.ensure_future(self._wakeup.wait())}
                # A pending step up is looked at again when its wait is over.
                wake_at = min((t for t in (retry_at, self._recheck_at) if t is not None), default=None)
                await asyncio.wait(woken | ({exited} if exited else set()), return_when=asyncio.FIRST_COMPLETED,
                                   timeout=None if wake_at is None else max(0.0, wake_at - loop.time()))
                for task in woken:
                    task.cancel()
            assert self.llama_server is not None
            return str(self.llama_server.exited_error()), True
        finally:
            if exited is not None:
                exited.cancel()

    def _replan_reason(self) -> tuple[str, bool] | None:
        """Why the current state should be replaced (and if that is a failover), or None."""
        self._recheck_at = None
        if self._restart_reason is not None:
            reason, self._restart_reason = self._restart_reason, None
            return reason, True
        connected = {info.node_id for info in self._mesh.connected_members()} | {self._identity.node_id}
        if self.plan is not None:
            lost = [n for n in self.plan.nodes if n.node_id not in connected]
            if lost:
                return f"{', '.join(f'{n.name} ({short_id(n.node_id)})' for n in lost)} left the plan", True
        try:
            tier, candidate = self.compute_plan()
        except PlanError:
            return None if self.plan is None else ("The mesh can no longer hold the model", True)
        if self.plan is None:
            return "The mesh can hold the model now", False
        if (path := self._models[tier][0]) != self.model:
            if not self._step_up_allowed(tier):
                return None  # the tier in service goes on as it is until the step up may happen
            if self._needs_bytes(path) > self._needs_bytes(self.model):
                return f"{path.name} has fitted the mesh for {self._step_up.rules.after_s:g} s; stepping up", False
            return f"Members changed and {path.name} is the largest model that fits now", False
        self._step_up_allowed(tier)  # nothing bigger fits: a later step up waits afresh
        if _layout(candidate) != _layout(self.plan):
            return "Members changed and the layers can be spread better", False
        return None

    def _write_receipt(self, generation: Generation) -> None:
        """--receipt DIR: one signed JSON per finished generation request."""
        assert self._receipts is not None and self.plan is not None
        out = generation.output
        timings = out.timings
        plan_ids = {n.node_id for n in self.plan.nodes}
        drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
        now = time.time()
        body = {
            "id": out.response_id,
            "created": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="milliseconds"),
            "request": {"path": generation.path, "body": generation.request},
            "served_by": {"id": self._identity.node_id.hex(), "name": self._name},
            "plan": [{"id": n.node_id.hex(), "name": n.name, "layers": [n.start, n.end]} for n in self.plan.nodes],
            "model": self._model_json(generation.model),
            "draft": ({"name": self._draft_model.name, "sha256": self._draft_sha256}
                      if self._draft_model is not None else None),
            "speculation": self.speculation.to_json() if self.speculation else None,
            # Heartbeat round trips to the plan's other members, as measured while this ran.
            "edges_rtt_ms": {view.name: {"last": rtt_ms(view.rtt_last_s), "p50": rtt_ms(view.rtt_p50_s),
                                         "p95": rtt_ms(view.rtt_p95_s)}
                             for view in self._mesh.peer_views() if view.node_id in plan_ids},
            "tokens": {"prompt": timings.get("prompt_n"), "completion": timings.get("predicted_n")},
            "tok_s": {"prompt": timings.get("prompt_per_second"), "decode": timings.get("predicted_per_second")},
            "draft_acceptance": ({"drafted": drafted, "accepted": accepted, "rate": accepted / drafted}
                                 if drafted else None),
            "output": {"token_ids_sha256": receipt.output_digest(out.token_ids), "n_tokens": len(out.token_ids)},
        }
        self._receipts.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
        path = self._receipts / f"{stamp}-{out.response_id or 'request'}.json"
        # Receipts hold the prompt: readable by this user only.
        write_private_file(path, json.dumps(receipt.sign(body, self._identity), indent=2))

    def _model_json(self, answered_by: str) -> dict[str, str]:
        """The receipt's ``model``: the tier whose id answered (the one in service if unknown)."""
        path, sha256 = next(((path, sha256) for path, sha256 in self._models if model_id(path.name) == answered_by),
                            next((path, sha256) for path, sha256 in self._models if path == self.model))
        return {"name": path.name, "id": model_id(path.name), "sha256": sha256}

    def status(self) -> dict[str, Any]:
        return {
            "api": {"port": self._serve_port, "url": f"http://localhost:{self._serve_port}/v1",
                    "requires_key": self._access.api_key is not None},
            "model": str(self.model),  # the tier in service, or the last one planned
            "step_up": ({"model": self.step_up_pending[0],
                         "in_s": round(max(0.0, self.step_up_pending[1] - asyncio.get_running_loop().time()), 1)}
                        if self.step_up_pending else None),
            "plan": self.plan.to_json() if self.plan else None,
            "refusal": self.refusal,
            "speculation": self.speculation.to_json() if self.speculation else None,
            "llama_server_restarts": self.restarts,
            "live": self._proxy.token_rate.to_json(time.monotonic()),
        }


def start_retry_delay(failures: int) -> float:
    """Seconds before starting llama-server again after ``failures`` failed starts in a row."""
    return min(START_RETRY_MAX_S, START_RETRY_FIRST_S * 2 ** max(0, failures - 1))


def _layout(plan: Plan) -> list[tuple[bytes, int, int]]:
    return [(n.node_id, n.start, n.end) for n in plan.nodes]
