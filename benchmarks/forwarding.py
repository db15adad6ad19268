"""Forwarding benchmark: a request through a member that forwards it vs. asking the serving node; a model
that fits one node run alone vs. split over three.

(a) forwarding, once per link profile (``--profiles``, names from ``tests/helpers/netns.py``
``LINK_PROFILES``), each on a fresh lab of two hosts: s serves the default model with ``--serve``
(no ``--spread``: it fits, so its llama-server runs alone, no ``--rpc``), f joins s with
``--api-port``. The same streamed request is sent to s's own API (direct) and to f's (forwarded:
f's sidecar sends it to s over an API_FORWARD stream, s's API answers it), alternately, a warm-up
each and then ``--reps`` each. On the delay switch every frame between s and f is held
``delay_ms``, so a forwarded request crosses one added round trip; direct stays inside s.

(b) alone vs. split, on one unshaped lab of three hosts: a, b, and c joining b with ``--serve``
and ``--min-peers 2``; once without ``--spread`` (c's llama-server alone), once with it (the model
split over a, b and c through the mesh). Beside each, a plain ``llama-server`` on c with the argv the
mesh gives its own alone (``llama_server_argv``), no mesh at all; requests alternate between the
mesh's API and it, a warm-up each and then ``--reps`` each.

``--cpus-per-host N`` emulates separate machines on one with enough cores: every host, and the client
beside them, runs on N CPUs of its own (``taskset``), and llama-server on N threads
(``LLAMA_ARG_THREADS``), so one host's work does not take CPU time from another's llama-server the
way it must when every host shares a few cores. (b)'s rpc-servers keep their own default thread
count. Without it (the default) every process shares every CPU.

Every request: ``/v1/completions``, greedy, ``--n-predict`` tokens (``ignore_eos``, so every
answer is that long), ``cache_prompt: false``, streamed. Measured at the client: time to the first
event with text (TTFT) and the decode rate it sees, text events after the first over the time from
the first to the last; and llama-server's own ``timings.predicted_per_second`` from the last event.
Each comparison is given twice: medians of each side, and paired (the median over rounds of the two
requests of one round against each other, which ran back to back).

Run as root: ``.venv/bin/python -m benchmarks.forwarding [--reps N] [--n-predict N]
[--profiles unshaped,20ms] [--skip-split] [--cpus-per-host N] [--json PATH]``. Figures are printed and written as
JSON; nothing is asserted. The issue's targets are shown beside them: forwarding adds at most one
round trip + 10 ms to TTFT and keeps >= 0.97 of the direct decode rate; alone keeps >= 0.97 of
plain llama-server's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.report import failed_row, make_table, publish, stats, wide_console
from benchmarks.setup import (
    QUIC_PORT,
    REPO_ROOT,
    START_TIMEOUT_S,
    TICKET,
    Started,
    attempt,
    cpu_seconds,
    lacks_root,
    node_status,
    quiet,
    resolve_model,
    run_benchmark,
)
from benchmarks.turns import GREEDY, PROMPT, event_text, sse_events
from tests.helpers.waiting import wait_until

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "forwarding.json"
DEFAULT_PROFILES = "unshaped,20ms"
CLIENT = "client"  # CpuSlots' name for the benchmark's client
API_PORT = 8080  # every host is a namespace of its own, so each has its own 8080
PLAIN_API_PORT = 8081
PINGS = 20
CLIENT_TIMEOUT_S = START_TIMEOUT_S + 300
# The targets, shown beside the figures (never asserted).
TTFT_EXTRA_TARGET_MS = 10.0  # forwarded TTFT - direct TTFT <= link RTT + this
DECODE_RATIO_TARGET = 0.97  # forwarded/direct, and alone/plain


# --------------------------------------------------------------------------------------------
# The client: runs inside a host's namespace (``--client SPEC``), prints one JSON object.
# --------------------------------------------------------------------------------------------

def _client(spec: dict[str, Any]) -> dict[str, Any]:
    import httpx

    from benchmarks.links import _ping

    base = f"http://127.0.0.1:{spec['port']}"

    def ready() -> bool:
        try:
            if spec["plain"]:  # a bare llama-server: healthy once its model is loaded
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            models = httpx.get(f"{base}/v1/models", timeout=2).json().get("data", [])
            return any(m.get("status") == "ready" for m in models)  # this node's or a member's
        except (httpx.HTTPError, ValueError):
            return False

    wait_until(ready, START_TIMEOUT_S, f"{base} answers with a ready model")
    body = {"prompt": PROMPT, "max_tokens": spec["n_predict"], "cache_prompt": False, "ignore_eos": True,
            "stream": True, **GREEDY}

    def streamed() -> dict[str, Any]:
        arrivals: list[float] = []
        pieces: list[str] = []
        timings = None
        started = time.perf_counter()
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
            head = time.perf_counter() - started
            r.raise_for_status()
            for chunk in sse_events(r.iter_lines()):
                if "error" in chunk:
                    raise SystemExit(f"the stream ended with an error event: {chunk['error']}")
                text = event_text(chunk)
                if text:
                    arrivals.append(time.perf_counter() - started)
                    pieces.append(text)
                timings = chunk.get("timings", timings)
        ended = time.perf_counter() - started
        return {"head_ms": head * 1000, "ttft_ms": arrivals[0] * 1000, "text_events": len(arrivals),
                "total_ms": ended * 1000,
                "client_decode_tok_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
                "server_decode_tok_s": timings["predicted_per_second"] if timings else None,
                "text": "".join(pieces)}

    out: dict[str, Any] = {"answers": [streamed() for _ in range(spec["requests"])]}
    if spec.get("ping"):
        out["ping_rtt_ms"] = _ping(spec["ping"], PINGS)["rtt_ms"]
    if spec.get("metrics"):
        text = httpx.get(f"{base}/metrics", timeout=10).text
        out["metrics"] = [line for line in text.splitlines() if line.startswith("mesh_forward")]
    return out


# --------------------------------------------------------------------------------------------
# The orchestrator.
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CpuSlots:
    """Where each host's processes and the client run: with ``per_host``, host i (in ``hosts`` order) on
    CPUs [i*N, (i+1)*N) and the client on the next N; without it, anywhere."""

    hosts: tuple[str, ...]
    per_host: int | None = None

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` pinned to ``name``'s CPUs (a host's name, or ``CLIENT``)."""
        if self.per_host is None:
            return argv
        first = (len(self.hosts) if name == CLIENT else self.hosts.index(name)) * self.per_host
        return ["env", f"LLAMA_ARG_THREADS={self.per_host}",
                "taskset", "-c", f"{first}-{first + self.per_host - 1}", *argv]


@dataclass
class Node:
    """A mesh_sidecar node started on a lab host."""

    name: str
    host: Any  # tests.helpers.netns.Host
    home: Path
    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def ticket(self) -> str:
        return wait_until(lambda: TICKET.search(self.text()), 60, f"{self.name} prints a ticket").group(1)


def _start(host, started: Started, workdir: Path, slots: CpuSlots, label: str, *args: str) -> Node:
    home = workdir / label / host.name
    home.mkdir(parents=True)
    log = workdir / f"{label}-{host.name}.out"
    argv = host.exec_argv(*slots.wrap(host.name, [
        sys.executable, "-m", "mesh_sidecar", "--home", str(home), "--name", host.name,
        "--port", str(QUIC_PORT), "--no-mdns", *args]))
    return Node(host.name, host, home, started.popen(f"{label} node {host.name}", argv, log), log)


def _serving(nodes: list[Node], serving: Node, started: Started) -> list[str]:
    """Wait for ``serving``'s model to be ready; note every node's children for the cleanup; the
    ``--rpc`` endpoints its llama-server got (none: alone)."""
    def ready() -> bool:
        for node in nodes:
            if node.proc.poll() is not None:
                raise RuntimeError(f"node {node.name} exited:\n{node.text()[-3000:]}")
        return "API ready" in serving.text()

    wait_until(ready, START_TIMEOUT_S, f"{serving.name} loads the model")
    for node in nodes:
        started.extra_pids += [p["pid"] for p in node_status(node.host, node.home)["processes"]]
    llama = next(p for p in node_status(serving.host, serving.home)["processes"] if p["name"] == "llama-server")
    argv = Path(f"/proc/{llama['pid']}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--rpc") + 1].split(",") if "--rpc" in argv else []


def _ask(host, spec: dict[str, Any], watched: list[tuple[str, subprocess.Popen, Path]],
         slots: CpuSlots) -> dict[str, Any]:
    """Run the client in ``host``'s namespace; on failure, say which watched process died, if one did."""
    argv = host.exec_argv(*slots.wrap(CLIENT, [sys.executable, "-m", "benchmarks.forwarding",
                                               "--client", json.dumps(spec)]))
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, timeout=CLIENT_TIMEOUT_S)
    if done.returncode != 0:
        dead = [f"{name} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
                for name, proc, log in watched if proc.poll() is not None]
        raise RuntimeError(f"client in {host.name} failed ({done.returncode}):\n{done.stderr[-3000:]}\n"
                           + "\n".join(dead))
    return json.loads(done.stdout)


def _watched(nodes: list[Node]) -> list[tuple[str, subprocess.Popen, Path]]:
    return [(f"node {n.name}", n.proc, n.log) for n in nodes]


def _summary(answers: list[dict[str, Any]]) -> dict[str, Any]:
    server = [a["server_decode_tok_s"] for a in answers if a["server_decode_tok_s"] is not None]
    return {"head_ms": stats([a["head_ms"] for a in answers]), "ttft_ms": stats([a["ttft_ms"] for a in answers]),
            "client_decode_tok_s": stats([a["client_decode_tok_s"] for a in answers]),
            "server_decode_tok_s": stats(server) if server else None,
            "text_events": [a["text_events"] for a in answers],
            "texts_all_identical": len({a["text"] for a in answers}) == 1}


def _alternate(sides: dict[str, tuple[Any, dict[str, Any]]], reps: int, watched: list, slots: CpuSlots,
               sidecars: tuple[Node, ...] = ()) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, float]]]:
    """``sides``: name -> (host, client spec). A warm-up request to each (its client also waits for the
    model), then ``reps`` rounds of one request to each in turn, so a drift in the machine's speed
    touches every side alike. Returns every side's answers, and the CPU ms each of ``sidecars``
    spent during each side's requests."""
    for host, spec in sides.values():
        _ask(host, {**spec, "requests": 1}, watched, slots)
    answers: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    cpu_ms = {side: {n.name: 0.0 for n in sidecars} for side in sides}
    for _ in range(reps):
        for side, (host, spec) in sides.items():
            before = {n.name: cpu_seconds(n.proc.pid) for n in sidecars}
            answers[side] += _ask(host, {**spec, "requests": 1}, watched, slots)["answers"]
            for n in sidecars:
                cpu_ms[side][n.name] += 1000 * (cpu_seconds(n.proc.pid) - before[n.name])
    return answers, cpu_ms


def _median_ratio(over: dict[str, Any], under: dict[str, Any], figure: str) -> float | None:
    if not over[figure] or not under[figure]:
        return None
    return over[figure]["median"] / under[figure]["median"]


def _paired(over: list[dict[str, Any]], under: list[dict[str, Any]], figure: str, ratio: bool) -> float:
    """The median over rounds of one side's figure against the other's in the same round (ratio, or
    difference): the two requests of a round ran back to back, so a drift in the machine's speed
    (other tenants, clocks) falls on both, where medians of each side apart keep it."""
    return statistics.median(o[figure] / u[figure] if ratio else o[figure] - u[figure]
                             for o, u in zip(over, under, strict=True))


def run_forwarding(profile: str, spec: dict[str, Any], workdir: Path, started: Started,
                   cpus_per_host: int | None) -> dict[str, Any]:
    """(a) on a fresh lab with this link profile: s serves alone, f forwards; direct and forwarded alternate."""
    from tests.helpers.netns import LINK_PROFILES, Lab

    began = datetime.now(UTC).isoformat(timespec="seconds")
    lab = Lab(**LINK_PROFILES[profile], sniff=False)  # the sniffer's per-frame loop would compete for the CPU
    try:
        slots = CpuSlots(("s", "f"), cpus_per_host)
        hosts = {name: lab.add_host(name) for name in slots.hosts}
        print(f"[{profile}] forwarding: s serves alone, f joins it (logs in {workdir})...", flush=True)
        s = _start(hosts["s"], started, workdir, slots, profile, "--serve", str(API_PORT), "--speculation", "off")
        f = _start(hosts["f"], started, workdir, slots, profile, "--join", s.ticket(), "--api-port", str(API_PORT))
        rpc = _serving([s, f], s, started)
        watched = _watched([s, f])
        request = {**spec, "port": API_PORT, "plain": False}
        answers, cpu_ms = _alternate({"direct": (s.host, request), "forwarded": (f.host, request)}, spec["reps"],
                                     watched, slots, (s, f))
        probe = _ask(f.host, {**request, "requests": 0, "ping": s.host.ip, "metrics": True}, watched, slots)
        peer = next(p for p in node_status(f.host, f.home)["peers"] if p["name"] == "s")
    finally:
        started.stop_all()
        lab.close()
    entry: dict[str, Any] = {
        "profile": profile, "link": LINK_PROFILES[profile], "began": began,
        "ended": datetime.now(UTC).isoformat(timespec="seconds"), "loadavg_1min_at_end": os.getloadavg()[0],
        "serving_rpc_endpoints": rpc,
        "ping_rtt_ms": stats(probe["ping_rtt_ms"]), "mesh_rtt_p50_ms": peer["rtt_p50_ms"],
        "f_metrics": probe["metrics"], "raw": answers,
    }
    for side, side_answers in answers.items():
        tokens = sum(a["text_events"] for a in side_answers)
        entry[side] = {**_summary(side_answers),
                       "sidecar_cpu_ms_per_token": {n: ms / tokens for n, ms in cpu_ms[side].items()}}
    d, fw = entry["direct"], entry["forwarded"]
    entry["ttft_extra_ms"] = fw["ttft_ms"]["median"] - d["ttft_ms"]["median"]
    entry["head_extra_ms"] = fw["head_ms"]["median"] - d["head_ms"]["median"]
    entry["ttft_extra_bound_ms"] = entry["ping_rtt_ms"]["median"] + TTFT_EXTRA_TARGET_MS
    entry["decode_ratio_forwarded_over_direct"] = _median_ratio(fw, d, "client_decode_tok_s")
    entry["llama_decode_ratio_forwarded_over_direct"] = _median_ratio(fw, d, "server_decode_tok_s")
    entry["paired"] = {"ttft_extra_ms": _paired(answers["forwarded"], answers["direct"], "ttft_ms", ratio=False),
                       "head_extra_ms": _paired(answers["forwarded"], answers["direct"], "head_ms", ratio=False),
                       "decode_ratio": _paired(answers["forwarded"], answers["direct"], "client_decode_tok_s",
                                               ratio=True)}
    entry["texts_identical"] = len({a["text"] for side_answers in answers.values() for a in side_answers}) == 1
    return entry


def run_split(spec: dict[str, Any], workdir: Path, started: Started, binaries, model: Path,
              cpus_per_host: int | None) -> dict[str, Any]:
    """(b) on one unshaped lab of a, b, c: c serves alone, then split with --spread; each alternating with
    a plain llama-server on c."""
    from mesh_sidecar.llama.kv_cache import DEFAULT_CTX_SIZE
    from mesh_sidecar.llama.launch import llama_server_argv
    from tests.helpers.netns import Lab

    began = datetime.now(UTC).isoformat(timespec="seconds")
    lab = Lab(sniff=False)
    entry: dict[str, Any] = {"began": began}
    # The very argv the mesh gives its llama-server alone (no --rpc), without the mesh's key file.
    plain_argv = llama_server_argv(binaries, model, [], PLAIN_API_PORT, extra=["--ctx-size", str(DEFAULT_CTX_SIZE)])
    try:
        slots = CpuSlots(("a", "b", "c"), cpus_per_host)
        hosts = {name: lab.add_host(name) for name in slots.hosts}
        for label, extra in (("alone", ()), ("split", ("--spread",))):
            print(f"[{label}] a, b and c; c serves {'alone' if not extra else 'split over all three'}, "
                  "alternating with a plain llama-server on c...", flush=True)
            a = _start(hosts["a"], started, workdir, slots, label)
            b = _start(hosts["b"], started, workdir, slots, label, "--join", a.ticket())
            c = _start(hosts["c"], started, workdir, slots, label, "--join", b.ticket(), "--serve", str(API_PORT),
                       "--min-peers", "2", "--speculation", "off", "--model", str(model), *extra)
            rpc = _serving([a, b, c], c, started)
            log = workdir / f"{label}-plain-llama-server.out"
            plain = started.popen("plain llama-server", hosts["c"].exec_argv(*slots.wrap("c", plain_argv)), log)
            watched = [*_watched([a, b, c]), ("plain llama-server", plain, log)]
            answers, cpu_ms = _alternate({label: (c.host, {**spec, "port": API_PORT, "plain": False}),
                                          "plain": (c.host, {**spec, "port": PLAIN_API_PORT, "plain": True})},
                                         spec["reps"], watched, slots, (c,))
            started.stop_all()
            mesh, alongside = _summary(answers[label]), _summary(answers["plain"])
            tokens = sum(a["text_events"] for a in answers[label])
            entry[label] = {**mesh, "rpc_endpoints": rpc, "plain": alongside, "raw": answers,
                            "c_sidecar_cpu_ms_per_token": cpu_ms[label]["c"] / tokens,
                            **{f"{figure}_over_plain": _median_ratio(mesh, alongside, figure)
                               for figure in ("client_decode_tok_s", "server_decode_tok_s", "ttft_ms")},
                            "paired_decode_ratio": _paired(answers[label], answers["plain"], "client_decode_tok_s",
                                                           ratio=True)}
    finally:
        started.stop_all()
        lab.close()
    entry["ended"] = datetime.now(UTC).isoformat(timespec="seconds")
    entry["loadavg_1min_at_end"] = os.getloadavg()[0]
    return entry


def _print(report: dict[str, Any]) -> None:
    console = wide_console(160)
    pinned = report["cpus_per_host"]
    head = (f"{report['model']}, {report['n_predict']} tokens, {report['reps']} reps, medians, "
            + (f"{pinned} CPUs a host" if pinned else f"{report['cpu_count']} CPUs shared"))
    if report["forwarding"]:
        table = make_table(f"(a) forwarded through f vs. asking s: {head}",
                           ("profile", "ping RTT ms", "TTFT ms direct", "forwarded", "+ms", "bound ms", "head +ms",
                            "decode tok/s direct", "forwarded", "fwd/direct", "paired", "llama's fwd/direct",
                            "CPU ms/tok s (direct)", "s (fwd)", "f (fwd)", "same text"))
        for e in report["forwarding"]:
            if "error" in e:
                failed_row(table, e["profile"])
                continue
            d, fw = e["direct"], e["forwarded"]
            llama = e.get("llama_decode_ratio_forwarded_over_direct")
            table.add_row(e["profile"], f"{e['ping_rtt_ms']['median']:.2f}",
                          f"{d['ttft_ms']['median']:.1f}", f"{fw['ttft_ms']['median']:.1f}",
                          f"{e['ttft_extra_ms']:+.1f}", f"{e['ttft_extra_bound_ms']:.1f}", f"{e['head_extra_ms']:+.1f}",
                          f"{d['client_decode_tok_s']['median']:.1f}", f"{fw['client_decode_tok_s']['median']:.1f}",
                          f"{e['decode_ratio_forwarded_over_direct']:.3f}", f"{e['paired']['decode_ratio']:.3f}",
                          f"{llama:.3f}" if llama else "-",
                          f"{d['sidecar_cpu_ms_per_token']['s']:.2f}", f"{fw['sidecar_cpu_ms_per_token']['s']:.2f}",
                          f"{fw['sidecar_cpu_ms_per_token']['f']:.2f}", "yes" if e["texts_identical"] else "NO")
        console.print(table)
    split = report.get("split")
    if split and "error" not in split:
        table = make_table(f"(b) a model that fits one node: alone vs. split over three, each alternating with "
                           f"a plain llama-server: {head}",
                           ("setup", "--rpc endpoints", "TTFT ms", "plain", "/plain", "decode tok/s", "plain", "/plain",
                            "paired", "llama's /plain", "c CPU ms/tok", "same text"))
        for label in ("alone", "split"):
            m, p = split[label], split[label]["plain"]
            llama = m["server_decode_tok_s_over_plain"]
            same = len({a["text"] for answers in m["raw"].values() for a in answers}) == 1
            table.add_row(label, str(len(m["rpc_endpoints"])), f"{m['ttft_ms']['median']:.1f}",
                          f"{p['ttft_ms']['median']:.1f}", f"{m['ttft_ms_over_plain']:.3f}",
                          f"{m['client_decode_tok_s']['median']:.1f}", f"{p['client_decode_tok_s']['median']:.1f}",
                          f"{m['client_decode_tok_s_over_plain']:.3f}", f"{m['paired_decode_ratio']:.3f}",
                          f"{llama:.3f}" if llama else "-",
                          f"{m['c_sidecar_cpu_ms_per_token']:.2f}", "yes" if same else "NO")
        console.print(table)
    elif split:
        console.print(f"(b) failed: {split['error']}")
    for line in _targets(report):
        console.print(line, markup=False)


def _targets(report: dict[str, Any]) -> list[str]:
    """The issue's targets against this run's figures, one line each (nothing is asserted)."""
    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    def ttft(extra: float, bound: float) -> str:
        return f"{extra:+.1f} ms: {met(extra <= bound)}"

    def decode(ratio: float) -> str:
        return f"{ratio:.3f}: {met(ratio >= DECODE_RATIO_TARGET)}"

    lines = []
    for e in (e for e in report["forwarding"] if "error" not in e):
        bound, paired = e["ttft_extra_bound_ms"], e["paired"]
        lines.append(f"[{e['profile']}] TTFT forwarded - direct <= RTT + {TTFT_EXTRA_TARGET_MS:g} = {bound:.1f} ms: "
                     f"medians {ttft(e['ttft_extra_ms'], bound)}, paired {ttft(paired['ttft_extra_ms'], bound)}")
        lines.append(f"[{e['profile']}] decode forwarded/direct >= {DECODE_RATIO_TARGET}: medians "
                     f"{decode(e['decode_ratio_forwarded_over_direct'])}, paired {decode(paired['decode_ratio'])}")
    split = report.get("split")
    if split and "error" not in split:
        alone = split["alone"]
        lines.append(f"[alone] decode alone/plain >= {DECODE_RATIO_TARGET}: "
                     f"medians {decode(alone['client_decode_tok_s_over_plain'])}, "
                     f"paired {decode(alone['paired_decode_ratio'])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.forwarding", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--profiles", default=DEFAULT_PROFILES,
                        help=f"link profiles between s and f for (a), comma-separated (default {DEFAULT_PROFILES}; "
                             "'' skips (a))")
    parser.add_argument("--skip-split", action="store_true", help="skip (b), alone vs. split vs. plain")
    parser.add_argument("--cpus-per-host", type=int, metavar="N",
                        help="run each host and the client on N CPUs of their own, llama-server on N threads "
                             "(needs N x 4 CPUs, N x 3 with --skip-split)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        print(json.dumps(_client(json.loads(args.client))))
        return 0

    if lacks_root():
        return 2
    from mesh_sidecar.llama.build import ensure_binaries
    from tests.helpers.netns import LINK_PROFILES

    profiles = [p for p in args.profiles.split(",") if p]
    unknown = [p for p in profiles if p not in LINK_PROFILES]
    if unknown:
        print(f"unknown profile(s) {', '.join(unknown)}; choose from {', '.join(LINK_PROFILES)}", file=sys.stderr)
        return 2
    slots_needed = 3 if args.skip_split else 4  # the hosts of the larger part, and the client
    if args.cpus_per_host is not None and not 0 < args.cpus_per_host * slots_needed <= (os.cpu_count() or 1):
        print(f"--cpus-per-host {args.cpus_per_host} needs {args.cpus_per_host * slots_needed} CPUs "
              f"({slots_needed} slots); this machine has {os.cpu_count()}", file=sys.stderr)
        return 2
    binaries = ensure_binaries(None, quiet)
    model = resolve_model(None)
    spec = {"n_predict": args.n_predict, "reps": args.reps}
    report: dict[str, Any] = {
        "benchmark": "forwarding", "date": datetime.now(UTC).isoformat(timespec="seconds"), "model": model.name,
        "prompt": PROMPT, "n_predict": args.n_predict, "reps": args.reps, "sampling": {**GREEDY, "ignore_eos": True},
        "targets": {"ttft_extra_ms": f"<= link RTT + {TTFT_EXTRA_TARGET_MS:g}",
                    "decode_ratio_forwarded_over_direct": f">= {DECODE_RATIO_TARGET}",
                    "decode_ratio_alone_over_plain": f">= {DECODE_RATIO_TARGET}"},
        "cpu_count": os.cpu_count(), "cpus_per_host": args.cpus_per_host, "forwarding": [], "split": None,
    }
    started = Started()
    workdir = Path(tempfile.mkdtemp(prefix="bench-forwarding-"))

    def body() -> int:
        failed = False
        for profile in profiles:
            entry = attempt(profile, partial(run_forwarding, profile, spec, workdir, started, args.cpus_per_host))
            failed |= "error" in entry
            report["forwarding"].append({"profile": profile, **entry} if "error" in entry else entry)
        if not args.skip_split:
            report["split"] = attempt("split", partial(run_split, spec, workdir, started, binaries, model,
                                                       args.cpus_per_host))
            failed |= "error" in report["split"]
        return publish(report, _print, args.json, failed)

    return run_benchmark(body, started, workdir)


if __name__ == "__main__":
    sys.exit(main())
