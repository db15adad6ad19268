"""Model tiers: the largest model the members hold is chosen, the others reported, none fitting refused."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import PurePath

import httpx
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_sidecar.errors import PlanError
from mesh_sidecar.llama.estimate import ModelEstimate
from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve.assignment import Claim, Offer, assign, pick_workers
from mesh_sidecar.serve.assignment import fits as assignment_fits
from mesh_sidecar.serve.exchange import ServingHooks
from mesh_sidecar.serve.metrics import Metrics
from mesh_sidecar.serve.planner import (
    NodeCapacity,
    Plan,
    TierFit,
    choose_tier,
    model_needs,
    plan_layers,
    tier_needs_bytes,
)
from mesh_sidecar.serve.proxy import ApiProxy, ProxyOptions
from mesh_sidecar.serve.replan import ServingSnapshot, Tier, choose_plan, replan_reason
from mesh_sidecar.serve.step_up import StepUpGate, StepUpRules
from mesh_sidecar.serve.tiers import models_list, tier_claim, tier_views, why_not_served
from tests.helpers.stand_ins import start_stand_in, stream_events
from tests.helpers.waiting import wait_until_async

N_CTX = 4096


def estimate(n_layers: int, layer: int, *, host: int = 0) -> ModelEstimate:
    return ModelEstimate(n_layers, (layer,) * n_layers, host, 0, 0, N_CTX, 0)


def members(*usable: int) -> list[NodeCapacity]:
    return [NodeCapacity(bytes([i]) * 32, f"host{i}", u) for i, u in enumerate(usable)]


def fits(estimate_: ModelEstimate, nodes: list[NodeCapacity]) -> bool:
    *peers, host = nodes
    own = NodeCapacity(host.node_id, host.name, max(0, host.usable_bytes - estimate_.host_bytes))
    try:
        plan_layers([*peers, own], estimate_)
    except PlanError:
        return False
    return True


def test_the_largest_that_fits_is_chosen_and_every_tier_reported():
    tiers = [("small.gguf", estimate(4, 10)), ("big.gguf", estimate(8, 100)), ("mid.gguf", estimate(6, 30))]
    chosen, plan = choose_tier(tiers, members(100, 150))
    assert chosen == 2 and plan.model == "mid.gguf" and plan.n_layers == 6
    assert [(t.model, t.fits) for t in plan.tiers] == [("big.gguf", False), ("mid.gguf", True),
                                                       ("small.gguf", True)]
    assert plan.to_json()["model"] == "mid.gguf"
    big = plan.to_json()["tiers"][0]
    assert {k: big[k] for k in ("model", "needs_bytes", "fits")} == {"model": "big.gguf", "needs_bytes": 800,
                                                                     "fits": False}
    assert "GiB short" in big["why"] and plan.to_json()["tiers"][1]["why"] == ""


def test_a_step_up_not_allowed_yet_keeps_the_smaller_tier():
    tiers = [("small.gguf", estimate(4, 10)), ("big.gguf", estimate(8, 100))]
    assert choose_tier(tiers, members(1000))[1].model == "big.gguf"
    chosen, plan = choose_tier(tiers, members(1000), at_most_bytes=tier_needs_bytes(tiers[0][1]))
    assert chosen == 0 and plan.model == "small.gguf" and [t.fits for t in plan.tiers] == [True, True]
    # When none within the bound fits, the one that does is taken (never a refusal).
    lean = [("wide.gguf", estimate(4, 10, host=900)), ("big.gguf", estimate(8, 100))]
    assert choose_tier(lean, members(850), at_most_bytes=tier_needs_bytes(lean[0][1]))[1].model == "big.gguf"


def test_one_tier_refuses_as_before_and_several_name_the_smallest():
    with pytest.raises(PlanError) as one:
        choose_tier([("big.gguf", estimate(8, 100))], members(100))
    with pytest.raises(PlanError) as before:
        plan_layers(members(100), estimate(8, 100))
    assert str(one.value) == str(before.value)
    with pytest.raises(PlanError, match=r"None of the 2 models .* The smallest, mid.gguf: "):
        choose_tier([("big.gguf", estimate(8, 100)), ("mid.gguf", estimate(6, 30))], members(50))


def test_the_serving_host_pays_each_tiers_input_embeddings():
    # Same blocks, but the second tier's embeddings leave too little on the only node.
    tiers = [("lean.gguf", estimate(4, 10, host=0)), ("wide.gguf", estimate(4, 10, host=30))]
    chosen, plan = choose_tier(tiers, members(45))
    assert plan.model == "lean.gguf" and [t.fits for t in plan.tiers] == [False, True]


sizes = st.lists(st.tuples(st.integers(1, 8), st.integers(1, 50), st.integers(0, 40)), min_size=1, max_size=4)
usables = st.lists(st.integers(0, 400), min_size=1, max_size=4)


@given(sizes, usables)
def test_choice_is_the_largest_fitting_tier(specs, usable):
    tiers = [(f"m{i}.gguf", estimate(n, layer, host=host)) for i, (n, layer, host) in enumerate(specs)]
    nodes = members(*usable)
    fitting = [i for i, (_, e) in enumerate(tiers) if fits(e, nodes)]
    if not fitting:
        with pytest.raises(PlanError):
            choose_tier(tiers, nodes)
        return
    chosen, plan = choose_tier(tiers, nodes)
    assert chosen in fitting
    assert tier_needs_bytes(tiers[chosen][1]) == max(tier_needs_bytes(tiers[i][1]) for i in fitting)
    # Every tier reported once, largest first, with whether it fits.
    assert sorted(t.model for t in plan.tiers) == sorted(name for name, _ in tiers)
    needs = [t.needs_bytes for t in plan.tiers]
    assert needs == sorted(needs, reverse=True)
    assert {t.model for t in plan.tiers if t.fits} == {tiers[i][0] for i in fitting}


# --- when to step up -----------------------------------------------------------------------

def fits_at(gate: StepUpGate, now: float) -> tuple[StepUpGate, float]:
    """The gate after a bigger tier is seen fitting at ``now``, and the seconds until it may be switched to."""
    gate = gate.bigger_fits(now)
    return gate, max(0.0, gate.ready_at(now) - now)


def test_a_step_up_waits_until_the_bigger_tier_has_fitted_long_enough():
    gate = StepUpGate(StepUpRules(after_s=20, interval_s=60))
    gate, wait = fits_at(gate, 100.0)
    assert wait == 20
    assert gate.ready_at(110.0) == 120  # asking changes nothing
    assert fits_at(gate, 110.0)[1] == 10
    gate, wait = fits_at(gate, 120.0)
    assert wait == 0
    gate = gate.switched(120.0)
    # Right after a switch the interval rules, however long the bigger tier fits.
    gate, wait = fits_at(gate, 125.0)
    assert wait == 55
    assert fits_at(gate, 185.0)[1] == 0


def test_a_flapping_member_never_opens_the_gate():
    gate = StepUpGate(StepUpRules(after_s=20, interval_s=0))
    for t in range(0, 60, 10):  # fits for 5 s, then gone for 5 s
        gate, wait = fits_at(gate, float(t))
        assert wait > 0
        gate, wait = fits_at(gate, t + 4.9)
        assert wait > 0
        gate = gate.bigger_gone()


# Whole seconds: the rule, not float rounding, is under test.
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans()), max_size=40), st.integers(0, 30), st.integers(0, 90))
def test_the_gate_opens_only_after_an_unbroken_run_and_the_interval(steps, after_s, interval_s):
    gate = StepUpGate(StepUpRules(after_s, interval_s))
    now, since, last_switch = 0.0, None, None
    for dt, fits in steps:
        now += dt
        if not fits:
            gate = gate.bigger_gone()
            since = None
            continue
        since = now if since is None else since
        gate, wait = fits_at(gate, now)
        allowed = now - since >= after_s and (last_switch is None or now - last_switch >= interval_s)
        assert (wait == 0) == allowed
        if wait == 0:
            gate = gate.switched(now)
            since, last_switch = None, now


# --- what clients see ------------------------------------------------------------------------

GIB = 1 << 30
FITS_NOW = (TierFit("big-q8.gguf", 3 * GIB, False, "The mesh has 2.00 GiB free ... (1.00 GiB short)."),
            TierFit("small.gguf", GIB, True))


def test_models_lists_the_tier_in_service_first_with_every_state():
    listed = models_list(tier_views(FITS_NOW, "small.gguf"), created=7)
    assert listed["object"] == "list"
    assert [(m["id"], m["state"]) for m in listed["data"]] == [("small", "in_service"), ("big-q8", "too_large")]
    assert listed["data"][1]["why"].endswith("(1.00 GiB short).") and "why" not in listed["data"][0]
    assert all(m["object"] == "model" and m["owned_by"] == "mesh-inference" for m in listed["data"])


def test_a_request_naming_a_tier_not_in_service_is_told_why():
    views = tier_views(FITS_NOW, "small.gguf")
    for fine in ("", "default", "small", "small.gguf", "gpt-4o"):
        assert why_not_served(fine, views) is None
    why = why_not_served("big-q8", views)
    assert "'big-q8' is not loaded" in why and "1.00 GiB short" in why and "'small'" in why
    # A bigger tier that fits but waits for the step-up rules.
    waiting = tier_views((dataclasses.replace(FITS_NOW[0], fits=True, why=""), FITS_NOW[1]), "small.gguf")
    assert "once it has fitted for a while" in why_not_served("big-q8.gguf", waiting)


async def stand_in(model: str, pieces: list[str], stall_after: int | None = None,
                   asked: list[str] | None = None) -> tuple[web.AppRunner, str]:
    """A stand-in llama-server answering with ``model``. With ``stall_after`` (the fault a dead worker
    causes) it stops sending after that many pieces of a stream and never answers a plain request."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if asked is not None:
            asked.append("stream" if body.get("stream") else "plain")
        if not body.get("stream"):
            if stall_after is not None:
                await asyncio.sleep(3600)
            return web.json_response({"model": model, "choices": [{"message": {"content": "".join(pieces)}}]})
        chunks = [{"model": model, "choices": [{"index": 0, "delta": {"content": piece}}]} for piece in pieces]
        return await stream_events(request, [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks],
                                   stall_after)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return await start_stand_in(app)


@pytest.fixture
async def tier_proxy():
    stalls: list[str] = []
    views = [tier_views(FITS_NOW, "small.gguf")]
    proxy = ApiProxy(Metrics(lambda: ()), ProxyOptions(stall_timeout_s=0.5),
                     ServingHooks(on_stall=stalls.append, catalog=lambda: views[0]))
    port = free_tcp_port()
    await proxy.start(port)
    yield proxy, f"http://127.0.0.1:{port}", stalls
    await proxy.close()


async def test_the_proxy_answers_models_and_refuses_a_tier_not_in_service(tier_proxy):
    proxy, url, _ = tier_proxy
    runner, upstream_url = await stand_in("small", ["Hi"])
    proxy.serve(upstream_url, "small")
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            models = (await client.get(url + "/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["small", "big-q8"]
            refused = await client.post(url + "/v1/chat/completions", json={"model": "big-q8", "messages": []})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_not_loaded"
            assert "1.00 GiB short" in refused.json()["error"]["message"]
            served = await client.post(url + "/v1/chat/completions", json={"model": "default", "messages": []})
            assert served.status_code == 200 and served.json()["model"] == "small"
    finally:
        await runner.cleanup()


async def test_a_stream_cut_by_a_step_down_ends_with_an_error_a_plain_request_is_answered_whole(tier_proxy):
    proxy, url, stalls = tier_proxy
    asked: list[str] = []
    big, big_url = await stand_in("big-q8", ["The", " keeper", " lit"], stall_after=2, asked=asked)
    small, small_url = await stand_in("small", ["A", " lamp"])
    proxy.serve(big_url, "big-q8")

    async def step_down_when_stalled() -> None:
        await wait_until_async(lambda: stalls, 10, "the proxy to see the stream stall")
        proxy.serve(small_url, "small")  # what the serving loop does after a step down

    switcher = asyncio.create_task(step_down_when_stalled())
    try:
        events = []
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", url + "/v1/chat/completions",
                                     json={"messages": [], "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
            await switcher
            # The text already sent came from big-q8; none of the small model's is appended.
            text = "".join(e["choices"][0]["delta"]["content"] for e in events if "choices" in e)
            assert text == "The keeper"
            assert events[-1]["error"]["code"] == "model_switched"
            message = events[-1]["error"]["message"]
            assert "'small'" in message and "Send the request again" in message
            # A plain request cut by the same switch (llama-server dies under it) is answered whole by the next.
            proxy.serve(big_url, "big-q8")
            plain = asyncio.create_task(client.post(url + "/v1/chat/completions", json={"messages": []}))
            await wait_until_async(lambda: "plain" in asked, 10, "the plain request to reach big-q8")
            proxy.serve(small_url, "small")
            await big.cleanup()
            answer = (await plain).json()
            assert answer["model"] == "small" and answer["choices"][0]["message"]["content"] == "A lamp"
    finally:
        switcher.cancel()
        await big.cleanup()
        await small.cleanup()


# --- which tier a serving node claims workers for ------------------------------------------------

def margined(n_layers: int, layer: int, margin: int, *, host: int = 0, output: int = 0) -> ModelEstimate:
    return ModelEstimate(n_layers, (layer,) * n_layers, host, output, 0, N_CTX, margin)


# Members offering 40 each: every participant holds 3 layers of 10 beside its margin of 10, so BIG
# (9 layers) takes all three by the planner's count, though the assignment's conservative count
# (a margin and a layer more per worker) says the three fall short; SMALL takes the node and one worker.
POOL_SMALL = ("small.gguf", margined(4, 10, 10))
POOL_BIG = ("big.gguf", margined(9, 10, 10))
POOL_TIERS = [POOL_SMALL, POOL_BIG]

# Issue 50's shape, members offering 60 each: SMALL fits the serving node alone; REACH's input embeddings
# (30, on the serving node) leave it no room for the head (30) beside a layer and a margin, so the planner
# leaves it out and REACH needs two workers, where the assignment's count of bytes says one.
REACH_SMALL = ("small.gguf", margined(4, 2, 5, host=5, output=5))
REACH = ("reach.gguf", margined(20, 2, 5, host=30, output=30))
REACH_TIERS = [REACH, REACH_SMALL]


def offer(index: int, usable: int, *, serving: bool = False) -> Offer:
    return Offer(bytes([index]) * 32, f"m{index}", usable, serving=serving)


def over(own: Offer) -> Callable[[Sequence[Offer]], list[NodeCapacity]]:
    """What the planner plans over with some workers: them by id, ``own`` last (as planning_members)."""
    def members_of(workers: Sequence[Offer]) -> list[NodeCapacity]:
        ordered = [*sorted(workers, key=lambda o: o.node_id), own]
        return [NodeCapacity(o.node_id, o.name, o.usable_bytes) for o in ordered]

    return members_of


def test_a_tier_only_the_whole_pool_holds_is_claimed_with_the_whole_pool():
    own, pool = offer(9, 40, serving=True), (offer(1, 40), offer(2, 40))
    big_needs = model_needs("big", POOL_BIG[1])
    assert not assignment_fits(own.usable_bytes, [o.usable_bytes for o in pool], big_needs)
    claimed = tier_claim(POOL_TIERS, own, pool, over(own))
    assert POOL_TIERS[claimed.index] is POOL_BIG and claimed.workers == pool
    assert choose_tier(POOL_TIERS, over(own)(claimed.workers))[1].model == "big.gguf"
    # The cause of issue 41 (6): over the workers of the small tier alone, the big one never fits.
    small_workers = pick_workers(own, pool, model_needs("small", POOL_SMALL[1]), False)
    assert len(small_workers) == 1
    assert choose_tier(POOL_TIERS, over(own)(small_workers))[1].model == "small.gguf"


def test_a_tier_the_small_one_runs_alone_beside_is_claimed_with_the_workers_the_planner_needs():
    own, a, b = offer(9, 60, serving=True), offer(1, 60), offer(2, 60)
    # The cause of issue 50 (1): the count of bytes gives REACH one worker, over which the planner fails,
    # so the small tier, alone, was claimed however many members joined.
    one = pick_workers(own, (a, b), model_needs("reach", REACH[1]), False)
    assert len(one) == 1 and not fits(REACH[1], over(own)(one))
    claimed = tier_claim(REACH_TIERS, own, (a, b), over(own))
    assert REACH_TIERS[claimed.index] is REACH and claimed.workers == (a, b)
    plan = choose_tier(REACH_TIERS, over(own)(claimed.workers))[1]
    assert plan.model == "reach.gguf" and [n.name for n in plan.nodes] == ["m1", "m2"]  # the node holds no layer
    assert [(t.model, t.fits, t.offered_bytes) for t in claimed.fits] == [("reach.gguf", True, 180),
                                                                          ("small.gguf", True, 60)]
    # One worker short: the small tier alone, REACH weighed (and refused) over the whole pool.
    claimed = tier_claim(REACH_TIERS, own, (a,), over(own))
    assert REACH_TIERS[claimed.index] is REACH_SMALL and claimed.workers == ()
    assert [(t.fits, t.offered_bytes) for t in claimed.fits] == [(False, 120), (True, 60)]
    assert "short" in claimed.fits[0].why


def test_the_claim_is_the_fewest_workers_and_the_assignment_gives_it_its_plans():
    own, pool = offer(9, 40, serving=True), tuple(offer(i, 40) for i in range(1, 5))
    claimed = tier_claim(POOL_TIERS, own, pool, over(own), by_speed=True)
    # The planner's count: the node and two workers hold 9 layers, 3 each (the count of bytes said three).
    assert POOL_TIERS[claimed.index] is POOL_BIG and len(claimed.workers) == 2
    plan = choose_tier(POOL_TIERS, over(own)(claimed.workers))[1]
    assert len(plan.nodes) == 3
    # Every member gives the claim the plan's members, as its gossip announces them.
    claims = [Claim(own.node_id, 0.0, model_needs("big", POOL_BIG[1]), members=plan.rpc_nodes())]
    assert set(assign(claims, [*pool, own]).workers_of(own.node_id)) == {o.node_id for o in claimed.workers}
    # --spread: every free worker.
    assert tier_claim(POOL_TIERS, own, pool, over(own), spread=True).workers == pool


def test_with_no_tier_fitting_the_smallest_is_claimed_over_the_whole_pool():
    own, pool = offer(9, 20, serving=True), (offer(1, 20),)
    claimed = tier_claim(POOL_TIERS, own, pool, over(own))
    assert (claimed.index, claimed.workers) == (0, pool)
    assert [t.fits for t in claimed.fits] == [False, False]


def test_the_step_up_rules_apply_once_the_pool_holds_the_bigger_tier():
    own, a, b = offer(9, 40, serving=True), offer(1, 40), offer(2, 40)
    tiers = tuple(Tier(PurePath(f"/models/{name}"), estimate_) for name, estimate_ in POOL_TIERS)

    def snapshot(pool: tuple[Offer, ...], now: float, plan: Plan | None, in_service: int | None) -> ServingSnapshot:
        members_ = over(own)(tier_claim(POOL_TIERS, own, pool, over(own)).workers)
        return ServingSnapshot(now, tuple(members_), (), tiers, in_service, plan)

    rules = StepUpRules(after_s=2, interval_s=0)
    choice = choose_plan(snapshot((a,), 0.0, None, None), StepUpGate(rules))
    assert choice.tier == 0 and len(choice.plan.nodes) == 2  # the node and one worker hold only the small tier
    replan, look = replan_reason(snapshot((a, b), 10.0, choice.plan, 0), choice.step_up.gate)
    assert replan is None and look is not None and look.waiting == "big.gguf"  # b joined: the wait starts
    assert look.ready_at == 12.0
    replan, look = replan_reason(snapshot((a, b), 12.0, choice.plan, 0), look.gate)
    assert replan is not None and "stepping up" in replan.reason and look is not None
    after = choose_plan(snapshot((a, b), 12.0, choice.plan, 0), look.gate)
    assert after.tier == 1 and after.switch == "up" and len(after.plan.nodes) == 3


# --- the serving loop over a pool that changes -------------------------------------------------------

MID = ("mid.gguf", margined(10, 4, 5, host=10, output=10))
LOOP_TIERS = [REACH_SMALL, REACH, MID]


def largest_held(tiers: Sequence[tuple[str, ModelEstimate]], own: Offer, pool: Sequence[Offer]) -> int | None:
    """The largest tier the planner holds over the serving node and every worker of ``pool``."""
    held = [i for i, (_, e) in enumerate(tiers) if fits(e, over(own)(pool))]
    return max(held, key=lambda i: tier_needs_bytes(tiers[i][1])) if held else None


@dataclasses.dataclass
class ServingLoop:
    """The serving loop's decisions (supervisor.py) over made-up pools: tier_claim, replan_reason, choose_plan."""

    tiers: Sequence[tuple[str, ModelEstimate]]
    own: Offer
    rules: StepUpRules
    pool: list[Offer] = dataclasses.field(default_factory=list)
    plan: Plan | None = None
    in_service: int | None = None
    switches: list[tuple[float, str]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.gate = StepUpGate(self.rules)

    def snapshot(self, now: float) -> ServingSnapshot:
        claimed = tier_claim(self.tiers, self.own, self.pool, over(self.own))
        tiers = tuple(Tier(PurePath(f"/models/{name}"), e) for name, e in self.tiers)
        unplanned = frozenset(o.node_id for o in self.pool) - {o.node_id for o in claimed.workers}
        return ServingSnapshot(now, tuple(over(self.own)(claimed.workers)), (), tiers, self.in_service, self.plan,
                               unplanned=unplanned)

    def look(self, now: float) -> None:
        """What the loop does at ``now`` (a member joined or left, or a step up's wait ended): replan while
        there is a reason, looking again after each plan applied or refused, as run() and _trouble() do."""
        if self.plan is None and self.in_service is None:
            self.apply(now)  # run()'s first plan comes before any look for trouble
        for _ in range(3):
            replan, look = replan_reason(self.snapshot(now), self.gate)
            if look is not None:
                self.gate = look.gate
            if replan is None:
                return
            self.apply(now)
        raise AssertionError("the loop keeps replanning")

    def apply(self, now: float) -> None:
        """_apply_plan: a plan and its tier, or none (the API refuses)."""
        try:
            choice = choose_plan(self.snapshot(now), self.gate)
        except PlanError:
            self.plan = None
            return
        self.gate = choice.step_up.gate
        if choice.switch is not None:
            self.gate = self.gate.switched(now)
            self.switches.append((now, choice.switch))
        self.plan, self.in_service = choice.plan, choice.tier


def needs(tiers: Sequence[tuple[str, ModelEstimate]], index: int) -> int:
    return tier_needs_bytes(tiers[index][1])


@pytest.mark.parametrize(("tiers", "own_usable", "before", "joiner"), [
    (REACH_TIERS, 60, [60], 60),  # the small tier alone; the big one needs both workers
    (POOL_TIERS, 40, [40, 15], 40),  # the small tier on one worker of two (the other too small to help)
    (POOL_TIERS, 40, [40], 40),  # the small tier on every worker
], ids=["alone", "some workers", "all workers"])
def test_the_bigger_tier_is_claimed_once_the_pool_holds_it_wherever_the_smaller_runs(tiers, own_usable, before,
                                                                                      joiner):
    loop = ServingLoop(tiers, offer(99, own_usable, serving=True), StepUpRules(after_s=20, interval_s=60))
    loop.pool = [offer(i + 1, usable) for i, usable in enumerate(before)]
    loop.look(0.0)
    small = loop.in_service
    assert small is not None and loop.plan is not None and loop.plan.model == tiers[small][0]
    loop.pool.append(offer(50, joiner))
    loop.look(100.0)  # the last join: the wait starts
    assert loop.in_service == small and loop.switches == []
    loop.look(119.9)
    assert loop.in_service == small
    loop.look(120.0)
    assert loop.in_service != small and needs(tiers, loop.in_service) > needs(tiers, small)
    assert loop.switches == [(120.0, "up")]
    loop.pool.pop()  # a member of the big tier's plan leaves: down at once, whatever the rules
    loop.look(121.0)
    assert loop.in_service == small and loop.switches[-1] == (121.0, "down")


# A step: seconds since the last, then a worker joining (its offer), leaving (which one), or nothing.
steps = st.lists(st.tuples(st.integers(0, 30), st.one_of(st.tuples(st.just("join"), st.integers(0, 16)),
                                                       st.tuples(st.just("leave"), st.integers(0, 7)),
                                                       st.just(("tick", 0)))), max_size=25)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 16), steps, st.integers(0, 30), st.integers(0, 90))
def test_tiers_follow_the_whole_pool_as_members_join_and_leave(own_fives, steps, after_s, interval_s):
    """Each tier weighed over the whole pool, however the tier in service runs; up only once the bigger tier
    has fitted ``after_s`` without a break and the interval has passed, and then at once; down at once."""
    tiers = LOOP_TIERS
    loop = ServingLoop(tiers, offer(99, 5 * own_fives, serving=True), StepUpRules(after_s, interval_s))
    now, bigger_since, last_switch = 0.0, None, None
    for joined, (dt, (action, value)) in enumerate(steps):
        now += dt
        if action == "join":
            loop.pool.append(offer(joined + 1, 5 * value))
        elif action == "leave" and loop.pool:
            loop.pool.pop(value % len(loop.pool))
        largest = largest_held(tiers, loop.own, loop.pool)
        claimed = tier_claim(tiers, loop.own, loop.pool, over(loop.own))
        if largest is None:
            assert claimed.index == min(range(len(tiers)), key=lambda i: needs(tiers, i))
            assert set(claimed.workers) == set(loop.pool)
        else:
            # The largest tier the whole pool holds, over the fewest workers (largest first) the planner needs.
            assert claimed.index == largest
            k = len(claimed.workers)
            ordered = sorted(loop.pool, key=lambda o: (-o.usable_bytes, o.node_id))
            assert list(claimed.workers) == ordered[:k]
            assert fits(tiers[largest][1], over(loop.own)(ordered[:k]))
            assert k == 0 or not fits(tiers[largest][1], over(loop.own)(ordered[:k - 1]))
        bigger = (largest is not None and loop.in_service is not None
                  and needs(tiers, largest) > needs(tiers, loop.in_service))
        bigger_since = (bigger_since if bigger_since is not None else now) if bigger else None
        may_step_up = (bigger_since is not None and now - bigger_since >= after_s
                       and (last_switch is None or now - last_switch >= interval_s))
        switched = len(loop.switches)
        loop.look(now)
        if largest is None:
            assert loop.plan is None
            continue
        assert loop.plan is not None and loop.in_service is not None
        # Never a tier the pool no longer holds: down at once.
        assert needs(tiers, loop.in_service) <= needs(tiers, largest)
        if len(loop.switches) > switched:
            when, direction = loop.switches[-1]
            assert when == now
            if direction == "up":
                assert may_step_up
            bigger_since, last_switch = None, now
        elif may_step_up:
            raise AssertionError(f"no step up at {now}: the bigger tier fitted since {bigger_since}")
        if loop.in_service == largest:
            bigger_since = None
