"""The native data path between real nodes: text, the QUIC fallback, the relay's death, strangers.

Two nodes on loopback: a worker and a serving node splitting the default model with it
(``--spread``). Their tunnels go through each node's ``mesh-data-relay`` (TLS over TCP)
unless ``--data-path quic`` says otherwise; the greedy text must be plain llama-server's either way.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from tests.helpers.llama import complete
from tests.helpers.mesh_api import GREEDY, stream
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

PATH_TIMEOUT_S = 60.0
LONG = {"prompt": "Write a long story about a lighthouse keeper and a storm.", "max_tokens": 300,
        "ignore_eos": True, **GREEDY}


def peer_row(node, name: str) -> dict:
    return next(p for p in node.status()["peers"] if p["name"] == name)


def relay_process(node) -> dict:
    return next(p for p in node.status()["processes"] if p["name"] == "mesh-data-relay")


def relay_connections_to(node, port: int) -> int:
    """The native relay's established TCP connections to ``port`` (a member's data port)."""
    pid = relay_process(node)["pid"]
    return sum(1 for c in psutil.Process(pid).net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def serving_pair(start_node, *args: str):
    worker = start_node("w", *args)
    server = start_node("s", "--join", worker.ticket(), "--min-peers", "1", *args, serve=True)
    assert {n["name"] for n in server.status()["serving"]["plan"]["nodes"]} == {"s", "w"}
    return worker, server


def test_split_over_the_native_path_gives_plain_llama_servers_text(start_node, reference_text):
    worker, server = serving_pair(start_node)
    wait_until(lambda: peer_row(server, "w")["data_path"] == "tcp+tls", PATH_TIMEOUT_S, "the native path to w")
    assert peer_row(worker, "s")["data_path"] == "tcp+tls"
    # llama-server (re)connects through the relay once the path is up: ask until it has.
    data_port = relay_process(worker)["port"]
    wait_until(lambda: complete(server.serve_port) == reference_text and relay_connections_to(server, data_port),
               PATH_TIMEOUT_S, "an answer over the native path")
    assert complete(server.serve_port) == reference_text
    row = peer_row(server, "w")
    assert row["bytes_to_peer"] > 1_000_000 and row["bytes_from_peer"] > 0  # the relay's counters reach status
    assert peer_row(worker, "s")["rpc_commands"] > 0


def test_forced_quic_path_gives_the_same_text_and_opens_no_data_port(start_node, reference_text):
    worker, server = serving_pair(start_node, "--data-path", "quic")
    assert complete(server.serve_port) == reference_text
    assert peer_row(server, "w")["data_path"] == "quic"
    assert not any(p["name"] == "mesh-data-relay" for p in server.status()["processes"])


def test_a_stream_survives_the_relay_being_killed_and_the_relay_comes_back(start_node):
    worker, server = serving_pair(start_node)
    data_port = relay_process(worker)["port"]
    wait_until(lambda: complete(server.serve_port) is not None and relay_connections_to(server, data_port),
               PATH_TIMEOUT_S, "llama-server connected through the native path")
    undisturbed = stream(server.serve_port, "/v1/completions", LONG)
    old_pid = relay_process(server)["pid"]

    def kill_after_some_tokens(streamed) -> None:
        if len(streamed.events) == 40:
            os.kill(old_pid, signal.SIGKILL)

    disturbed = stream(server.serve_port, "/v1/completions", LONG, on_event=kill_after_some_tokens)
    assert disturbed.done and disturbed.error is None
    # Every token delivered before the kill is kept; after the seam llama.cpp may differ (not batch-invariant).
    assert disturbed.text(40) == undisturbed.text(40)
    assert len(disturbed.finish_reasons()) == 1 and disturbed.finish_reasons()[0] == "length"
    wait_until(lambda: relay_process(server)["pid"] not in (None, old_pid)
               and peer_row(server, "w")["data_path"] == "tcp+tls", PATH_TIMEOUT_S, "the relay restarted and probed")
    assert relay_process(server)["restarts"] >= 1


def test_strangers_broken_members_and_a_kick_on_the_data_port(start_node, reference_text):
    worker, server = serving_pair(start_node)
    port = relay_process(worker)["port"]
    wait_until(lambda: complete(server.serve_port) == reference_text and relay_connections_to(server, port),
               PATH_TIMEOUT_S, "llama-server connected through the native path")
    # Strangers: TLS with a key of its own, and plain garbage, get nothing at all: from an address no member
    # dials from, both are closed before any TLS.
    for mode in ("data-port", "data-garbage"):
        assert stranger(mode, "127.0.0.1", str(port)).startswith("refused")
    log = (worker.home / "logs" / "sidecar.log").read_text()
    assert re.search(r"data port: refused \d+ connection\(s\) \(not-allowed \d+\), the last from 127\.0\.0\.1", log), \
        log[-3000:]
    # Many at once: the handshake cap turns the excess away, and members still get through.
    threads = [threading.Thread(target=stranger, args=("data-garbage", "127.0.0.1", str(port))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A member (the serving node's own key) sending broken frames: that connection is dropped, nothing else.
    assert stranger("data-member", "127.0.0.1", str(port), str(server.home)).startswith("dropped")
    assert complete(server.serve_port) == reference_text
    assert peer_row(server, "w")["data_path"] == "tcp+tls"
    # A kicked member loses its data connections at once.
    kicked = subprocess.run([sys.executable, "-m", "mesh_sidecar", "kick", "w", "--home", str(server.home)],
                            capture_output=True, text=True, timeout=60)
    assert kicked.returncode == 0, kicked.stderr
    wait_until(lambda: not relay_connections_to(server, port), 10, "the relay closed its connections to w")


def stranger(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "tests.helpers.stranger", *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
