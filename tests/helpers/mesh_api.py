"""Asking a node's API for any model in the mesh (its own, or one another member serves), and what
the tests of serving on every member need besides: streams that keep their error event, the
forwarded-request counters, a serving node killed with its children, an outsider opening a
forwarding stream, and a node started on the default API port."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from mesh_sidecar.wire.api_forward import ForwardedRequest, encode_request
from mesh_sidecar.wire.stream_kind import StreamKind
from tests.helpers.nodes import NodeProcess, free_udp_port
from tests.helpers.stranger import SILENT_WAIT_S, unauthenticated_client

REQUEST_TIMEOUT_S = 180.0
# Greedy, and the prompt evaluated anew each time (no cached prompt): one request asked twice, alone,
# gives the same tokens.
GREEDY = {"temperature": 0, "top_k": 1, "seed": 42, "cache_prompt": False}


def url(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}{path}"


@dataclass
class Streamed:
    """One stream as the client saw it: its events, when each came, and how it ended."""

    events: list[dict] = field(default_factory=list)
    at_s: list[float] = field(default_factory=list)
    status: int = 0
    done: bool = False  # "data: [DONE]" came
    error: dict | None = None  # an error event's "error", when one came

    def text(self, end: int | None = None) -> str:
        """The text of the first ``end`` events (all by default), a completion's or a chat's."""
        return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                       for e in self.events[:end] for c in e.get("choices", []))

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]

    def seam(self) -> int:
        """The index of the first event after the longest wait between two events (a failover's)."""
        return max(range(1, len(self.at_s)), key=lambda i: self.at_s[i] - self.at_s[i - 1])


def stream(port: int, path: str, body: dict, headers: dict[str, str] | None = None,
           on_event: Callable[[Streamed], None] | None = None) -> Streamed:
    """One stream of ``body`` to ``path`` on the API at ``port``; an error event ends it and is kept
    (nothing is asserted here). ``on_event(streamed)`` runs after each event."""
    streamed = Streamed()
    with httpx.stream("POST", url(port, path), json={**body, "stream": True}, headers=headers,
                      timeout=REQUEST_TIMEOUT_S) as response:
        streamed.status = response.status_code
        if response.status_code != 200:
            response.read()
            streamed.error = response.json().get("error")
            return streamed
        for line in response.iter_lines():
            if line == "data: [DONE]":
                streamed.done = True
            elif line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    streamed.error = event["error"]
                    continue
                streamed.events.append(event)
                streamed.at_s.append(time.monotonic())
                if on_event is not None:
                    on_event(streamed)
    return streamed


def ask(port: int, path: str, body: dict, headers: dict[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT_S) -> httpx.Response:
    """A plain (not streamed) request."""
    return httpx.post(url(port, path), json=body, headers=headers, timeout=timeout)


def answer_text(response: httpx.Response) -> str:
    """A plain answer's text (asserts it is a 200)."""
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def listed_models(port: int, headers: dict[str, str] | None = None) -> dict[str, dict]:
    """``/v1/models`` on the API at ``port``, by id."""
    response = httpx.get(url(port, "/v1/models"), headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    return {entry["id"]: entry for entry in response.json()["data"]}


def samples(port: int, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every sample of ``/metrics`` (which wants the key where the node has one), as 'name{labels}' -> value."""
    response = httpx.get(url(port, "/metrics"), headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    found = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


def forwarded(port: int, headers: dict[str, str] | None = None) -> dict[tuple[str, str], float]:
    """``mesh_forwarded_requests_total`` on the node at ``port``: (model, serving node's name) -> count."""
    counts = {}
    for key, value in samples(port, headers).items():
        if key.startswith("mesh_forwarded_requests_total{"):
            labels = dict(pair.split("=", 1) for pair in key[key.index("{") + 1:-1].split(","))
            counts[(labels["model"], labels["node"])] = value
    return counts


def generation_requests(port: int, headers: dict[str, str] | None = None) -> float:
    """How many generation requests the API at ``port`` answered in any way (``mesh_requests_total``)."""
    return sum(value for key, value in samples(port, headers).items()
               if key.startswith("mesh_requests_total{") and "/completions" in key)


def kill_node(node: NodeProcess, children: Sequence[int]) -> None:
    """SIGKILL a node's sidecar and the children named (its ``child_pids()``, asked before: a dead node
    answers nothing), as a machine that loses power (its llama-server would follow the sidecar by
    PDEATHSIG anyway)."""
    node.proc.send_signal(signal.SIGKILL)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.proc.wait()
    for pid in children:
        try:
            psutil.Process(pid).wait(10)
        except psutil.Error:
            pass


@dataclass(frozen=True)
class Turned:
    """How an outsider's forwarding stream went: how the node closed the connection, what came back."""

    closed_with: str | None
    answered: bytes


async def _forward_unadmitted(host: str, port: int, request: ForwardedRequest) -> Turned:
    async with unauthenticated_client(host, port) as client:
        quic = client._quic
        quic.send_stream_data(quic.get_next_available_stream_id(), b"")  # the control stream, silent
        quic.send_stream_data(quic.get_next_available_stream_id(),
                              bytes((StreamKind.API_FORWARD,)) + encode_request(request))
        client.transmit()
        try:
            await asyncio.wait_for(client.wait_closed(), SILENT_WAIT_S)
        except TimeoutError:
            return Turned(None, client.answered)
        return Turned(client.closed_with, client.answered)


def forward_unadmitted(port: int, request: ForwardedRequest) -> Turned:
    """A stranger (TLS done, never authenticated) opens an API_FORWARD stream to the node whose QUIC port
    is ``port`` on loopback and waits for an answer, or for the node to close the connection."""
    return asyncio.run(_forward_unadmitted("127.0.0.1", port, request))


def stranger(*args: str) -> str:
    """``tests.helpers.stranger`` run as a process on loopback: the line saying how it was turned away."""
    result = subprocess.run([sys.executable, "-m", "tests.helpers.stranger", *args], capture_output=True,
                            text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def start_on_the_default_port(root: Path, name: str, *args: str) -> NodeProcess:
    """A worker node started as people start one: without --api-port or --serve (so it asks for the API's
    default port); returned once its control endpoint is up (its API listens before that). Stop it with
    ``stop_with_children``."""
    home = root / name
    home.mkdir()
    argv = [sys.executable, "-m", "mesh_sidecar", "--home", str(home), "--name", name,
            "--port", str(free_udp_port()), "--no-mdns", "--threads", "1", *args]  # as tests/helpers/nodes.py
    output = root / f"{name}.out"
    node = NodeProcess(home, subprocess.Popen(argv, stdout=open(output, "w"), stderr=subprocess.STDOUT), output)
    try:
        node.wait_ready()
        node.extra_pids = node.child_pids()
    except BaseException:
        node.stop_with_children()
        raise
    return node
