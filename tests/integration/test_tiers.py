"""Model tiers with real processes: a cap picks the smaller tier, a crash steps down and a rejoin
back up, a flapping member moves the API no more than the rules allow."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from benchmarks.synthetic_model import CACHE_TEST, TIER_TEST, SyntheticSpec, ensure_synthetic_model
from mesh_sidecar.llama.model import file_sha256
from tests.helpers.llama import api_healthy
from tests.helpers.nodes import cli, kill_worker, metrics
from tests.helpers.waiting import wait_until

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


# Three nodes with these caps hold the 8-layer tier-test model only all together; two, or the
# serving node alone, hold SmolLM2-135M (the last tier is local: it answers with every worker gone).
WORKER_CAP, SERVING_CAP = "200M", "250M"
FAILOVER_S = 180.0


def answer(port: int, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=FAILOVER_S,
                      json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                            "temperature": 0, **(body or {})})


def answered_by(port: int) -> str:
    response = answer(port)
    assert response.status_code == 200, response.text
    return response.json()["model"]


def switches(port: int, direction: str) -> float:
    return metrics(port).get(f'mesh_model_switches_total{{direction={direction}}}', 0)


@pytest.fixture(scope="module")
def tier_model():
    return ensure_synthetic_model(TIER_TEST)


def tiered_mesh(start_node, small: Path, big: Path, *rules: str):
    a = start_node("a", "--max-memory", WORKER_CAP)
    b = start_node("b", "--max-memory", WORKER_CAP, "--join", a.ticket())
    c = start_node("c", "--model", str(small), "--model", str(big), "--max-memory", SERVING_CAP,
                   "--join", a.ticket(), "--min-peers", "2", *rules, serve=True)
    serving = c.status()["serving"]
    assert serving["plan"]["model"] == big.name and len(serving["plan"]["nodes"]) == 3, serving
    return a, b, c


@pytest.mark.slow
def test_a_crash_steps_down_and_a_rejoin_steps_back_up(start_node, model_path, tier_model, tmp_path):
    small, big = model_path.stem, tier_model.stem
    receipts = tmp_path / "receipts"
    a, b, c = tiered_mesh(start_node, model_path, tier_model, "--step-up-after-s", "5", "--step-up-interval-s", "5",
                          "--receipt", str(receipts))
    assert answered_by(c.serve_port) == big
    listed = httpx.get(f"http://127.0.0.1:{c.serve_port}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["state"]) for m in listed] == [(big, "in_service"), (small, "fits")]

    # A plain request in flight when a worker dies is answered whole by the smaller tier.
    result: dict[str, httpx.Response] = {}
    asker = threading.Thread(target=lambda: result.update(r=answer(c.serve_port, {"max_tokens": 400,
                                                                                  "ignore_eos": True})))
    before = next(p["bytes_to_peer"] for p in c.status()["peers"] if p["name"] == "b")
    asker.start()
    wait_until(lambda: next(p["bytes_to_peer"] for p in c.status()["peers"] if p["name"] == "b") > before + 100_000,
               60, "the request reaches b")
    killed_at = time.monotonic()
    kill_worker(b)
    wait_until(lambda: (c.status()["serving"]["plan"] or {}).get("model") == model_path.name
               and api_healthy(c.serve_port), FAILOVER_S, "the small tier in service")
    step_down_s = time.monotonic() - killed_at
    asker.join(FAILOVER_S)
    assert result["r"].status_code == 200 and result["r"].json()["model"] == small, result["r"].text
    answered_s = time.monotonic() - killed_at
    assert c.status()["serving"]["plan"]["model"] == model_path.name
    assert c.status()["model"]["path"] == str(model_path)
    # The receipt names the model that answered.
    newest = json.loads(max(receipts.iterdir(), key=lambda f: f.stat().st_mtime).read_text())["body"]
    assert newest["model"] == {"name": model_path.name, "id": small, "sha256": file_sha256(model_path)}
    assert switches(c.serve_port, "down") == 1

    listed = httpx.get(f"http://127.0.0.1:{c.serve_port}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["state"]) for m in listed] == [(small, "in_service"), (big, "too_large")]
    assert "GiB short" in listed[1]["why"]
    refused = answer(c.serve_port, {"model": big})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_not_loaded"
    assert "GiB short" in refused.json()["error"]["message"] and repr(small) in refused.json()["error"]["message"]

    rejoined_at = time.monotonic()
    b.restart()
    wait_until(lambda: (c.status()["serving"]["plan"] or {}).get("model") == tier_model.name, FAILOVER_S,
               "the big tier again")
    wait_until(lambda: answered_by(c.serve_port) == big, FAILOVER_S, "answers from the big tier")
    step_up_s = time.monotonic() - rejoined_at
    assert switches(c.serve_port, "up") == 1
    info = metrics(c.serve_port)
    assert info[f"mesh_model_info{{file={tier_model.name},id={big},sha256={file_sha256(tier_model)}}}"] == 1
    print(f"\nstep down after SIGKILL: small tier serving in {step_down_s:.1f} s, the request in flight "
          f"answered (400 tokens) in {answered_s:.1f} s; step up after restart (rule: 5 s): {step_up_s:.1f} s")


@pytest.mark.slow
def test_a_flapping_member_moves_the_api_no_more_than_the_rules_allow(start_node, model_path, tier_model):
    small = model_path.stem
    a, b, c = tiered_mesh(start_node, model_path, tier_model, "--step-up-after-s", "20", "--step-up-interval-s", "60")
    b.stop()  # a graceful leave: the big tier no longer fits
    wait_until(lambda: answered_by(c.serve_port) == small, FAILOVER_S, "the small tier")
    restarts = c.status()["serving"]["llama_server_restarts"]
    ends = time.monotonic() + 60
    cycles = 0
    while time.monotonic() < ends:
        b.restart()
        wait_until(lambda: any(p["name"] == "b" and p["state"] == "connected" for p in c.status()["peers"]),
                   60, "b rejoins")
        time.sleep(5)  # the flapping cadence is this test's input, not a wait for a condition
        b.stop()
        assert answered_by(c.serve_port) == small
        cycles += 1
    # One step down; the big tier never held 20 s, so no step up, and the small tier never restarted.
    assert cycles >= 3
    assert switches(c.serve_port, "down") == 1 and switches(c.serve_port, "up") == 0
    assert c.status()["serving"]["llama_server_restarts"] == restarts


# About 0.50 GiB at the default context: three members offering POOL_CAP each hold it by the planner's
# count, though not by the assignment's conservative one (each worker charged a margin and a layer).
POOL_TEST = SyntheticSpec(name="pool-test", n_layers=32, n_embd=576, n_ff=2048, n_head=9, n_head_kv=3,
                          attn_dtype="F16", ffn_dtype="F16", embd_dtype="F16")
POOL_CAP = "200M"


@pytest.mark.slow
def test_three_capped_members_step_up_to_the_tier_their_whole_pool_holds(start_node, model_path):
    big = ensure_synthetic_model(POOL_TEST)
    a = start_node("a", "--max-memory", POOL_CAP)
    c = start_node("c", "--model", str(model_path), "--model", str(big), "--max-memory", POOL_CAP,
                   "--join", a.ticket(), "--min-peers", "1", "--step-up-after-s", "2", "--step-up-interval-s", "0",
                   serve=True, spread=False)
    # Two members hold only SmolLM2-135M (0.24 GiB).
    assert c.status()["serving"]["plan"]["model"] == model_path.name
    start_node("b", "--max-memory", POOL_CAP, "--join", a.ticket())
    wait_until(lambda: (c.status()["serving"]["plan"] or {}).get("model") == big.name and api_healthy(c.serve_port),
               60, f"the step up to {big.name}")
    plan = c.status()["serving"]["plan"]
    assert sorted(node["name"] for node in plan["nodes"]) == ["a", "b", "c"], plan
    assert switches(c.serve_port, "up") == 1


# Issue 50: F32 embeddings (144 MiB on the serving node's CPU, and a copy as the head on the last device) leave
# a serving node offering 300M no room for the head beside a layer, so three members at 300M hold this 0.52 GiB
# model over the two workers only, while SmolLM2-135M (0.24 GiB) fits the serving node alone.
REACH_TEST = SyntheticSpec(name="reach-test", n_layers=18, n_embd=768, n_ff=1024, n_head=12, n_head_kv=4,
                           attn_dtype="F16", ffn_dtype="F16", embd_dtype="F32")
REACH_CAP = "300M"
STEP_UP_WITHIN_S = 60.0  # the bound, from the last join, under the default step-up rules


def rpc_endpoints(node) -> list[str]:
    """The --rpc list of the node's running llama-server, as its kernel has its argv."""
    llama = next(p for p in node.status()["processes"] if p["name"] == "llama-server")
    argv = psutil.Process(llama["pid"]).cmdline()
    return argv[argv.index("--rpc") + 1].split(",") if "--rpc" in argv else []


@pytest.mark.slow
def test_a_tier_the_small_one_runs_alone_beside_steps_up_over_the_workers_it_needs(start_node, model_path):
    big = ensure_synthetic_model(REACH_TEST)
    a = start_node("a", "--max-memory", REACH_CAP)
    c = start_node("c", "--model", str(big), "--model", str(model_path), "--max-memory", REACH_CAP,
                   "--join", a.ticket(), "--min-peers", "1", serve=True, spread=False)
    # With one worker the big tier does not fit (c cannot hold its head): the small one, alone.
    plan = c.status()["serving"]["plan"]
    assert plan["model"] == model_path.name and [n["name"] for n in plan["nodes"]] == ["c"]
    # ... and the big one is weighed over both members, not over the small tier's (c alone).
    assert [(t["model"], t["fits"], t["offered_bytes"]) for t in plan["tiers"]] == [
        (big.name, False, 2 * 300 * 2**20), (model_path.name, True, 300 * 2**20)]
    b = start_node("b", "--max-memory", REACH_CAP, "--join", a.ticket())
    joined_at = time.monotonic()
    wait_until(lambda: (c.status()["serving"]["plan"] or {}).get("model") == big.name and api_healthy(c.serve_port),
               STEP_UP_WITHIN_S, f"{big.name} in service within a minute of the last join")
    step_up_s = time.monotonic() - joined_at
    assert switches(c.serve_port, "up") == 1

    # One plan: llama-server's --rpc, status, `plan --json` and the members table name a and b.
    status = c.status()
    plan = status["serving"]["plan"]
    assert {n["name"] for n in plan["nodes"]} == {"a", "b"}
    tunnels = {p["name"]: f"127.0.0.1:{p['tunnel_port']}" for p in status["peers"]}
    assert rpc_endpoints(c) == [tunnels[n["name"]] for n in plan["nodes"]]
    assert plan_json(c) == plan
    roles = {role["name"]: role["why"] for role in plan["assignment"]}
    assert roles["a"] == roles["b"] == f"holds layers of {big.stem} for c"
    assert roles["c"].startswith(f"serves {big.stem} with 2 workers, those of its plan, holding no layer itself")

    # A member leaves: down at once, whatever the step-up rules.
    left_at = time.monotonic()
    b.stop()
    wait_until(lambda: (c.status()["serving"]["plan"] or {}).get("model") == model_path.name
               and api_healthy(c.serve_port), FAILOVER_S, "the small tier in service")
    step_down_s = time.monotonic() - left_at
    assert switches(c.serve_port, "down") == 1 and rpc_endpoints(c) == []
    print(f"\nstep up to {big.name} {step_up_s:.1f} s after the last join (default rules: 20 s); "
          f"down to {model_path.name} {step_down_s:.1f} s after a member left")
