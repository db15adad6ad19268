"""Plans by speed with real processes: a worker's rpc-server slowed for real by a CPU quota.

The slow worker's rpc-server runs in a cgroup of its own (tests/helpers/cpu_quota.py) from its
start, so its node's calibration measures it slowed; or it is slowed mid-serving, and only the
traffic shows it. The serving nodes split with --spread (start_node's default): every member
takes part, with layers by speed.
"""

from __future__ import annotations

import re
import threading

import pytest

from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve.speeds import MIN_REQUESTS
from tests.helpers.cpu_quota import CpuQuota, cgroup_cpu_available, quota_rpc_build
from tests.helpers.llama import complete, plain_llama_server_answer, start_bare_rpc_server
from tests.helpers.nodes import NodeProcess
from tests.helpers.waiting import wait_until
from tests.integration.test_failover import LONG, receive

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cgroup_cpu_available(), reason="needs a writable cgroup v1 cpu controller")]

SLOW_CORES = 0.25  # a quarter of one core: several times slower than the others at calibration
# Slowed mid-serving: the traffic shows it diluted by the link (serve/speeds.py), so b is slowed far enough
# that the speed plan gains clearly more than SPEED_REPLAN_GAIN (a tenth of a core showed 4x and 18%).
SLOWER_CORES = 0.05
REPLAN_TIMEOUT_S = 240.0
SPEED_REPLAN = "Speeds changed"
REQUEST = {**LONG, "max_tokens": 80}  # a few seconds a request, each one a measurement of the workers


def plan_nodes(node: NodeProcess) -> dict[str, dict]:
    plan = node.status()["serving"]["plan"]
    return {} if plan is None else {n["name"]: n for n in plan["nodes"]}


def layers(node: dict) -> int:
    return node["layers"][1] - node["layers"][0]


def test_a_slow_worker_is_measured_slow_and_given_fewer_layers(start_node, binaries, model_path, tmp_path):
    with CpuQuota("mesh-speed-plan") as group:
        group.limit(SLOW_CORES)
        slow = start_node("slow", "--llama-bin", str(quota_rpc_build(binaries, tmp_path / "slow-build", group)))
        start_node("quick", "--join", slow.ticket())
        server = start_node("server", "--join", slow.ticket(), "--min-peers", "2", serve=True)
        nodes = wait_until(lambda: (n := plan_nodes(server)) and len(n) == 3 and n, 120, "a plan over all three")
        # The calibration ranks the devices right, and the plan follows it.
        assert nodes["slow"]["decode_bytes_per_s"] * 2 < nodes["quick"]["decode_bytes_per_s"]
        assert layers(nodes["slow"]) < layers(nodes["quick"])
        assert server.status()["serving"]["plan"]["by"] == "speed"
        assert "Planned by speed" in server.text() or "by speed" in server.text()
        mesh_text = complete(server.serve_port)
        split = server.status()["serving"]["plan"]["tensor_split"]

    # llama.cpp's own --rpc over TCP, the same split over three bare rpc-servers: the same greedy text.
    ports = [free_tcp_port() for _ in range(3)]
    rpc = [start_bare_rpc_server(binaries, port, tmp_path / f"rpc{port}.log") for port in ports]
    try:
        endpoints = ",".join(f"127.0.0.1:{port}" for port in ports)
        direct_text = plain_llama_server_answer(
            binaries, model_path, tmp_path, complete,
            args=["--rpc", endpoints, "-ngl", "99", "--tensor-split", ",".join(map(str, split))])
    finally:
        for proc in rpc:
            proc.kill()
            proc.wait()
    assert mesh_text == direct_text


def test_a_worker_that_becomes_slow_while_serving_is_replanned_once(start_node, binaries, tmp_path):
    with CpuQuota("mesh-speed-replan") as group:
        a = start_node("a")
        start_node("b", "--join", a.ticket(), "--llama-bin",
                       str(quota_rpc_build(binaries, tmp_path / "b-build", group)))
        c = start_node("c", "--join", a.ticket(), "--min-peers", "2", serve=True)
        wait_until(lambda: len(plan_nodes(c)) == 3, 120, "a plan over all three")
        before = plan_nodes(c)
        assert c.status()["serving"]["plan"]["by"] == "memory"  # the same speeds: the memory plan
        for _ in range(MIN_REQUESTS):  # undisturbed: the workers' baselines
            receive(c.serve_port, "/v1/completions", REQUEST)

        # b's rpc-server becomes slow in the middle of a stream: the stream completes.
        slowed = threading.Event()

        def slow_down_midway(received) -> None:
            if not slowed.is_set() and len(received.text()) > 100:
                group.limit(SLOWER_CORES)
                slowed.set()

        streamed = receive(c.serve_port, "/v1/completions", REQUEST, slow_down_midway)
        assert slowed.is_set() and streamed.events[-1]["choices"][0]["finish_reason"] == "length"

        def replanned() -> bool:
            if SPEED_REPLAN not in c.text():
                receive(c.serve_port, "/v1/completions", REQUEST)  # each request is a measurement
                return False
            return True

        try:
            wait_until(replanned, REPLAN_TIMEOUT_S, "a replan for speed")
        except TimeoutError as error:
            raise AssertionError(f"{error}; slowdowns seen: {c.status()['serving']['slowdowns']}") from None
        # The old plan serves until the drain ends: the new one is the one with fewer layers on b.
        wait_until(lambda: (n := plan_nodes(c)) and len(n) == 3 and layers(n["b"]) < layers(before["b"]), 120,
                   "the new plan, b with fewer layers, in service")
        assert c.status()["serving"]["plan"]["by"] == "speed"
        # The new plan serves, and no second replan for speed follows at once.
        assert receive(c.serve_port, "/v1/completions", REQUEST).events[-1]["choices"][0]["finish_reason"] == "length"
        assert len(re.findall(SPEED_REPLAN, c.text())) == 1

