"""Capacity-weighted plans with real processes: proportions, joins and leaves while serving, refusal."""

from __future__ import annotations

import json
import re
import threading

import httpx
import psutil
import pytest

from tests.helpers.llama import GREEDY, PROMPT, api_healthy, complete
from tests.helpers.nodes import cli
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

CHANGE_TIMEOUT_S = 120.0


def plan_json(node) -> dict:
    result = cli("plan", "--home", str(node.home), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def layer_counts(plan: dict) -> dict[str, int]:
    return {n["name"]: n["layers"][1] - n["layers"][0] for n in plan["nodes"]}


def serving_plan(node) -> dict | None:
    return node.status()["serving"]["plan"]


def llama_log(node) -> str:
    return next(p for p in node.status()["processes"] if p["name"] == "llama-server")["log"]


def rpc_rss(node) -> int:
    rpc = next(p for p in node.status()["processes"] if p["name"] == "ggml-rpc-server")
    return psutil.Process(rpc["pid"]).memory_info().rss


def test_layers_follow_max_memory(start_node, reference_text):
    small = start_node("small", "--max-memory", "100M")
    big = start_node("big", "--max-memory", "200M", "--join", small.ticket())
    server = start_node("server", "--max-memory", "200M", "--join", big.ticket(), "--min-peers", "2",
                        serve=True)
    counts = layer_counts(plan_json(server))
    assert set(counts) == {"small", "big", "server"} and sum(counts.values()) == 30
    # Half the memory, about half the layers (one layer of rounding either way).
    assert abs(2 * counts["small"] - counts["big"]) <= 2 and counts["small"] < counts["big"]
    assert layer_counts(serving_plan(server)) == counts
    assert complete(server.serve_port) == reference_text
    # llama-server got the split that produces exactly these counts...
    llama = next(p for p in server.status()["processes"] if p["name"] == "llama-server")
    argv = psutil.Process(llama["pid"]).cmdline()
    split = [int(x) for x in argv[argv.index("--tensor-split") + 1].split(",")]
    assert split[:-1] == [counts[n["name"]] for n in serving_plan(server)["nodes"]][:-1]
    # ...llama-server's log shows each endpoint's weights as planned (--rpc entry i = plan node i)...
    log_text = open(llama_log(server)).read()
    logged = {endpoint: float(mib) for endpoint, mib in
              re.findall(r"RPC\d+\[([^]]+)\] model buffer size =\s+([\d.]+) MiB", log_text)}
    endpoints = argv[argv.index("--rpc") + 1].split(",")
    planned = serving_plan(server)["nodes"]
    assert sorted(logged) == sorted(endpoints) and len(endpoints) == len(planned)
    for endpoint, node in zip(endpoints, planned, strict=True):
        expected_mib = (node["weights_bytes"] + node["output_bytes"]) / 2**20
        assert abs(logged[endpoint] - expected_mib) <= 0.05 * expected_mib, (node["name"], logged, expected_mib)
    # ...and each rpc-server holds memory in the same order as its share of the layers.
    assert rpc_rss(small) < rpc_rss(big)


def test_a_plan_on_one_worker_runs_over_rpc_to_it(start_node, reference_text):
    """The serving node too small for any layer: the plan is the worker alone, and llama-server offloads
    every layer to it over --rpc (it ran alone, loading the whole model on c against its --max-memory)."""
    a = start_node("a")
    c = start_node("c", "--join", a.ticket(), "--min-peers", "1", "--max-memory", "60M", serve=True)
    plan = serving_plan(c)
    assert [n["name"] for n in plan["nodes"]] == ["a"], plan
    llama = next(p for p in c.status()["processes"] if p["name"] == "llama-server")
    argv = psutil.Process(llama["pid"]).cmdline()
    assert "--rpc" in argv and len(argv[argv.index("--rpc") + 1].split(",")) == 1, argv
    assert argv[argv.index("--tensor-split") + 1] == str(plan["n_layers"] + 1)
    # a's rpc-server holds the weights and the head; c keeps only the input embeddings.
    logged = re.findall(r"RPC\d+\[[^]]+\] model buffer size =\s+([\d.]+) MiB", open(llama_log(c)).read())
    expected_mib = (plan["nodes"][0]["weights_bytes"] + plan["nodes"][0]["output_bytes"]) / 2**20
    assert len(logged) == 1 and abs(float(logged[0]) - expected_mib) <= 0.05 * expected_mib, (logged, expected_mib)
    assert complete(c.serve_port) == reference_text


class BackgroundRequests:
    """Short requests, one after another, while a membership change happens.

    Each must get an answer, never a connection error. (Stopped before a
    greedy comparison: llama-server batches concurrent requests together, and
    a different batch shape changes the arithmetic enough to flip a near-tie.)
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> BackgroundRequests:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", timeout=300,
                               json={"prompt": PROMPT, "max_tokens": 8, **GREEDY})
                self.outcomes.append(str(r.status_code))
            except httpx.HTTPError as exc:
                self.outcomes.append(type(exc).__name__)


def test_join_and_leave_while_serving(start_node, reference_text):
    first = start_node("first")
    server = start_node("server", "--join", first.ticket(), "--min-peers", "1", serve=True)
    assert len(serving_plan(server)["nodes"]) == 2

    with BackgroundRequests(server.serve_port) as during_join:
        third = start_node("third", "--join", first.ticket())
        wait_until(lambda: (p := serving_plan(server)) and len(p["nodes"]) == 3, CHANGE_TIMEOUT_S,
                   "the plan grows to three nodes")
    assert complete(server.serve_port) == reference_text
    assert rpc_rss(third) > 10 * 1024 * 1024  # its share of the weights arrived

    with BackgroundRequests(server.serve_port) as during_leave:
        assert third.stop() == 0  # a graceful leave
        wait_until(lambda: (p := serving_plan(server)) and len(p["nodes"]) == 2, CHANGE_TIMEOUT_S,
                   "the plan shrinks back to two nodes")
    assert complete(server.serve_port) == reference_text

    for outcomes in (during_join.outcomes, during_leave.outcomes):
        assert outcomes and set(outcomes) == {"200"}, outcomes
    assert server.status()["serving"]["llama_server_restarts"] >= 2


def test_too_small_mesh_is_refused_clearly_and_recovers(start_node, reference_text):
    server = start_node("tiny", "--max-memory", "60M", serve=True, wait=False)
    wait_until(lambda: "Cannot load the model" in server.text(), 60, "the refusal is printed")
    assert re.search(r"\d+\.\d+ GiB short", server.text()), server.text()

    response = httpx.post(f"http://127.0.0.1:{server.serve_port}/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "insufficient_capacity" and "short" in error["message"]

    refused = cli("plan", "--home", str(server.home))
    assert refused.returncode != 0 and "short" in refused.stderr and "Traceback" not in refused.stderr

    # Capacity arrives: the same node starts serving without a restart of its own.
    start_node("helper", "--join", server.ticket())
    wait_until(lambda: api_healthy(server.serve_port), CHANGE_TIMEOUT_S, "the model loads once capacity arrives")
    assert complete(server.serve_port) == reference_text
