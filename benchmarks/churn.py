"""Churn benchmark: requests one after another while workers crash, leave and rejoin.

Three nodes on loopback (distinct ``--home`` and ``--port``, as in
``tests/integration/test_failover.py``): workers a and b, and the serving node c (``--join``
a's ticket, ``--min-peers 2``, ``--serve PORT``). First, undisturbed, one plain
and one streamed reference answer per prompt. Then ``--requests`` requests run
one after another (plain and streamed alternately, a few prompts; greedy, fixed
seed, ``max_tokens`` 64, ``ignore_eos``) while a schedule, every ``--churn-every``
seconds, in turn:

    SIGKILL b (sidecar and rpc-server, like a crash)  -> restart b (same --home, joins a)
    SIGTERM a (a graceful leave, waits for its exit)  -> restart a (same --home, joins b)
    SIGKILL b                                         -> restart b

Each request's outcome:

- ok: HTTP 200, no error event, the reference text, and no failover during it;
- retried: the same, but c's ``mesh_retries_total`` grew during it (the proxy
  retried it or replayed its stream after llama-server died under it);
- continued: the same as retried, but continued from the tokens delivered
  (continuation.py) and the text goes another way than the reference after
  some point: llama.cpp's arithmetic differs between the delivered tokens
  processed as one batch and decoded one by one, so a greedy run may later take
  another near-tie. Not a failure; the tests check the seam is exact;
- refused: HTTP 503 with an OpenAI error, while the mesh was too small for the
  model (what a client should get then, instead of a hang);
- failed: any other HTTP error, an error event in the stream, or a text other than the
  undisturbed reference for its prompt and kind;
- hung: no complete answer within ``--request-timeout`` seconds.

Failover extra latency: a retried request's latency minus the median latency of
undisturbed requests of its kind (the references, and the ok requests answered
by the llama-server that was current when they were sent). Requests that were
ok but waited through a replan (a worker rejoined or left gracefully: c drains,
restarts llama-server, and holds new requests meanwhile) are counted apart, with
their extra latency.

Bounded: stops after ``--requests`` requests or ``--max-seconds`` of churn.
Run: ``.venv/bin/python -m benchmarks.churn [--requests 40] [--max-seconds 240] [--json PATH]``.
Figures are printed and written as JSON; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.loopback_nodes import (
    NODE_READY_TIMEOUT_S,
    Node,
    Spawned,
    free_tcp_port,
    free_udp_port,
    llama_server_pid,
    start_node,
    stop_node,
)
from benchmarks.report import make_table, wide_console, write_report
from benchmarks.setup import REPO_ROOT, START_TIMEOUT_S, quiet, raise_interrupt
from tests.helpers.waiting import wait_until

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "churn.json"
LEAVE_TIMEOUT_S = 60.0  # a graceful leave waits up to 40 s (LEAVE_GRACE_S) for its peers
MAX_TOKENS = 64
SAMPLING = {"temperature": 0, "top_k": 1, "seed": 42, "ignore_eos": True, "cache_prompt": False}
PROMPTS = (
    "The three primary colors are",
    "Write a short story about a lighthouse keeper and a storm.",
    "Explain how a bicycle stays upright while it moves:",
    "List some facts about the planet Mars:",
)
KINDS = ("plain", "stream")
CHURN_CYCLE = (("kill", "b"), ("restart", "b"), ("leave", "a"), ("restart", "a"), ("kill", "b"), ("restart", "b"))
# The clients of requests in flight: closed first on an interrupt, since a request the
# serving node holds (waiting for llama-server) would hold up its own shutdown.
_OPEN_CLIENTS: set[httpx.Client] = set()
COUNTERS = ("mesh_retries_total", "mesh_failovers_total", "mesh_restarts_total", "mesh_members")
CONTINUED = "mesh_streams_resumed_total{how=continued}"  # labelled: scraped by this key


OUTCOMES = ("ok", "retried", "continued", "refused", "failed", "hung")


# --------------------------------------------------------------------------------------------
# The API client.
# --------------------------------------------------------------------------------------------

def scrape(port: int) -> dict[str, float] | None:
    """c's mesh counters, or None if /metrics did not answer."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in COUNTERS and not sample.labels:
                    values[sample.name] = sample.value
                elif sample.name == "mesh_streams_resumed_total" and sample.labels.get("how") == "continued":
                    values[CONTINUED] = sample.value
        return values
    except (httpx.HTTPError, ValueError):
        return None


def _request(port: int, prompt: str, kind: str, timeout: float, result: dict[str, Any],
             clients: list[httpx.Client]) -> None:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, **SAMPLING}
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=10)) as client:
            clients.append(client)
            _OPEN_CLIENTS.add(client)
            url = f"http://127.0.0.1:{port}/v1/completions"
            if kind == "plain":
                r = client.post(url, json=body)
                result["status"] = r.status_code
                if r.status_code != 200:
                    result["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
                    return
                data = r.json()
                result["text"] = data["choices"][0]["text"]
                result["completion_tokens"] = data.get("usage", {}).get("completion_tokens")
                return
            pieces: list[str] = []
            with client.stream("POST", url, json={**body, "stream": True}) as r:
                result["status"] = r.status_code
                if r.status_code != 200:
                    r.read()
                    result["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        result["done"] = True  # read on to the stream's end, as a polite client does
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        result["error"] = f"error event: {json.dumps(event['error'])[:300]}"
                        result["text"] = "".join(pieces)
                        return
                    pieces.append("".join(c.get("text") or "" for c in event.get("choices", [])))
            result["text"] = "".join(pieces)
            if not result.get("done"):
                result["error"] = "stream ended without [DONE]"
    except Exception as exc:  # noqa: BLE001 - every failure is a figure here
        result.setdefault("error", f"{type(exc).__name__}: {exc}")
    finally:
        for client in clients:
            _OPEN_CLIENTS.discard(client)
        result["finished"] = time.monotonic()


def timed_request(port: int, prompt: str, kind: str, timeout: float) -> dict[str, Any]:
    """One request with a wall-clock limit: {latency_s, text, error, hung}."""
    result: dict[str, Any] = {}
    clients: list[httpx.Client] = []
    t0 = time.monotonic()
    worker = threading.Thread(target=_request, args=(port, prompt, kind, timeout, result, clients), daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        for client in clients:
            client.close()  # unblocks the read
        worker.join(10)
        return {"hung": True, "latency_s": time.monotonic() - t0, "error": f"no answer within {timeout:.0f} s"}
    return {"hung": False, "latency_s": result["finished"] - t0, "text": result.get("text"),
            "error": result.get("error"), "status": result.get("status")}


# --------------------------------------------------------------------------------------------
# The churn schedule: a thread that crashes, stops and restarts workers.
# --------------------------------------------------------------------------------------------

class Churn(threading.Thread):
    def __init__(self, nodes: dict[str, Node], started: Spawned, every_s: float, t0: float) -> None:
        super().__init__(daemon=True, name="churn")
        self.nodes, self.started, self.every_s, self.t0 = nodes, started, every_s, t0
        self.stop_event = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.error: str | None = None

    def rel(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        step = 0
        next_at = self.t0 + self.every_s
        try:
            while not self.stop_event.wait(max(0.0, next_at - time.monotonic())):
                action, name = CHURN_CYCLE[step % len(CHURN_CYCLE)]
                step += 1
                began = time.monotonic()
                event: dict[str, Any] = {"action": action, "node": name, "t_start": round(began - self.t0, 2)}
                getattr(self, f"_{action}")(self.nodes[name], event)
                event["t_end"] = round(self.rel(), 2)
                self.events.append(event)
                print(f"  [{event['t_start']:6.1f} s] {action} {name}: "
                      f"{', '.join(f'{k}={v}' for k, v in event.items() if k not in ('action', 'node', 't_start'))}",
                      flush=True)
                next_at = max(began + self.every_s, time.monotonic() + 1.0)
        except Exception as exc:  # noqa: BLE001 - reported, and the benchmark stops
            self.error = f"{type(exc).__name__}: {exc}"
            print(f"  churn stopped: {self.error}", file=sys.stderr, flush=True)

    def _kill(self, node: Node, event: dict[str, Any]) -> None:
        """Like a machine losing power: the sidecar and its rpc-server at once."""
        event["pids"] = [node.proc.pid, node.rpc_pid]
        node.proc.send_signal(signal.SIGKILL)
        try:
            os.kill(node.rpc_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.proc.wait()

    def _leave(self, node: Node, event: dict[str, Any]) -> None:
        """A graceful leave: SIGTERM, and the node waits for its peers to let go."""
        began = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(LEAVE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            event["note"] = f"not gone after {LEAVE_TIMEOUT_S:.0f} s; SIGKILL"
            node.proc.kill()
            node.proc.wait()
        event["exit_code"] = node.proc.returncode
        event["leave_s"] = round(time.monotonic() - began, 2)

    def _restart(self, node: Node, event: dict[str, Any]) -> None:
        """Same home (same identity), same UDP port; join the other worker, or c if it is down."""
        other = self.nodes["a" if node.name == "b" else "b"]
        via = other if other.alive() else self.nodes["c"]
        event["joins"] = via.name
        began = time.monotonic()
        start_node(node, self.started, "--join", via.ticket)
        event["start_s"] = round(time.monotonic() - began, 2)
        # How long until c counts three members again (bounded by the next event).
        c = self.nodes["c"]
        deadline = began + self.every_s - 1.0
        while time.monotonic() < deadline and not self.stop_event.is_set():
            m = scrape(c.serve_port)
            if m and m.get("mesh_members") == 3:
                event["c_sees_3_members_s"] = round(time.monotonic() - began, 2)
                return
            time.sleep(0.5)


# --------------------------------------------------------------------------------------------
# Figures.
# --------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(requests: list[dict], references: list[dict], events: list[dict],
              final: dict[str, float] | None) -> dict[str, Any]:
    counts = {o: sum(r["outcome"] == o for r in requests) for o in OUTCOMES}
    undisturbed = {k: [r["latency_s"] for r in references if r["kind"] == k]
                   + [r["latency_s"] for r in requests if r["kind"] == k and r["outcome"] == "ok"
                      and not r["new_llama_server"]] for k in KINDS}
    baseline = {k: statistics.median(v) if v else None for k, v in undisturbed.items()}

    def extra(rows: list[dict]) -> list[float]:
        return [r["latency_s"] - baseline[r["kind"]] for r in rows if baseline[r["kind"]] is not None]

    retried = [r for r in requests if r["outcome"] in ("retried", "continued")]
    held = [r for r in requests if r["outcome"] == "ok" and r["new_llama_server"]]
    for r in requests:
        if baseline[r["kind"]] is not None:
            r["extra_latency_s"] = round(r["latency_s"] - baseline[r["kind"]], 3)
    fo, rp = extra(retried), extra(held)
    return {
        "requests": len(requests), **counts,
        "ok_held_through_replan": len(held),
        "undisturbed_median_latency_s": baseline,
        "undisturbed_samples": {k: len(v) for k, v in undisturbed.items()},
        "failover_extra_latency_s": {"p50": percentile(fo, 50), "p95": percentile(fo, 95), "n": len(fo)},
        "replan_extra_latency_s": {"p50": percentile(rp, 50), "p95": percentile(rp, 95), "n": len(rp)},
        "churn_events": {a: sum(e["action"] == a for e in events) for a in ("kill", "leave", "restart")},
        "metrics": final,
    }


def _print(report: dict[str, Any]) -> None:
    s = report["summary"]
    console = wide_console(100)

    def sec(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f} s"

    table = make_table(f"churn: {report['model']}, {s['requests']} requests in {report['elapsed_s']:.0f} s, "
                       f"churn every {report['churn_every_s']:.0f} s", ("figure", "value"))
    table.add_row("ok", str(s["ok"]))
    table.add_row("  of which held through a replan", str(s["ok_held_through_replan"]))
    table.add_row("retried (failover during the request)", str(s["retried"]))
    table.add_row("continued, text goes another way after the seam", str(s["continued"]))
    table.add_row("refused: 503 while the mesh was too small", str(s["refused"]))
    table.add_row("failed", str(s["failed"]))
    table.add_row("hung", str(s["hung"]))
    fo, rp = s["failover_extra_latency_s"], s["replan_extra_latency_s"]
    table.add_row(f"failover extra latency p50 / p95 (n={fo['n']})", f"{sec(fo['p50'])} / {sec(fo['p95'])}")
    table.add_row(f"replan-hold extra latency p50 / p95 (n={rp['n']})", f"{sec(rp['p50'])} / {sec(rp['p95'])}")
    b = s["undisturbed_median_latency_s"]
    table.add_row("undisturbed median latency plain / stream", f"{sec(b['plain'])} / {sec(b['stream'])}")
    ev = s["churn_events"]
    table.add_row("churn: kills / graceful leaves / restarts", f"{ev['kill']} / {ev['leave']} / {ev['restart']}")
    table.add_row("c: llama-server start failures (its output)", str(len(report["llama_server_start_failures"])))
    m = s["metrics"] or {}
    for name in ("mesh_failovers_total", "mesh_restarts_total", "mesh_retries_total"):
        table.add_row(name, "?" if name not in m else f"{m[name]:.0f}")
    console.print(table)
    for r in report["requests"]:
        if r["outcome"] in ("failed", "hung"):
            console.print(f"request {r['index']} ({r['kind']}, prompt {r['prompt']}, t={r['t_start']:.1f} s, "
                          f"{r['outcome']}): {r['error']}", highlight=False)


# --------------------------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------------------------

def classify(result: dict[str, Any], reference: str, before: dict | None, after: dict | None) -> dict[str, Any]:
    deltas = {}
    for name in ("mesh_retries_total", "mesh_failovers_total", "mesh_restarts_total"):
        deltas[name.removeprefix("mesh_").removesuffix("_total") + "_delta"] = (
            None if before is None or after is None else after.get(name, 0) - before.get(name, 0))
    continued = None if before is None or after is None else after.get(CONTINUED, 0) - before.get(CONTINUED, 0)
    if result["hung"]:
        outcome = "hung"
    elif result.get("status") == 503 and '"error"' in (result["error"] or ""):
        outcome = "refused"
    elif result["error"]:
        outcome = "failed"
    elif result["text"] != reference and continued:
        outcome = "continued"
    elif result["text"] != reference:
        outcome = "failed"
        result["error"] = f"text differs from the reference: {result['text']!r}"[:400]
    elif deltas["retries_delta"]:
        outcome = "retried"
    else:
        outcome = "ok"
    return {"outcome": outcome, **deltas}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.churn", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-seconds", type=float, default=240.0, help="stop starting requests after this")
    parser.add_argument("--churn-every", type=float, default=12.0, help="seconds between churn events")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--keep-logs", action="store_true", help="keep the node logs even if nothing failed")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO_ROOT))
    from mesh_sidecar.llama.build import ensure_binaries
    from mesh_sidecar.llama.model import ensure_model

    ensure_binaries(None, quiet)
    model = ensure_model(None, quiet)

    signal.signal(signal.SIGTERM, raise_interrupt)  # ends us like Ctrl-C: through the finally below
    started = Spawned()
    workdir = Path(tempfile.mkdtemp(prefix="bench-churn-"))
    nodes = {name: Node(name, workdir / name, free_udp_port(), workdir) for name in "abc"}
    nodes["c"].serve_port = free_tcp_port()
    nodes["c"].args = ("--min-peers", "2")
    churn: Churn | None = None
    keep_logs = True
    try:
        a, b, c = nodes["a"], nodes["b"], nodes["c"]
        print(f"starting a, b, c on loopback (logs in {workdir})...", flush=True)
        start_node(a, started)
        start_node(b, started, "--join", a.ticket)
        start_node(c, started, "--join", a.ticket)

        def api_ready() -> bool:
            for node in nodes.values():
                if not node.alive():
                    raise RuntimeError(f"node {node.name} exited:\n{node.log.read_text(errors='replace')[-3000:]}")
            try:
                return httpx.get(f"http://127.0.0.1:{c.serve_port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(api_ready, START_TIMEOUT_S, "c loads the model through the mesh")
        port = c.serve_port

        print("references (undisturbed)...", flush=True)
        timed_request(port, PROMPTS[0], "plain", args.request_timeout)  # warm-up
        references: list[dict[str, Any]] = []
        ref_text: dict[tuple[int, str], str] = {}
        for p, prompt in enumerate(PROMPTS):
            for kind in KINDS:
                r = timed_request(port, prompt, kind, args.request_timeout)
                if r["hung"] or r["error"]:
                    raise RuntimeError(f"undisturbed reference request failed: {r['error']}")
                ref_text[(p, kind)] = r["text"]
                references.append({"prompt": p, "kind": kind, "latency_s": r["latency_s"], "text": r["text"]})
        refs_agree = all(ref_text[(p, "plain")] == ref_text[(p, "stream")] for p in range(len(PROMPTS)))

        print(f"{args.requests} requests while workers churn every {args.churn_every:.0f} s...", flush=True)
        t0 = time.monotonic()
        churn = Churn(nodes, started, args.churn_every, t0)
        churn.start()
        requests: list[dict[str, Any]] = []
        for i in range(args.requests):
            if time.monotonic() - t0 > args.max_seconds or churn.error:
                break
            kind, p = KINDS[i % 2], (i // 2) % len(PROMPTS)
            before = scrape(port)
            pid_before = llama_server_pid(c.home)
            t_start = time.monotonic() - t0
            r = timed_request(port, PROMPTS[p], kind, args.request_timeout)
            after = scrape(port)
            row = {"index": i, "kind": kind, "prompt": p, "t_start": round(t_start, 2),
                   "latency_s": round(r["latency_s"], 3), **classify(r, ref_text[(p, kind)], before, after),
                   "error": r["error"], "status": r.get("status")}
            # Was this request answered by another llama-server than the one current when it was
            # sent (or than none: c was between two)? The counters cannot tell: a replan's restart
            # is counted when the old llama-server stops, often just before this request arrives
            # (and is held), and a llama-server that fails to start is not counted at all.
            pid_after = llama_server_pid(c.home)
            row["llama_server_pid"] = [pid_before, pid_after]
            row["new_llama_server"] = pid_after is not None and pid_after != pid_before
            row["events_during"] = [f"{e['action']} {e['node']}" for e in churn.events
                                    if t_start <= e["t_start"] <= t_start + r["latency_s"]]
            requests.append(row)
            print(f"  [{t_start:6.1f} s] #{i:<3} {kind:6} {row['outcome']:8} {r['latency_s']:6.2f} s"
                  + (f"  {r['error']}" if r["error"] else ""), flush=True)
        elapsed = time.monotonic() - t0
        churn.stop_event.set()
        churn.join(LEAVE_TIMEOUT_S + NODE_READY_TIMEOUT_S)
        final = scrape(port)
        start_failures = [line for line in c.log.read_text(errors="replace").splitlines()
                          if line.startswith("llama-server failed to start")]

        report = {
            "benchmark": "churn",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "model": model.name,
            "cpu_count": os.cpu_count(),
            "prompts": list(PROMPTS),
            "max_tokens": MAX_TOKENS,
            "sampling": SAMPLING,
            "requests_asked": args.requests,
            "max_seconds": args.max_seconds,
            "churn_every_s": args.churn_every,
            "request_timeout_s": args.request_timeout,
            "elapsed_s": elapsed,
            "references_plain_equals_stream": refs_agree,
            "summary": summarize(requests, references, churn.events, final),
            "churn_error": churn.error,
            "llama_server_start_failures": start_failures,
            "events": churn.events,
            "references": references,
            "requests": requests,
            "logs": str(workdir),
        }
        _print(report)
        if churn.error:
            print(f"churn schedule stopped early: {churn.error}")
        write_report(report, args.json)
        s = report["summary"]
        keep_logs = bool(args.keep_logs or s["failed"] or s["hung"] or churn.error)
        if keep_logs:
            print(f"node logs kept in {workdir}")
        return 0
    except KeyboardInterrupt:
        print(f"interrupted; cleaning up (logs in {workdir})", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # cleaning up is not interrupted
        for client in list(_OPEN_CLIENTS):
            client.close()
        if churn is not None:
            churn.stop_event.set()
            churn.join(LEAVE_TIMEOUT_S + NODE_READY_TIMEOUT_S)
        c = nodes["c"]
        if c.alive():
            try:
                started.remember([p["pid"] for p in c.status()["processes"]])  # its current llama-server
            except Exception:  # noqa: BLE001 - the kill below still stops what we know of
                pass
        stop_node(c)  # the serving node first: then the workers leave without waiting for it
        for node in (nodes["a"], nodes["b"]):
            stop_node(node)
        started.kill_leftovers()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if not keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
