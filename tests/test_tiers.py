"""Model tiers: the largest model the members hold is chosen, the others reported, none fitting refused."""

from __future__ import annotations

import json

import httpx
import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.synthetic_model import CACHE_TEST, ensure_synthetic_model
from mesh_sidecar.errors import PlanError
from mesh_sidecar.llama.estimate import ModelEstimate
from mesh_sidecar.llama.model import file_sha256
from mesh_sidecar.serve.planner import NodeCapacity, choose_tier, plan_layers, tier_needs_bytes
from tests.conftest import cli

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
    assert plan.to_json()["tiers"][0] == {"model": "big.gguf", "needs_bytes": 800, "fits": False}


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


# --- with real processes ---------------------------------------------------------------------

# Enough for SmolLM2-135M at the default context, far too little for the 342 MB synthetic model.
SMALL_CAP = "300M"


def plan_json(node) -> dict:
    result = cli("plan", "--home", str(node.home), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def chat(port: int) -> str:
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                             "temperature": 0})
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def big_model():
    return ensure_synthetic_model(CACHE_TEST)


@pytest.mark.slow
def test_a_capped_node_serves_the_smaller_tier(start_node, model_path, big_model):
    node = start_node("tiers", "--model", str(big_model), "--model", str(model_path), "--max-memory", SMALL_CAP,
                      serve=True)
    plan = plan_json(node)
    assert plan["model"] == model_path.name
    assert [(t["model"], t["fits"]) for t in plan["tiers"]] == [(big_model.name, False), (model_path.name, True)]
    serving = node.status()["serving"]
    assert serving["model"] == str(model_path) and serving["plan"]["model"] == model_path.name
    assert chat(node.serve_port)
    # Gossip announces the file in service, so workers holding it are not refused.
    assert node.status()["mesh"]["model_sha256"] == file_sha256(model_path)


@pytest.mark.slow
def test_without_a_cap_the_bigger_tier_is_chosen(start_node, model_path, big_model):
    # The synthetic model answers nonsense: check the plan and that llama-server loaded it.
    node = start_node("tiers", "--model", str(model_path), "--model", str(big_model), serve=True)
    plan = plan_json(node)
    assert plan["model"] == big_model.name
    assert [t["fits"] for t in plan["tiers"]] == [True, True]
    assert node.status()["serving"]["plan"]["model"] == big_model.name
    llama = next(p for p in node.status()["processes"] if p["name"] == "llama-server")
    argv = psutil.Process(llama["pid"]).cmdline()
    assert argv[argv.index("-m") + 1] == str(big_model)
    assert node.status()["mesh"]["model_sha256"] == file_sha256(big_model)


def test_a_bad_extra_model_is_named(tmp_path, model_path):
    missing = tmp_path / "missing.gguf"
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    for bad, says in ((missing, "does not exist"), (not_gguf, "is not a GGUF model")):
        result = cli("--home", str(tmp_path / "home"), "--serve", "1", "--model", str(model_path),
                     "--model", str(bad))
        assert result.returncode != 0 and str(bad) in result.stderr and says in result.stderr, result.stderr
    result = cli("--home", str(tmp_path / "home"), "--model", str(model_path), "--model", str(model_path))
    assert result.returncode != 0 and "serving node only" in result.stderr, result.stderr
