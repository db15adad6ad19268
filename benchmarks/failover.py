"""Failover benchmark: how long a stream waits when a worker dies or its machine vanishes.

Three nodes on loopback, as in ``tests/integration/test_failover.py`` and ``benchmarks/churn.py``:
workers a and b, and the serving node c (``--min-peers 2``, ``--serve PORT --spread``). Each case
runs greedy streams (``ignore_eos``) and, once the client has seen enough of them, takes b away:

    kill at N     one stream; after N delivered tokens (``--delivered``, default 20 and 800) b's
                  sidecar and rpc-server are SIGKILLed, as a process dying on a live machine: the
                  kernel answers its port "unreachable" and resets its data connections
    vanish        one stream; after 20 tokens b's sidecar, relay and rpc-server are SIGSTOPped: a
                  machine gone from the network (no answer, no reset), only the heartbeat can say it
    4 streams     four concurrent streams; b SIGKILLed once each has 40 events; the time until all
                  four end, against the same four undisturbed

Measured on the client: **silence**, the longest wait between two tokens of a stream after b went
(tokens already on their way still arrive first). From c's /metrics, the failover's phases
(detect, stop, plan, load, resume; serve/failover_timeline.py) of that failover. ``--modes
continue,replay`` adds the way before continuation (``MESH_RESUME=replay``) for comparison.

b then restarts (same home, joins a) and c replans over three nodes before the next case, so every
measurement starts from the same plan.

Run: ``.venv/bin/python -m benchmarks.failover [--delivered 20,800] [--after 200] [--reps 1]
[--modes continue] [--no-vanish] [--no-concurrent] [--threads N] [--json PATH]``. Figures are printed and written
as JSON; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.loopback_nodes import (
    Node,
    Spawned,
    free_tcp_port,
    free_udp_port,
    start_node,
    stop_node,
)
from benchmarks.setup import REPO_ROOT, START_TIMEOUT_S
from mesh_sidecar.environment import RESUME_BY_REPLAY, RESUME_ENV
from mesh_sidecar.serve.failover_timeline import PHASES
from tests.helpers.waiting import wait_until

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "failover.json"
PROMPT = "Write a very long story about a lighthouse keeper, the sea and a storm that lasts for days."
PROMPTS = [PROMPT, "Explain in detail how tides work, with examples.", "The history of sailing ships begins",
           "A recipe for bread. First,"]
SAMPLING = {"temperature": 0, "top_k": 1, "seed": 42, "ignore_eos": True}
STREAM_TIMEOUT_S = 900.0  # a replay of 1000 tokens on a loaded 2-core machine
VANISH_AT = 20
CONCURRENT_EVENTS_BEFORE_KILL = 40
CONCURRENT_TOKENS = 160


def plan_size(node: Node) -> int:
    try:
        return len(((node.status().get("serving") or {}).get("plan") or {}).get("nodes") or [])
    except RuntimeError:
        return 0


def phase_sums(port: int) -> dict[str, float]:
    """c's mesh_failover_phase_seconds sums by phase."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    sums = dict.fromkeys(PHASES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mesh_failover_phase_seconds_sum":
                sums[sample.labels["phase"]] = sample.value
    return sums


def take_away(b: Node, how: str) -> None:
    """SIGKILL b's sidecar and rpc-server (its relay dies with the sidecar), or SIGSTOP all three."""
    if how == "kill":
        os.kill(b.proc.pid, signal.SIGKILL)
        os.kill(b.rpc_pid, signal.SIGKILL)
        return
    sidecar = psutil.Process(b.proc.pid)
    for process in [sidecar, *sidecar.children(recursive=True)]:
        process.send_signal(signal.SIGSTOP)


def silence_s(taken_at: float, arrivals: list[float]) -> float | None:
    """The longest wait between tokens after ``taken_at``."""
    times = [taken_at, *arrivals]
    return max((times[i] - times[i - 1] for i in range(1, len(times))), default=None)


class Stream:
    """One greedy stream read on a thread of its own; ``on_token(stream)`` after each piece of text."""

    def __init__(self, port: int, prompt: str, max_tokens: int, on_token) -> None:
        self.port, self.body = port, {"prompt": prompt, "max_tokens": max_tokens, "stream": True, **SAMPLING}
        self.on_token = on_token
        self.tokens, self.error, self.timings = 0, None, {}
        self.arrivals: list[float] = []
        self.ended_at: float | None = None

    def run(self) -> None:
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=self.body,
                          timeout=STREAM_TIMEOUT_S) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    self.error = event["error"]
                    break
                self.timings = event.get("timings") or self.timings
                if event["choices"][0].get("text"):
                    self.tokens += 1
                    self.arrivals.append(time.monotonic())
                    self.on_token(self)
        self.ended_at = time.monotonic()


def measure_one(c: Node, b: Node, delivered: int, after: int, how: str) -> dict[str, Any]:
    """One stream; b taken away once ``delivered`` tokens reached the client."""
    taken: dict[str, float] = {}
    before = phase_sums(c.serve_port)

    def on_token(stream: Stream) -> None:
        if not taken and stream.tokens == delivered:
            taken["at"] = time.monotonic()
            take_away(b, how)

    stream = Stream(c.serve_port, PROMPT, delivered + after, on_token)
    stream.run()
    after_phases = phase_sums(c.serve_port)
    arrivals = [t for t in stream.arrivals if t > taken.get("at", 0.0)]
    return {"case": f"kill at {delivered}" if how == "kill" else f"vanish at {delivered}", "delivered": delivered,
            "tokens": stream.tokens, "error": stream.error,
            "silence_s": silence_s(taken["at"], arrivals) if taken else None,
            "phases_s": {phase: after_phases[phase] - before[phase] for phase in PHASES},
            # The last llama-server's prompt: a continuation's includes the delivered tokens.
            "last_prompt_tokens": stream.timings.get("prompt_n"),
            "last_prompt_s": (stream.timings.get("prompt_ms") or 0) / 1000}


def run_together(streams: list[Stream]) -> None:
    threads = [threading.Thread(target=stream.run) for stream in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(STREAM_TIMEOUT_S)


def measure_concurrent(c: Node, b: Node) -> dict[str, Any]:
    """Four streams undisturbed, then four with b killed once each has CONCURRENT_EVENTS_BEFORE_KILL tokens."""
    began = time.monotonic()
    run_together([Stream(c.serve_port, prompt, CONCURRENT_TOKENS, lambda _: None) for prompt in PROMPTS])
    undisturbed_s = time.monotonic() - began
    lock, taken = threading.Lock(), {}
    streams: list[Stream] = []

    def on_token(_: Stream) -> None:
        with lock:
            if not taken and len(streams) == len(PROMPTS) and all(
                    s.tokens >= CONCURRENT_EVENTS_BEFORE_KILL for s in streams):
                taken["at"] = time.monotonic()
                take_away(b, "kill")

    began = time.monotonic()
    streams.extend(Stream(c.serve_port, prompt, CONCURRENT_TOKENS, on_token) for prompt in PROMPTS)
    run_together(streams)
    silences = [silence_s(taken["at"], [t for t in s.arrivals if t > taken["at"]]) for s in streams] if taken else []
    return {"case": "4 streams", "killed": bool(taken), "errors": [s.error for s in streams if s.error],
            "completed": sum(s.tokens == CONCURRENT_TOKENS for s in streams),
            "all_done_s": time.monotonic() - began, "undisturbed_s": undisturbed_s,
            "silence_s": max((s for s in silences if s is not None), default=None)}


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> list[dict]:
    started = Spawned()
    env_before = os.environ.get(RESUME_ENV)
    os.environ[RESUME_ENV] = mode  # read by c's proxy at start
    a = Node("a", workdir / mode / "a", free_udp_port(), workdir)
    b = Node("b", workdir / mode / "b", free_udp_port(), workdir)
    c = Node("c", workdir / mode / "c", free_udp_port(), workdir, serve_port=free_tcp_port())
    cases: list[tuple[str, int]] = [("kill", n) for n in args.delivered for _ in range(args.reps)]
    if args.vanish:
        cases += [("vanish", VANISH_AT)] * args.reps
    if args.concurrent:
        cases += [("concurrent", 0)] * args.reps
    results = []
    try:
        threads = ("--threads", str(args.threads)) if args.threads else ()
        a.args = threads
        start_node(a, started)
        b.args = ("--join", a.ticket, *threads)
        start_node(b, started)
        c.args = ("--join", a.ticket, "--min-peers", "2", *threads,
                  *(("--model", str(args.model)) if args.model else ()))
        start_node(c, started)
        for how, n in cases:
            wait_until(lambda: plan_size(c) == 3, START_TIMEOUT_S, "c serves over three nodes")
            wait_until(lambda: httpx.get(f"http://127.0.0.1:{c.serve_port}/health", timeout=5).status_code == 200,
                       START_TIMEOUT_S, "c's API is ready")
            result = {"mode": mode, **(measure_concurrent(c, b) if how == "concurrent"
                                       else measure_one(c, b, n, args.after, how))}
            print(f"{mode:>8}  {result['case']:>13}  silence {result['silence_s'] or float('nan'):6.2f} s  "
                  + (f"all done {result['all_done_s']:.1f} s (undisturbed {result['undisturbed_s']:.1f} s), "
                     f"{result['completed']}/4 complete" if how == "concurrent" else
                     "phases " + ", ".join(f"{p} {s:.2f}" for p, s in result["phases_s"].items())
                     + f"; last prompt {result['last_prompt_tokens']} tokens in {result['last_prompt_s']:.2f} s")
                  + f"  error: {result.get('error') or result.get('errors') or None}", flush=True)
            results.append(result)
            stop_node(b)  # a SIGSTOPped one is killed here
            start_node(b, started)
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
    parser.add_argument("--delivered", default="20,800", help="tokens delivered before the kill, comma-separated")
    # Far from the end when b dies: the client may read tokens well behind llama-server on a busy machine.
    parser.add_argument("--after", type=int, default=200, help="tokens asked for beyond the delivered ones")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--modes", default="continue", help=f"continue and/or {RESUME_BY_REPLAY}, comma-separated")
    parser.add_argument("--no-vanish", dest="vanish", action="store_false", help="skip the vanished machine")
    parser.add_argument("--no-concurrent", dest="concurrent", action="store_false", help="skip the four streams")
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the default model)")
    parser.add_argument("--threads", type=int, default=None,
                        help="each node's --threads (default: theirs, the machine's physical cores)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    args.delivered = [int(n) for n in args.delivered.split(",")]
    with tempfile.TemporaryDirectory(prefix="mesh-failover-") as tmp:
        results = [r for mode in args.modes.split(",") for r in run_mode(mode, args, Path(tmp))]
    print("\n| mode | case | silence (median) | detect | stop | plan | load | resume |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for case in dict.fromkeys(r["case"] for r in results if r["mode"] == mode):
            rows = [r for r in results if r["mode"] == mode and r["case"] == case and r["silence_s"] is not None]
            silence = f"{statistics.median(r['silence_s'] for r in rows):.2f} s" if rows else "failed"
            phases = [f"{statistics.median(r['phases_s'][p] for r in rows):.2f}" if rows and "phases_s" in rows[0]
                      else "-" for p in PHASES]
            print(f"| {mode} | {case} | {silence} | {' | '.join(phases)} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"when": datetime.now(UTC).isoformat(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
