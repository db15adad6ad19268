"""Backend-to-backend transfer (``--b2b``): real rpc-servers and llama-servers of both builds.

In network namespaces, one mesh of three nodes runs twice at the same prompt, stock
and b2b: the text must equal a single-machine run, and the bytes that move layer
outputs (``activation_bytes_in``, counted by each worker's RPC filter) must leave
the serving node's links for the workers' own. The REGISTER_PEER rewrite is read
from the workers' logs: the serving node's endpoint in, the worker's tunnel out.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from mesh_sidecar.llama.build import B2B, ensure_binaries
from mesh_sidecar.llama.capacity import Capacity, held_key
from mesh_sidecar.ports import free_tcp_port
from tests.helpers.llama import N_PREDICT, api_healthy, complete, quiet, start_bare_rpc_server
from tests.helpers.netns import API_PORT, Lab, can_make_namespaces, ns_complete, start_in, ticket_of
from tests.helpers.nodes import kill_worker
from tests.helpers.waiting import wait_until
from tests.integration.test_failover import FAILOVER_TIMEOUT_S, LONG, Received, receive

pytestmark = [pytest.mark.slow]

# The bound: with b2b the serving node's links carry under this share of the activation bytes.
MAX_ORCHESTRATOR_SHARE = 0.2
LOAD_TIMEOUT_S = 240
# Longer than llama-server's ubatch (512; this one is 1,392 tokens): the prompt goes through in
# three graphs, so a worker's output for one may arrive while the next worker is still on the one
# before (b2b applies each push in the serving node's command order, or the text would differ).
LONG_PROMPT = "Count on: " + ", ".join(str(n) for n in range(300))
LONG_N_PREDICT = 8
_REWRITE = re.compile(r"tunnel from (\S+): EndpointRewritten\(peer_id=(\d+), original='([^']*)', "
                      r"rewritten='([^']*)'\)")


@pytest.fixture(scope="session")
def b2b_binaries():
    """The b2b build (built on first use, about as long as the stock one)."""
    return ensure_binaries(None, quiet, B2B)


def activation_in(node) -> dict[str, int]:
    """Bytes that moved layer outputs into this node's rpc-server, by the peer that sent them."""
    return {p["name"]: p["activation_bytes_in"] for p in node.status()["peers"]}


def run_mesh(lab_hosts, root: Path, *flags: str) -> dict:
    """Three nodes (s serves), one greedy completion; what moved during it, and the logs."""
    s, x, y = lab_hosts
    nodes = []
    try:
        nodes.append(start_in(x, root / "x", *flags))
        ticket = ticket_of(nodes[0])
        nodes.append(start_in(y, root / "y", "--join", ticket, *flags))
        nodes.append(start_in(s, root / "s", "--join", ticket, "--serve", str(API_PORT), "--spread", "--min-peers", "2",
                              *flags))
        serving = nodes[2]
        wait_until(lambda: "API ready" in serving.text() or serving.proc.poll() is not None, LOAD_TIMEOUT_S,
                   "s loads the model")
        assert serving.proc.poll() is None, serving.text()
        for node in nodes:
            node.extra_pids = node.child_pids()
        before = {n.home.name: activation_in(n) for n in nodes}
        text = ns_complete(s)
        after = {n.home.name: activation_in(n) for n in nodes}
        long_text = ns_complete(s, LONG_PROMPT, LONG_N_PREDICT)
        moved = {(sender, receiver): after[receiver][sender] - before[receiver].get(sender, 0)
                 for receiver in after for sender in after[receiver]}
        order = [n["name"] for n in serving.status()["serving"]["plan"]["nodes"]]
        tunnels = {n.home.name: {p["name"]: p["tunnel_port"] for p in n.status()["peers"]} for n in nodes}
        rpc_port_s = next(p["port"] for p in serving.status()["processes"] if p["name"] == "ggml-rpc-server")
        logs = {n.home.name: (n.home / "logs" / "sidecar.log").read_text(errors="replace") for n in nodes}
        ids = {n.home.name: n.status()["node"]["short_id"] for n in nodes}
        return {"text": text, "long_text": long_text, "moved": moved, "order": order, "tunnels": tunnels,
                "rpc_port_s": rpc_port_s, "logs": logs, "ids": ids}
    finally:
        for node in nodes:
            node.stop_with_children()


@pytest.mark.netns
@pytest.mark.skipif(not can_make_namespaces(), reason="needs root and `ip netns`")
def test_b2b_mesh_moves_activations_worker_to_worker(b2b_binaries, reference_text, tmp_path):
    lab = Lab(sniff=False)
    try:
        hosts = [lab.add_host(name) for name in "sxy"]
        stock = run_mesh(hosts, tmp_path / "stock")
        b2b = run_mesh(hosts, tmp_path / "b2b", "--b2b")
    finally:
        lab.close()

    assert stock["text"] == reference_text
    assert b2b["text"] == reference_text
    assert b2b["long_text"] == stock["long_text"]
    assert stock["order"][-1] == b2b["order"][-1] == "s"  # the workers' order follows their (new) ids

    def from_serving_node(run: dict) -> int:
        return sum(v for (sender, _), v in run["moved"].items() if sender == "s")

    def between_workers(run: dict) -> int:  # s's own rpc-server counts as a worker here
        return sum(v for (sender, _), v in run["moved"].items() if sender != "s")

    print(f"\nactivation bytes during {N_PREDICT} tokens: stock {stock['moved']}\nb2b {b2b['moved']}")
    assert from_serving_node(stock) > 0 and between_workers(stock) == 0
    assert between_workers(b2b) > 0
    assert from_serving_node(b2b) < MAX_ORCHESTRATOR_SHARE * from_serving_node(stock)

    # REGISTER_PEER, as it left s and as it reached each worker's rpc-server.
    rewrites = [(node, m) for node, text in b2b["logs"].items() for m in _REWRITE.finditer(text)]
    assert {node for node, _ in rewrites} == set(b2b["order"][:-1])  # every worker before the last device
    for node, match in rewrites:
        sender, peer_index, original, rewritten = match.group(1), int(match.group(2)), match.group(3), \
            match.group(4)
        peer = b2b["order"][peer_index]
        assert sender == b2b["ids"]["s"] and peer != node  # logs name peers by short id
        assert original != rewritten
        # What s's llama-server uses for that peer: its tunnel port, or (for s itself) its own rpc-server.
        expected_original = b2b["rpc_port_s"] if peer == "s" else b2b["tunnels"]["s"][peer]
        assert original == f"127.0.0.1:{expected_original}"
        assert rewritten == f"127.0.0.1:{b2b['tunnels'][node][peer]}"


@pytest.mark.parametrize("client_build, server_build", [("stock", "b2b"), ("b2b", "stock")])
def test_either_build_talks_to_the_other(client_build, server_build, binaries, b2b_binaries, model_path,
                                         reference_text, tmp_path):
    """As patches/README.md says: a stock client never sends the new commands, and a b2b client
    sends them only to servers whose HELLO carries the b2b flag; both give the same text."""
    builds = {"stock": binaries, "b2b": b2b_binaries}
    ports = [free_tcp_port(), free_tcp_port()]
    started: list[subprocess.Popen] = []  # stopped whatever happens
    try:
        for i, port in enumerate(ports):
            started.append(start_bare_rpc_server(builds[server_build], port, tmp_path / f"rpc{i}.log"))
        api = free_tcp_port()
        client = subprocess.Popen(
            [str(builds[client_build].llama_server), "-m", str(model_path), "--host", "127.0.0.1", "--port",
             str(api), "--rpc", ",".join(f"127.0.0.1:{p}" for p in ports), "-ngl", "99", "--tensor-split", "1,1"],
            stdout=open(tmp_path / "llama-server.log", "w"), stderr=subprocess.STDOUT)
        started.append(client)
        wait_until(lambda: api_healthy(api) or client.poll() is not None, 120, "llama-server loads")
        assert client.poll() is None, (tmp_path / "llama-server.log").read_text()
        assert complete(api) == reference_text
    finally:
        for proc in started:
            proc.terminate()
            proc.wait(10)


@pytest.mark.netns
@pytest.mark.skipif(not can_make_namespaces(), reason="needs root and `ip netns`")
def test_two_serving_nodes_answer_at_once(b2b_binaries, reference_text, tmp_path):
    """Two orchestrators in one mesh: the b2b worker's rpc-server serves both llama-servers at once."""
    lab = Lab(sniff=False)
    nodes = []
    try:
        w, a, b = (lab.add_host(name) for name in "wab")
        nodes.append(start_in(w, tmp_path / "w", "--b2b"))
        ticket = ticket_of(nodes[0])
        for host in (a, b):
            nodes.append(start_in(host, tmp_path / host.name, "--join", ticket, "--b2b", "--serve", str(API_PORT),
                                  "--spread", "--min-peers", "2"))
        for node in nodes[1:]:
            wait_until(lambda node=node: "API ready" in node.text() or node.proc.poll() is not None, LOAD_TIMEOUT_S,
                       f"{node.home.name} loads the model")
            assert node.proc.poll() is None, node.text()
        answers: dict[str, str] = {}

        def ask(host) -> None:
            answers[host.name] = ns_complete(host)

        threads = [threading.Thread(target=ask, args=(host,)) for host in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert answers == {"a": reference_text, "b": reference_text}
        for node in nodes[1:]:
            # Each uses w, which takes several clients (b2b), and itself: a serving node is no
            # worker for another (serve/assignment.py).
            assert [n["name"] for n in node.status()["serving"]["plan"]["nodes"]] == ["w", node.home.name]
        # The planners count both: w announces what it holds for each serving node, and each
        # serving node plans on w's memory less what w holds for the other.
        ids = {n.home.name: bytes.fromhex(n.status()["node"]["id"]) for n in nodes}
        w_seen_by_a = next(p for p in nodes[1].status()["peers"] if p["name"] == "w")["capacity"]
        offer = Capacity.from_gossip(w_seen_by_a)
        held = dict(offer.held)
        assert held[held_key(ids["a"])] > 0 and held[held_key(ids["b"])] > 0, w_seen_by_a
        assert offer.usable_for(ids["a"]) == offer.usable_bytes - held[held_key(ids["b"])]
    finally:
        for node in nodes:
            node.stop_with_children()
        lab.close()


def test_a_worker_gone_mid_stream_does_not_leave_the_next_one_waiting(b2b_binaries, start_node):
    """The next worker waits for the first one's push (AWAIT_TENSOR); when the first dies there, the
    serving node restarts llama-server, and the next worker must let go of the old connection (and
    the buffers it holds) at once, not after the wait's own timeout (120 s), while the stream goes on."""
    a = start_node("a", "--b2b")
    b = start_node("b", "--b2b", "--join", a.ticket())
    c = start_node("c", "--b2b", "--join", a.ticket(), "--min-peers", "2", serve=True)
    order = [n["name"] for n in c.status()["serving"]["plan"]["nodes"]]
    assert len(order) == 3 and order[-1] == "c"
    first, second = ({"a": a, "b": b}[name] for name in order[:2])
    first_rpc = psutil.Process(next(p["pid"] for p in first.status()["processes"] if p["name"] == "ggml-rpc-server"))
    stopped = threading.Event()

    def stop_first_once_started(received: Received) -> None:
        if not stopped.is_set() and len(received.text()) > 100:
            stopped.set()
            first_rpc.suspend()  # its push never comes: the second worker is left in AWAIT_TENSOR

    result: dict[str, Received] = {}
    asker = threading.Thread(target=lambda: result.update(survived=receive(c.serve_port, "/v1/completions", LONG,
                                                                           stop_first_once_started)))
    asker.start()
    wait_until(stopped.is_set, 60, "the stream is under way")
    killed_at = time.monotonic()
    kill_worker(first)
    went_away = wait_until(
        lambda: "the client went away waiting for push" in (second.home / "logs" / "rpc-server.log").read_text(),
        60, f"{second.home.name}'s rpc-server lets go of the dead llama-server's connection")
    print(f"\n{second.home.name}'s rpc-server let go {time.monotonic() - killed_at:.1f} s after the kill")
    assert went_away
    asker.join(FAILOVER_TIMEOUT_S)
    survived = result["survived"]
    assert survived.events[-1]["choices"][0]["finish_reason"] == "length"
    assert [n["name"] for n in c.status()["serving"]["plan"]["nodes"]] == [second.home.name, "c"]
