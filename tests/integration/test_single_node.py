"""One node with real llama.cpp processes: the model alone in llama-server, streaming, clean shutdown."""

from __future__ import annotations

import contextlib
import signal
import time

import httpx
import psutil
import pytest

from tests.helpers.llama import GREEDY, complete
from tests.helpers.nodes import NODE_START_TIMEOUT_S, cli

pytestmark = pytest.mark.slow


def test_a_lone_node_runs_the_model_alone_and_matches_plain_llama_server(start_node, reference_text, model_path):
    node = start_node("solo", serve=True)
    status = node.status()
    rpc = next(p for p in status["processes"] if p["name"] == "ggml-rpc-server")
    llama = next(p for p in status["processes"] if p["name"] == "llama-server")
    argv = psutil.Process(llama["pid"]).cmdline()
    # The model fits here: llama-server holds it itself, with no RPC to its own machine.
    assert "--rpc" not in argv and "--tensor-split" not in argv
    assert argv[argv.index("-ngl") + 1] == "99"
    assert status["serving"]["plan"]["nodes"][0]["name"] == "solo" and len(status["serving"]["plan"]["nodes"]) == 1

    through_mesh = complete(node.serve_port)
    assert through_mesh == reference_text
    assert len(through_mesh.split()) > 5

    # The weights are not in the rpc-server's memory: it holds nothing for this model.
    assert psutil.Process(rpc["pid"]).memory_info().rss < 0.5 * model_path.stat().st_size
    assert [m["id"] for m in status["models"]] == [model_path.stem]
    assert status["models"][0]["replicas"][0]["local"] is True


def test_streaming_arrives_in_many_chunks(start_node):
    node = start_node("stream", serve=True)
    events, reads = [], 0
    with httpx.stream("POST", f"http://127.0.0.1:{node.serve_port}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "Count from one to twenty."}],
                            "max_tokens": 40, "stream": True, **GREEDY}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for raw in response.iter_raw():
            reads += 1
            events += [line for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) > 20
    # A buffering proxy would hand over one blob; token-by-token relaying gives many reads.
    assert reads > 10


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_leaves_no_child_process(start_node, sig):
    node = start_node("stopper", serve=True)
    children = node.child_pids()
    # rpc-server, llama-server and the native data relay
    assert len(children) == 3 and all(psutil.pid_exists(pid) for pid in children)
    assert node.stop(sig) == 0
    for pid in children:
        assert not psutil.pid_exists(pid), f"child {pid} survived {sig.name}"
    assert not (node.home / "control.json").exists()
    assert "Stopped." in node.text()


def test_status_json_shape(start_node):
    node = start_node("shape")
    status = node.status()
    assert status["node"]["name"] == "shape"
    assert len(status["node"]["id"]) == 64
    assert isinstance(status["peers"], list)
    assert [p["name"] for p in status["processes"]] == ["ggml-rpc-server", "mesh-data-relay"]


def test_logs_command_shows_each_process(start_node):
    node = start_node("logger", serve=True)
    result = cli("logs", "--home", str(node.home), "-n", "200")
    assert result.returncode == 0, result.stderr
    for name in ("sidecar.log", "rpc-server.log", "llama-server.log"):
        assert f"== {name} ==" in result.stdout
    assert "Starting RPC server" in result.stdout
    only = cli("logs", "--home", str(node.home), "--process", "rpc-server", "-n", "200")
    assert "Starting RPC server" in only.stdout and "llama-server.log" not in only.stdout


def test_status_table_for_people(start_node):
    node = start_node("people", serve=True)
    result = cli("status", "--home", str(node.home))
    assert result.returncode == 0, result.stderr
    for phrase in ("people", "Current plan", "ggml-rpc-server", "llama-server", "failovers 0", "Mesh: 0 peer(s)"):
        assert phrase in result.stdout, phrase


def test_llama_server_dying_while_it_loads_is_started_again(start_node, reference_text):
    """A start that fails (here: llama-server killed before its API answers) is retried, not left refusing."""
    node = start_node("retry", serve=True, wait=False)
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    killed = None
    while killed is None and time.monotonic() < deadline:
        assert node.proc.poll() is None, node.text()
        for child in psutil.Process(node.proc.pid).children():
            with contextlib.suppress(psutil.Error):
                if child.name() == "llama-server":
                    child.kill()
                    killed = child.pid
        time.sleep(0.005)
    assert killed is not None, node.text()
    node.wait_ready()
    text = node.text()
    # Killed before it answered: the start failed, was announced, and retried.
    assert "llama-server failed to start" in text and "Trying again in 2 s." in text, text
    assert "Starting llama-server again" in text
    assert complete(node.serve_port) == reference_text
    assert killed not in node.child_pids()
