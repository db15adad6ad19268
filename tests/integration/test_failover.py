"""Requests survive a worker vanishing mid-generation; metrics tell the story."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from mesh_sidecar.mesh.health import LOST_AFTER_S
from mesh_sidecar.serve.failover_timeline import PHASES
from tests.helpers.llama import api_healthy
from tests.helpers.nodes import kill_worker, metrics
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

LONG = {"prompt": "Write a long story about a lighthouse keeper and a storm.", "max_tokens": 400,
        "temperature": 0, "top_k": 1, "seed": 7, "ignore_eos": True}
FAILOVER_TIMEOUT_S = 180.0


def plain_answer(port: int, request: dict) -> dict:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=request, timeout=FAILOVER_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def token_ids_of(answer: dict) -> list[int]:
    return [p["id"] for p in answer["choices"][0]["logprobs"]["content"]]


@pytest.fixture
def three_nodes(start_node, tmp_path):
    a = start_node("a")
    b = start_node("b", "--join", a.ticket())
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", "--receipt", str(tmp_path / "receipts"), serve=True)
    assert len(c.status()["serving"]["plan"]["nodes"]) == 3
    return a, b, c


def test_plain_request_survives_a_worker_dying(three_nodes):
    a, b, c = three_nodes
    asked = {**LONG, "logprobs": 1}  # the client wants the token ids: the test compares them
    undisturbed = plain_answer(c.serve_port, asked)
    result: dict[str, dict] = {}
    asker = threading.Thread(target=lambda: result.update(answer=plain_answer(c.serve_port, asked)))
    asker.start()
    # Kill while llama-server is generating: wait until the tunnel to b carries this request.
    before = next(p["bytes_to_peer"] for p in c.status()["peers"] if p["name"] == "b")
    wait_until(lambda: next(p["bytes_to_peer"] for p in c.status()["peers"] if p["name"] == "b") > before + 100_000,
               60, "the request reaches b")
    kill_worker(b)
    asker.join(FAILOVER_TIMEOUT_S)
    answer = result["answer"]
    assert answer["usage"]["completion_tokens"] == LONG["max_tokens"] and answer["object"] == "text_completion"
    ids, undisturbed_ids = token_ids_of(answer), token_ids_of(undisturbed)
    # Streamed from llama-server and continued from the tokens generated before the failover (the
    # proxy logs how many): alone, those are the undisturbed ones, and the next is the model's next.
    log = "".join(f.read_text() for f in (c.home / "logs").glob("*.log"))
    generated = int(re.findall(r"continuing a stream from (\d+) delivered tokens", log)[-1])
    assert 0 < generated < len(ids) and ids[:generated] == undisturbed_ids[:generated]
    assert ids[generated] == next_token(c, "/v1/completions", LONG, ids[:generated])["logprobs"]["content"][0]["id"]
    samples = metrics(c.serve_port)
    assert samples["mesh_failovers_total{}"] >= 1 and samples["mesh_retries_total{}"] >= 1
    assert samples["mesh_streams_resumed_total{how=continued}"] == 1


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
    receive(c.serve_port, "/v1/completions", LONG)
    samples = metrics(c.serve_port)
    names = {key.split("{")[0] for key in samples}
    for series in ("mesh_members", "mesh_peer_rtt_seconds", "mesh_peer_tunnel_bytes_total", "mesh_requests_total",
                   "mesh_first_token_seconds_count", "mesh_tokens_per_second_count", "mesh_failovers_total",
                   "mesh_retries_total", "mesh_restarts_total"):
        assert series in names, series
    assert samples["mesh_members{}"] == 3
    assert samples["mesh_first_token_seconds_count{}"] >= 1
    assert any(name.startswith("llamacpp:") for name in names)  # llama-server's own, passed through




@dataclass
class Received:
    """One stream as the client saw it: each event, and when it came."""

    events: list[dict] = field(default_factory=list)
    at_s: list[float] = field(default_factory=list)

    def text(self, end: int | None = None) -> str:
        """The text of the first ``end`` events (all by default)."""
        return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                       for e in self.events[:end] for c in e.get("choices", []))

    def token_ids(self, end: int | None = None) -> list[int]:
        """The ids in the first ``end`` events' logprobs (the client asked for them)."""
        return [p["id"] for e in self.events[:end] for c in e.get("choices", [])
                for p in (c.get("logprobs") or {}).get("content") or []]

    def seam(self) -> int:
        """The index of the first event after the failover: the longest wait between two events."""
        return max(range(1, len(self.at_s)), key=lambda i: self.at_s[i] - self.at_s[i - 1])


def receive(port: int, path: str, request: dict, on_event=None) -> Received:
    """One stream of ``request``, checked free of error events; ``on_event(received)`` after each event."""
    received = Received()
    with httpx.stream("POST", f"http://127.0.0.1:{port}{path}", json={**request, "stream": True},
                      timeout=FAILOVER_TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                received.events.append(event)
                received.at_s.append(time.monotonic())
                if on_event:
                    on_event(received)
    return received


def prompt_text(node, path: str, request: dict) -> str:
    """What llama-server generates after: a chat's messages as the node's own llama-server renders them."""
    if path == "/v1/completions":
        return request["prompt"]
    pid = next(p["pid"] for p in node.status()["processes"] if p["name"] == "llama-server")
    argv = psutil.Process(pid).cmdline()
    key = (node.home / "llama-server.key").read_text().strip()
    rendered = httpx.post(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/apply-template", json=request,
                          headers={"Authorization": f"Bearer {key}"}, timeout=30)
    return rendered.json()["prompt"]


def next_token(node, path: str, request: dict, ids_before: list[int]) -> dict:
    """The choice of a one-token greedy completion after the request's prompt and ``ids_before``, asked
    alone on the healed mesh: what the model says comes after exactly those tokens."""
    sampling = {k: request[k] for k in ("temperature", "top_k", "seed", "ignore_eos") if k in request}
    response = httpx.post(f"http://127.0.0.1:{node.serve_port}/v1/completions", timeout=FAILOVER_TIMEOUT_S, json={
        "prompt": [prompt_text(node, path, request), *ids_before], "max_tokens": 1, "cache_prompt": False,
        "logprobs": 1, **sampling})
    return response.json()["choices"][0]


def assert_goes_on_exactly(node, path: str, request: dict, received: Received, ids_before: list[int]) -> None:
    """The text after the failover starts exactly after the delivered tokens, no repeat, no gap.

    Only its first piece is checked: llama.cpp's arithmetic differs between a prompt processed as one batch
    and tokens decoded one by one, so a greedy continuation may later take another near-tie than the
    undisturbed run (seen with plain llama-server too)."""
    seam = received.seam()
    expected = next_token(node, path, request, ids_before)["text"]
    assert received.text(seam + 1)[len(received.text(seam)):] == expected, path


def test_stream_survives_a_worker_dying_mid_stream(three_nodes, tmp_path):
    a, b, c = three_nodes
    undisturbed = receive(c.serve_port, "/v1/completions", {**LONG, "logprobs": 1})
    assert len(undisturbed.text()) > 500
    killed = threading.Event()

    def kill_once_started(received: Received) -> None:
        if not killed.is_set() and len(received.text()) > 100:
            killed.set()
            kill_worker(b)

    survived = receive(c.serve_port, "/v1/completions", LONG, kill_once_started)
    assert killed.is_set()
    assert not any(c.get("logprobs") for e in survived.events for c in e["choices"]), "ids the proxy asked for leak"
    seam = survived.seam()
    assert survived.text(seam) == undisturbed.text(seam)  # alone, the same text up to the failover
    assert_goes_on_exactly(c, "/v1/completions", LONG, survived, undisturbed.token_ids(seam))
    assert len(survived.text()) > 500 and survived.events[-1]["choices"][0]["finish_reason"] == "length"
    samples = metrics(c.serve_port)
    assert samples["mesh_failovers_total{}"] >= 1 and samples["mesh_retries_total{}"] >= 1
    assert samples["mesh_streams_resumed_total{how=continued}"] == 1
    assert len(c.status()["serving"]["plan"]["nodes"]) == 2
    # Its receipt says where it was continued. (Its replay is checked on one node, in test_receipt.py: here
    # the plan without b drafts by n-gram lookup, and llama-server gives no token id for an accepted draft
    # token, so this receipt's output digest covers only some of the tokens.)
    (continued,) = [path for path in (tmp_path / "receipts").glob("*.json")
                    if json.loads(path.read_text())["body"].get("continued_at")]
    assert json.loads(continued.read_text())["body"]["continued_at"] == [len(undisturbed.token_ids(seam))]


LOST_LINE = re.compile(r"Lost peer b: (.*)")


def test_a_killed_worker_is_known_lost_at_once_by_its_cause_and_the_failover_is_timed(three_nodes):
    a, b, c = three_nodes
    lost: dict[str, float] = {}

    def kill_then_watch(received: Received) -> None:
        if "killed" not in lost and len(received.text()) > 100:
            kill_worker(b)
            lost["killed"] = time.monotonic()  # kill_worker asks b's status first: the kills end it
            seen = wait_until(lambda: LOST_LINE.search(c.text()), LOST_AFTER_S * 4, "c says b is lost", poll_s=0.01)
            lost["after_s"] = time.monotonic() - lost["killed"]
            lost["cause"] = seen.group(1)

    streamed = receive(c.serve_port, "/v1/completions", LONG, kill_then_watch)
    assert streamed.events[-1]["choices"][0]["finish_reason"] == "length"
    # Known by a sign of the dead process, confirmed by a probe: not by the heartbeat's silence, which
    # could not have said it before LOST_AFTER_S.
    signs = (r"its port is unreachable, and again after a probe \d+ ms later",
             r"its data connection was reset, and a probe \d+ ms later found it unreachable",
             r"its (port is unreachable|data connection was reset), and no answer to a probe in \d+ ms")
    assert any(re.fullmatch(sign, str(lost["cause"])) for sign in signs), lost["cause"]
    assert lost["after_s"] < LOST_AFTER_S, lost
    print(f"\nb's loss known {1000 * lost['after_s']:.0f} ms after its SIGKILL: {lost['cause']}")
    # Each phase of the failover is in /metrics, and its timeline in the log.
    samples = metrics(c.serve_port)
    for phase in PHASES:
        assert samples[f"mesh_failover_phase_seconds_count{{phase={phase}}}"] >= 1, phase
    log = "".join(f.read_text() for f in (c.home / "logs").glob("*.log"))
    assert re.search(r"failover: detect [\d.]+ s, stop [\d.]+ s, plan [\d.]+ s, load [\d.]+ s", log)


# Four greedy streams, different prompts, both endpoints. They ask for logprobs so the test sees
# each token's id; one chat stream also wants usage.
CONCURRENT = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
                              "logprobs": True, "top_logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Explain in detail how tides work."}],
                              "logprobs": True, "top_logprobs": 1, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "The history of sailing ships begins", "logprobs": 1}),
    ("/v1/completions", {"prompt": "A recipe for bread. First,", "logprobs": 1}),
]
CONCURRENT_TOKENS = 160
EVENTS_BEFORE_KILL = 40
GREEDY_STREAM = {"max_tokens": CONCURRENT_TOKENS, "temperature": 0, "top_k": 1, "seed": 11, "ignore_eos": True}


def test_four_concurrent_streams_continue_after_a_worker_dies(three_nodes):
    a, b, c = three_nodes
    requests = [(path, {**request, **GREEDY_STREAM}) for path, request in CONCURRENT]
    undisturbed = [receive(c.serve_port, path, request).text() for path, request in requests]
    killed = threading.Event()
    lock = threading.Lock()
    streams: dict[int, Received] = {}

    def run(i: int) -> None:
        def on_event(received: Received) -> None:
            with lock:
                streams[i] = received
                if not killed.is_set() and len(streams) == len(requests) and min(
                        len(r.events) for r in streams.values()) >= EVENTS_BEFORE_KILL:
                    killed.set()
                    kill_worker(b)

        receive(c.serve_port, *requests[i], on_event)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(FAILOVER_TIMEOUT_S)
    assert killed.is_set() and not any(thread.is_alive() for thread in threads)
    samples = metrics(c.serve_port)
    assert samples["mesh_streams_resumed_total{how=continued}"] == len(requests), samples
    assert samples.get("mesh_streams_resumed_total{how=replayed}", 0) == 0
    for i, (path, request) in enumerate(requests):
        received = streams[i]
        assert {e["id"] for e in received.events} == {received.events[0]["id"]}  # the stream the client started
        finish = [c["finish_reason"] for e in received.events for c in e.get("choices", []) if c.get("finish_reason")]
        assert finish == ["length"], (path, finish)
        if "stream_options" in request:
            assert received.events[-1]["usage"]["completion_tokens"] == CONCURRENT_TOKENS
        # Batched requests may take other near-ties than a run alone, before the failover or after it;
        # where the text is the undisturbed one there is nothing to check, elsewhere the seam.
        if received.text() != undisturbed[i]:
            assert_goes_on_exactly(c, path, request, received, received.token_ids(received.seam()))
