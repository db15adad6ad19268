"""Plans by speed with real processes: a worker's rpc-server slowed for real by a CPU quota.

The slow worker's rpc-server runs in a cgroup of its own (tests/helpers/cpu_quota.py) from its
start, so its node's calibrations measure it slowed; or only its first calibration is, and the
plan must not weigh it apart on that one sample; or it is slowed mid-serving, and only the
traffic shows it. The serving nodes split with --spread (start_node's default): every member
takes part, with layers by speed.
"""

from __future__ import annotations

import re
import threading

import pytest

from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve.assignment import SAME_SPEED_RATIO
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
SETTLE_TIMEOUT_S = 90.0
# Busy at its first calibration only: slow enough to be weighed apart on that sample (SAME_SPEED_RATIO), not so slow
# that the calibration's prefill part outlasts its timeout on a loaded machine (a quarter core did, here).
BUSY_CORES = 0.4  # calibrations 5, 10, 20 s apart until two agree (llama/calibration.py)


def plan_nodes(node: NodeProcess) -> dict[str, dict]:
    plan = node.status()["serving"]["plan"]
    return {} if plan is None else {n["name"]: n for n in plan["nodes"]}


def layers(node: dict) -> int:
    return node["layers"][1] - node["layers"][0]


def device(node: NodeProcess) -> dict:
    """The node's one device (its CPU), as `status` shows it: its speed rated now, and whether it is settled."""
    return node.status()["node"]["devices"][0]


def first_measured(node: NodeProcess) -> float:
    """The node's first calibration, in GiB/s, as it said when it started."""
    match = re.search(r"Measured CPU: ([\d.]+) GiB/s", node.text())
    assert match, node.text()
    return float(match.group(1))


def settled_speed(node: NodeProcess) -> float:
    """The node's speed once two of its calibrations agree (it measures again while its rpc-server is idle)."""
    return wait_until(lambda: (d := device(node))["speed_settled"] and d["decode_bytes_per_s"], SETTLE_TIMEOUT_S,
                      f"{node.home.name}'s speed settled")


def test_a_slow_worker_is_measured_slow_and_given_fewer_layers(start_node, binaries, model_path, tmp_path):
    with CpuQuota("mesh-speed-plan") as group:
        group.limit(SLOW_CORES)
        slow = start_node("slow", "--llama-bin", str(quota_rpc_build(binaries, tmp_path / "slow-build", group)))
        start_node("quick", "--join", slow.ticket())
        # One calibration weighs no one below another: the plan by speed waits for the slow worker's speed to
        # settle (once a llama-server holds an rpc-server it is not measured again). quick, the fastest, counts.
        settled_speed(slow)
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


def test_two_identical_members_are_planned_alike_when_one_was_busy_at_its_first_calibration(
        start_node, binaries, tmp_path):
    """Issue 50 (3): identical members measured 2.7 and 14.7 GiB/s, one while its machine was busy."""
    with CpuQuota("mesh-speed-busy") as group:
        group.limit(BUSY_CORES)
        a = start_node("a")
        b = start_node("b", "--join", a.ticket(), "--llama-bin",
                       str(quota_rpc_build(binaries, tmp_path / "b-build", group)))
        group.limit(None)  # b's machine is as idle as a's from now on (before b measures again, 5 s on)
        first = {node.home.name: first_measured(node) for node in (a, b)}
        assert first["b"] * SAME_SPEED_RATIO < first["a"]  # the quota showed in b's first calibration
        c = start_node("c", "--join", a.ticket(), "--min-peers", "2", serve=True)
        nodes = wait_until(lambda: (n := plan_nodes(c)) and len(n) == 3 and n, 120, "a plan over all three")
        assert abs(layers(nodes["a"]) - layers(nodes["b"])) <= 1, nodes
        planned = {name: (node["decode_bytes_per_s"], node["speed_settled"]) for name, node in nodes.items()}
        complete(c.serve_port)
    # Without c's llama-server, b's rpc-server is idle again: measured until two calibrations agree (a's may take
    # minutes on a loaded machine: its best sample stays until two others come within 1.25x of it).
    c.stop()
    settled = {"b": settled_speed(b), "a": device(a)["decode_bytes_per_s"]}
    print(f"first calibration (GiB/s): a {first['a']:.2f}, b {first['b']:.2f} (under a {BUSY_CORES} core quota); "
          f"in c's plan: {({k: (round(v / 2**30, 2), s) for k, (v, s) in planned.items()})}; "
          f"settled: b {settled['b'] / 2**30:.2f} (a rated {settled['a'] / 2**30:.2f}); "
          f"layers a {layers(nodes['a'])}, b {layers(nodes['b'])}, c {layers(nodes['c'])}")
