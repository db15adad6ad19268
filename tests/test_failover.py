"""Requests survive a worker vanishing mid-generation; metrics tell the story."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.conftest import api_healthy, kill_worker, metrics
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

LONG = {"prompt": "Write a long story about a lighthouse keeper and a storm.", "max_tokens": 400,
        "temperature": 0, "top_k": 1, "seed": 7, "ignore_eos": True}
FAILOVER_TIMEOUT_S = 180.0


def stream_text(port: int, on_text=None) -> str:
    """A streamed completion's whole text; ``on_text(text_so_far)`` after every piece."""
    text = ""
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**LONG, "stream": True},
                      timeout=FAILOVER_TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            if on_text:
                on_text(text)
    return text


def plain_text(port: int) -> str:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=LONG, timeout=FAILOVER_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture
def three_nodes(start_node):
    a = start_node("a")
    b = start_node("b", "--join", a.ticket())
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", serve=True)
    assert len(c.status()["serving"]["plan"]["nodes"]) == 3
    return a, b, c


def test_stream_survives_a_worker_dying_mid_stream(three_nodes):
    a, b, c = three_nodes
    undisturbed = stream_text(c.serve_port)
    assert len(undisturbed) > 500
    killed = threading.Event()

    def kill_once_started(text: str) -> None:
        if not killed.is_set() and len(text) > 100:
            killed.set()
            kill_worker(b)

    survived = stream_text(c.serve_port, kill_once_started)
    assert killed.is_set()
    assert survived == undisturbed
    samples = metrics(c.serve_port)
    assert samples["mesh_failovers_total{}"] >= 1 and samples["mesh_retries_total{}"] >= 1
    assert len(c.status()["serving"]["plan"]["nodes"]) == 2


def test_plain_request_survives_a_worker_dying(three_nodes):
    a, b, c = three_nodes
    undisturbed = plain_text(c.serve_port)
    result: dict[str, str] = {}
    asker = threading.Thread(target=lambda: result.update(text=plain_text(c.serve_port)))
    asker.start()
    # Kill while llama-server is generating: wait until the tunnel to b carries this request.
    before = next(p["bytes_to_peer"] for p in c.status()["peers"] if p["name"] == "b")
    wait_until(lambda: next(p["bytes_to_peer"] for p in c.status()["peers"] if p["name"] == "b") > before + 100_000,
               60, "the request reaches b")
    kill_worker(b)
    asker.join(FAILOVER_TIMEOUT_S)
    assert result.get("text") == undisturbed
    samples = metrics(c.serve_port)
    assert samples["mesh_failovers_total{}"] >= 1 and samples["mesh_retries_total{}"] >= 1


def test_losing_capacity_gives_503_and_recovers_without_restarting_the_server(start_node):
    a = start_node("a", "--max-memory", "150M")
    b = start_node("b", "--max-memory", "150M", "--join", a.ticket())
    c = start_node("c", "--max-memory", "60M", "--join", a.ticket(), "--min-peers", "2", serve=True)
    server_pid = c.proc.pid
    assert {n["name"] for n in c.status()["serving"]["plan"]["nodes"]} == {"a", "b"}
    kill_worker(a)
    wait_until(lambda: c.status()["serving"]["refusal"], FAILOVER_TIMEOUT_S, "c refuses: b alone is too small")
    response = httpx.post(f"http://127.0.0.1:{c.serve_port}/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert response.status_code == 503
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"} and "short" in error["message"]

    start_node("a2", "--max-memory", "150M", "--join", b.ticket())
    wait_until(lambda: api_healthy(c.serve_port), FAILOVER_TIMEOUT_S, "the model fits again")
    response = httpx.post(f"http://127.0.0.1:{c.serve_port}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert response.status_code == 200
    assert c.proc.pid == server_pid and c.proc.poll() is None


def test_metrics_parse_and_name_the_series(three_nodes):
    a, b, c = three_nodes
    stream_text(c.serve_port)
    samples = metrics(c.serve_port)
    names = {key.split("{")[0] for key in samples}
    for series in ("mesh_members", "mesh_peer_rtt_seconds", "mesh_peer_tunnel_bytes_total", "mesh_requests_total",
                   "mesh_first_token_seconds_count", "mesh_tokens_per_second_count", "mesh_failovers_total",
                   "mesh_retries_total", "mesh_restarts_total"):
        assert series in names, series
    assert samples["mesh_members{}"] == 3
    assert samples["mesh_first_token_seconds_count{}"] >= 1
    assert any(name.startswith("llamacpp:") for name in names)  # llama-server's own, passed through
