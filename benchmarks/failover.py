"""Failover benchmark: how long a stream waits after a worker dies, continuation vs replay.

Three nodes on loopback, as in ``tests/integration/test_failover.py`` and ``benchmarks/churn.py``:
workers a and b, and the serving node c (``--min-peers 2``, ``--serve PORT``). For
each resume mode (``MESH_RESUME=replay``, the way before continuation, then the
default, continuation) and each delivered length (``--delivered``, default 50 and
1000 tokens), one greedy stream (``ignore_eos``, ``max_tokens`` = delivered +
``--after``) runs; once the client has that many events, b is SIGKILLed (sidecar
and rpc-server, as a machine losing power). Measured on the client:

    death -> next token   the kill to the first text after the failover (the longest
                          wait after the kill: tokens already on their way still
                          arrive first); meanwhile c notices the loss, replans on
                          a and c, restarts llama-server, and the stream resumes
    last prompt           tokens and seconds of the last llama-server's prompt
                          processing (a continuation's includes the delivered tokens)
    texts                 whether the text went on without an error event

b then restarts (same home, joins a) and c replans over three nodes before the
next stream, so every measurement starts from the same plan.

Run: ``.venv/bin/python -m benchmarks.failover [--delivered 50,1000] [--after 200] [--reps 1]
[--json PATH]``. Figures are printed and written as JSON; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.churn import (
    REPO_ROOT,
    START_TIMEOUT_S,
    Node,
    Started,
    free_tcp_port,
    free_udp_port,
    start_node,
    stop_node,
)
from mesh_sidecar.environment import RESUME_BY_REPLAY, RESUME_ENV
from tests.helpers.waiting import wait_until

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "failover.json"
MODES = (RESUME_BY_REPLAY, "continue")
PROMPT = "Write a very long story about a lighthouse keeper, the sea and a storm that lasts for days."
SAMPLING = {"temperature": 0, "top_k": 1, "seed": 42, "ignore_eos": True}
STREAM_TIMEOUT_S = 900.0  # a replay of 1000 tokens on a loaded 2-core machine


def plan_size(node: Node) -> int:
    try:
        return len(((node.status().get("serving") or {}).get("plan") or {}).get("nodes") or [])
    except RuntimeError:
        return 0


def resumed(port: int) -> dict[str, float]:
    """c's mesh_streams_resumed_total by how."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("mesh_streams_resumed_total{"):
            how = line.split('how="')[1].split('"')[0]
            counts[how] = float(line.rsplit(" ", 1)[1])
    return counts


def measure(c: Node, b: Node, delivered: int, after: int) -> dict[str, Any]:
    """One stream; b killed once ``delivered`` tokens reached the client."""
    body = {"prompt": PROMPT, "max_tokens": delivered + after, "stream": True, **SAMPLING}
    killed_at, error, timings = None, None, {}
    arrivals: list[float] = []  # each text event's arrival after the kill
    text, tokens = "", 0
    with httpx.stream("POST", f"http://127.0.0.1:{c.serve_port}/v1/completions", json=body,
                      timeout=STREAM_TIMEOUT_S) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                error = event["error"]
                break
            timings = event.get("timings") or timings
            piece = event["choices"][0].get("text") or ""
            if not piece:
                continue
            text, tokens = text + piece, tokens + 1
            if killed_at is not None:
                arrivals.append(time.monotonic())
            elif tokens == delivered:
                killed_at = time.monotonic()
                os.kill(b.proc.pid, signal.SIGKILL)
                os.kill(b.rpc_pid, signal.SIGKILL)
    b.proc.wait()
    # Tokens already on their way still arrive after the kill; the failover is the longest wait.
    times = [killed_at or 0.0, *arrivals]
    resumed_at = max(range(1, len(times)), key=lambda i: times[i] - times[i - 1]) if arrivals else None
    return {"delivered": delivered, "tokens": tokens, "chars": len(text), "error": error,
            "death_to_next_token_s": None if resumed_at is None else times[resumed_at] - times[0],
            "tokens_in_flight": None if resumed_at is None else resumed_at - 1,
            # The last llama-server's prompt: a continuation's includes the delivered tokens.
            "last_prompt_tokens": timings.get("prompt_n"), "last_prompt_s": (timings.get("prompt_ms") or 0) / 1000}


def run_mode(mode: str, delivered: list[int], after: int, reps: int, workdir: Path, model: Path | None) -> list[dict]:
    started = Started()
    env_before = os.environ.get(RESUME_ENV)
    os.environ[RESUME_ENV] = mode  # read by c's proxy at start
    a = Node("a", workdir / mode / "a", free_udp_port(), workdir)
    b = Node("b", workdir / mode / "b", free_udp_port(), workdir)
    c = Node("c", workdir / mode / "c", free_udp_port(), workdir, serve_port=free_tcp_port())
    results = []
    try:
        start_node(a, started)
        b.args = ("--join", a.ticket)
        start_node(b, started)
        c.args = ("--join", a.ticket, "--min-peers", "2", *(("--model", str(model)) if model else ()))
        start_node(c, started)
        for n in delivered:
            for _ in range(reps):
                wait_until(lambda: plan_size(c) == 3, START_TIMEOUT_S, "c serves over three nodes")
                wait_until(lambda: httpx.get(f"http://127.0.0.1:{c.serve_port}/health", timeout=5).status_code == 200,
                           START_TIMEOUT_S, "c's API is ready")
                result = {"mode": mode, **measure(c, b, n, after)}
                print(f"{mode:>8}  {n:>5} delivered  death -> next token "
                      f"{result['death_to_next_token_s'] or float('nan'):6.2f} s  "
                      f"({result['tokens_in_flight']} in flight; "
                      f"last prompt {result['last_prompt_tokens']} tokens in {result['last_prompt_s']:.2f} s)  "
                      f"error: {result['error']}", flush=True)
                results.append(result)
                start_node(b, started)
        print(f"{mode:>8}  streams resumed: {resumed(c.serve_port)}", flush=True)
    finally:
        for node in (c, b, a):
            stop_node(node)
        started.kill_leftovers()
        if env_before is None:
            os.environ.pop(RESUME_ENV, None)
        else:
            os.environ[RESUME_ENV] = env_before
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delivered", default="50,1000", help="tokens delivered before the kill, comma-separated")
    # Far from the end when b dies: the client may read tokens well behind llama-server on a busy machine.
    parser.add_argument("--after", type=int, default=200, help="tokens asked for beyond the delivered ones")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the default model)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    delivered = [int(n) for n in args.delivered.split(",")]
    with tempfile.TemporaryDirectory(prefix="mesh-failover-") as tmp:
        results = [r for mode in MODES for r in run_mode(mode, delivered, args.after, args.reps, Path(tmp), args.model)]
    print("\n| tokens delivered | replay: death -> next token | continuation: death -> next token |")
    print("|---|---|---|")
    for n in delivered:
        cells = []
        for mode in MODES:
            gaps = [r["death_to_next_token_s"] for r in results if r["mode"] == mode and r["delivered"] == n
                    and r["death_to_next_token_s"] is not None and not r["error"]]
            cells.append(f"{statistics.median(gaps):.1f} s" if gaps else "failed")
        print(f"| {n} | {cells[0]} | {cells[1]} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"when": datetime.now(UTC).isoformat(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
