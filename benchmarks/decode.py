"""Decode benchmark: the same three hosts, stock llama.cpp RPC over TCP vs. the QUIC mesh.

Three hosts a, b and c live in network namespaces on one bridge (``tests/helpers/netns.py``).
Two setups split the same model over the same three hosts, in the same order, and
answer the same greedy prompt from host c:

- mesh: three ``mesh_sidecar`` nodes as in ``tests/integration/test_mesh_netns.py`` (a works,
  b joins a, c joins b and serves the API on :8080 with ``--min-peers 2``);
- direct: a ``ggml-rpc-server`` on every host, listening on the host's address (the stock
  way, over TCP, only inside this private lab) with that mesh node's own rpc-server argv
  (binary, threads, devices, cache), and on c a ``llama-server`` with the mesh's own
  llama-server argv (binary, ``--tensor-split``, context size, flags), its ``--rpc``
  listing the same hosts in the same order over TCP.

With ``--loopback`` the three hosts are names on this machine's loopback instead
(ports of their own, no namespaces, no root, unshaped only): for a GPU machine
without namespaces, where the nodes use the backend ``setup --backend`` built and the
direct rpc-servers the same build.

The mesh starts first (its order is only known once it runs: it sorts peers by
node id, and the ids are new every run), then the direct setup beside it, and the
two take turns: one warm-up request each, then ``--reps`` rounds, each a plain
``/v1/completions`` request (llama-server's ``timings``) and a streamed request
(time to the first SSE chunk with text) to one setup, then the same to the other,
the first setup first in even rounds and last in odd ones (ABBA), so the machine's
drift between minutes hits both alike; all with ``cache_prompt: false`` so every
request evaluates the prompt. The idle setup stays up meanwhile: direct's idle
processes only wait, the mesh's sidecars keep their heartbeats and gossip, and the
report gives that CPU per direct token (``mesh_sidecar_cpu_ms_per_direct_token``).
With ``--streams N`` (at most llama-server's 4 automatic slots) the two then take
turns sending N different prompts at once, a warm-up round and ``--reps`` timed
rounds: their generated tokens over the round's wall time is the aggregate decode
rate. Each report entry holds the mesh/direct ratios of the medians (decode tok/s,
TTFT, aggregate tok/s) and, with ``--b2b``, b2b over stock mesh. The setups of
``--b2b`` and ``--quic`` run alone afterwards, each compared with the paired
direct's figures.

The comparison runs once per link profile (``--profiles``, names from
``tests/helpers/netns.py`` ``LINK_PROFILES``), each on a fresh lab: the plain bridge, tbf
rate limits on every link, or the delay switch that holds every frame between
hosts for a fixed time (both setups cross it alike).

Run as root: ``.venv/bin/python -m benchmarks.decode [--reps N] [--n-predict N]
[--profiles unshaped,1gbit,100mbit,5ms,20ms] [--model PATH|bench-1gb] [--json PATH] [--b2b]
[--streams N]``, or without root with ``--loopback`` (instead of ``--profiles``). With
``--b2b`` a third setup runs: the mesh with every node on the b2b build.
Figures are printed and written as JSON; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from tests.helpers.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "decode.json"
DEFAULT_PROFILES = "unshaped,1gbit,100mbit,5ms,20ms"
QUIC_PORT = 47470
MESH_API_PORT = 8080
DIRECT_API_PORT = 8081
WORKER_API_PORT = 8090  # a's (b's the next): every node has an API, and on --loopback they share 127.0.0.1
DIRECT_RPC_PORT = 50052
START_TIMEOUT_S = 180.0
GREEDY = {"temperature": 0, "top_k": 1, "seed": 42}
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into one workshop process. "
    "Explain in a few paragraphs how this invention changed the way knowledge spread across Europe:"
)
# ``--streams``: that many of these at once (the first is PROMPT), each a different text of about
# PROMPT's length, so every slot evaluates a prompt of its own.
STREAM_PROMPTS = (
    PROMPT,
    "The steam engine did not appear all at once: Newcomen's atmospheric pump drained mines for decades "
    "before James Watt added a separate condenser and made it efficient enough for mills. Describe in a "
    "few paragraphs how steam power reshaped the factories and towns of Britain:",
    "Long before satellites, sailors crossed oceans with a compass, a log line and the stars, and the "
    "marine chronometer finally let them fix their longitude at sea. Explain in a few paragraphs why "
    "measuring time precisely was the key to finding a ship's position:",
    "Vaccination began with Edward Jenner's observation that milkmaids who caught cowpox were spared "
    "from smallpox, and within two centuries the disease was gone from the world. Describe in a few "
    "paragraphs how vaccines teach the immune system to recognise a threat:",
)
# Neither llama-server is given --parallel: both run with the pinned build's automatic slot count
# (its log: "initializing, n_slots = 4"). More streams than slots would queue in llama-server and
# time its queue, not the links.
LLAMA_SERVER_AUTO_SLOTS = 4
_TICKET = re.compile(r"Node ticket: (meshinf[a-z2-7]+)")


# --------------------------------------------------------------------------------------------
# The client: runs inside a host's namespace (``--client SPEC``), prints one JSON object.
# --------------------------------------------------------------------------------------------

def _client(spec: dict[str, Any]) -> dict[str, Any]:
    """Every setup in ``spec["sides"]`` (label -> port, optional status_home and cpu_pids), its
    requests taking turns with the others' (ABBA: the first setup first in even rounds, last in odd
    ones), so the machine's drift hits each alike; returns label -> that setup's result."""
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    sides: dict[str, dict[str, Any]] = spec["sides"]
    bases = {label: f"http://127.0.0.1:{side['port']}" for label, side in sides.items()}
    body = {"prompt": spec["prompt"], "max_tokens": spec["n_predict"], "cache_prompt": False, **GREEDY}

    deadline = time.monotonic() + START_TIMEOUT_S
    for base in bases.values():
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{base}/health not 200 within {START_TIMEOUT_S} s")
            time.sleep(0.2)

    def plain(label: str, prompt: str = spec["prompt"]) -> dict[str, Any]:
        started = time.perf_counter()
        r = httpx.post(f"{bases[label]}/v1/completions", json={**body, "prompt": prompt}, timeout=600)
        r.raise_for_status()
        data = r.json()
        timings = data.get("timings")
        if timings is None:
            raise SystemExit(f"/v1/completions returned no timings: {sorted(data)}")
        # Beside timings' prompt_ms + predicted_ms: what the request spent outside llama-server's work.
        return {"text": data["choices"][0]["text"], "completion_tokens": data["usage"]["completion_tokens"],
                "prompt_tokens": data["usage"]["prompt_tokens"], "timings": timings,
                "elapsed_ms": (time.perf_counter() - started) * 1000}

    def streamed(label: str) -> dict[str, Any]:
        ttft = None
        pieces: list[str] = []
        started = time.perf_counter()
        with httpx.stream("POST", f"{bases[label]}/v1/completions", json={**body, "stream": True},
                          timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                if text and ttft is None:
                    ttft = (time.perf_counter() - started) * 1000
                pieces.append(text)
        return {"ttft_ms": ttft, "text": "".join(pieces)}

    def status(label: str) -> dict[str, Any] | None:
        if not sides[label].get("status_home"):
            return None
        out = subprocess.run([sys.executable, "-m", "mesh_sidecar", "status", "--home",
                              sides[label]["status_home"], "--json"],
                             capture_output=True, text=True, check=True, timeout=60)
        return json.loads(out.stdout)

    def concurrent(label: str, prompts: list[str]) -> dict[str, Any]:
        """One plain request per prompt, all at once: the wall time until the last answer is in."""
        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(partial(plain, label), prompts))
        return {"wall_s": time.perf_counter() - started, "streams": answers}

    # Each setup's processes' CPU (cpu_pids: name -> pid) over its own turns, and over the others'
    # turns: what an idle setup took from the one measured.
    own: dict[str, Counter[str]] = {label: Counter() for label in sides}
    beside: dict[str, Counter[str]] = {label: Counter() for label in sides}

    def cpu_now() -> dict[str, dict[str, float]]:
        return {label: {name: cpu_seconds(pid) for name, pid in side.get("cpu_pids", {}).items()}
                for label, side in sides.items()}

    def turn(label: str, request: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        before = cpu_now()
        answer = request()
        for other, after in cpu_now().items():
            for name, seconds in after.items():
                (own if other == label else beside)[other][name] += seconds - before[other][name]
        return answer

    def rounds() -> list[list[str]]:
        labels = list(sides)
        return [labels if i % 2 == 0 else labels[::-1] for i in range(spec["reps"])]

    if spec.get("stream_prompts"):  # the concurrent phase, a client call of its own (see _run_streams)
        prompts = spec["stream_prompts"]
        for label in sides:
            concurrent(label, prompts)  # warm-up
        reps: dict[str, list[dict[str, Any]]] = {label: [] for label in sides}
        for order in rounds():
            for label in order:
                reps[label].append(concurrent(label, prompts))
        return {label: {"reps": reps[label]} for label in sides}

    def warm_up(label: str) -> dict[str, Any]:
        answer = plain(label)
        streamed(label)
        return answer

    warmups = {label: turn(label, partial(warm_up, label)) for label in sides}
    before = {label: status(label) for label in sides}
    reps = {label: [] for label in sides}

    def rep(label: str) -> dict[str, Any]:
        answer = plain(label)
        s = streamed(label)
        return {**answer, "ttft_ms": s["ttft_ms"], "stream_text": s["text"]}

    for order in rounds():
        for label in order:
            reps[label].append(turn(label, partial(rep, label)))
    return {label: {"warmup_text": warmups[label]["text"], "reps": reps[label], "status_before": before[label],
                    "status_after": status(label), "cpu_s": dict(own[label]),
                    "cpu_s_beside": dict(beside[label])}
            for label in sides}


# --------------------------------------------------------------------------------------------
# The orchestrator: lab, processes, figures.
# --------------------------------------------------------------------------------------------

def _quiet(message: str, done: int, total: int) -> None:
    pass


def terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns once the process is gone."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Started:
    """Every process this run started, stopped by pid (last started, first stopped)."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    extra_pids: list[int] = field(default_factory=list)

    def popen(self, name: str, argv: list[str], log: Path) -> subprocess.Popen:
        # A session of its own: a terminal's Ctrl-C reaches only us, and we stop them in order.
        proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def stop_all(self) -> None:
        while self.procs:
            _, proc = self.procs.pop()
            terminate(proc, 30)
        for pid in self.extra_pids:  # a node's children, should the node not have stopped them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.extra_pids.clear()


Watched = list[tuple[str, subprocess.Popen, Path]]


def _run_client(host, spec: dict[str, Any], sides: dict[str, dict[str, Any]], watched: Watched) -> dict:
    """Run the client in ``host``'s namespace against ``sides`` (label -> port, optional status_home
    and cpu_pids), their requests taking turns; label -> result. Gives up if a watched process dies."""
    argv = host.exec_argv(sys.executable, "-m", "benchmarks.decode", "--client",
                          json.dumps({**spec, "sides": sides}))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        while proc.poll() is None:
            for name, child, log in watched:
                if child.poll() is not None:
                    raise RuntimeError(f"{name} exited with {child.returncode}:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"client in {host.name} failed ({proc.returncode}):\n{err[-3000:]}")
    return json.loads(out)


def _run_streams(host, spec: dict[str, Any], sides: dict[str, dict[str, Any]], watched: Watched) -> dict:
    """With ``spec["streams"]``, that many prompts sent at once, ``spec["reps"]`` times after a warm-up,
    per side (label -> result, or None without). A client call after the single-stream one, so the
    tunnel, RPC command and CPU counts per token stay those of one stream."""
    if not spec.get("streams"):  # other benchmarks' specs (speculative.py) have none
        return dict.fromkeys(sides)
    prompts = list(STREAM_PROMPTS[:spec["streams"]])
    return _run_client(host, {**spec, "stream_prompts": prompts}, sides, watched)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status(host, home: Path) -> dict[str, Any]:
    out = subprocess.run(host.exec_argv(sys.executable, "-m", "mesh_sidecar", "status", "--home", str(home),
                                        "--json"), capture_output=True, text=True, check=True, timeout=60,
                         cwd=REPO_ROOT)
    return json.loads(out.stdout)


def _listening(host, port: int) -> bool:
    out = subprocess.run(host.exec_argv("ss", "-Hltn", f"sport = :{port}"), capture_output=True, text=True)
    return bool(out.stdout.strip())


@dataclass(frozen=True)
class LoopbackHost:
    """A host of ``--loopback``: a name on this machine's loopback, no namespace (no root needed)."""

    name: str
    ip: str = "127.0.0.1"

    def exec_argv(self, *argv: str) -> list[str]:
        return list(argv)


def host_port(base: int, name: str) -> int:
    """``base`` for host a, the next for b, ...: hosts sharing loopback need ports of their own."""
    return base + "abc".index(name)


def direct_rpc_argv(mesh_argv: list[str], host: str, port: int) -> list[str]:
    """A mesh node's own rpc-server argv (binary, threads, devices), listening on ``host``:``port``."""
    argv = list(mesh_argv)
    argv[argv.index("-H") + 1] = host
    argv[argv.index("-p") + 1] = str(port)
    return argv


def direct_llama_argv(mesh_argv: list[str], endpoints: list[str], port: int) -> list[str]:
    """The mesh's own llama-server argv (binary, split, flags), with ``endpoints`` over TCP instead of
    the tunnels, ``port``, and no API key."""
    argv = list(mesh_argv)
    argv[argv.index("--rpc") + 1] = ",".join(endpoints)
    argv[argv.index("--port") + 1] = str(port)
    if "--api-key-file" in argv:
        at = argv.index("--api-key-file")
        del argv[at:at + 2]
    return argv


@dataclass
class MeshSetup:
    """Three running mesh nodes, c serving the API on :8080; what measuring it needs."""

    hosts: dict[str, Any]
    homes: dict[str, Path]
    procs: dict[str, tuple[subprocess.Popen, Path]]
    order: list[str]
    info: dict[str, Any]  # rpc_list, order, c's llama_server_argv, each node's rpc_server_argv
    commands_before: dict[str, int]  # RPC commands each worker had from c once started

    @property
    def watched(self) -> Watched:
        return [(f"mesh node {n}", p, log) for n, (p, log) in self.procs.items()]

    def side(self) -> dict[str, Any]:
        """The client's view: the API, c's home for status, and the sidecars whose CPU to count
        (Python QUIC, relaying: on a machine whose cores the llama.cpp processes share, it is time
        their compute waits for)."""
        return {"port": MESH_API_PORT, "status_home": str(self.homes["c"]),
                "cpu_pids": {n: proc.pid for n, (proc, _) in self.procs.items()}}

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """``result`` with the RPC commands c has sent each worker since the mesh started."""
        result["rpc_commands"] = {n: _commands(self.hosts[n], self.homes[n]) - self.commands_before[n] for n in "ab"}
        return result


def _commands(host, home: Path) -> int:
    """The RPC commands a worker has had from c: counted where they arrive, its row for c."""
    return _commands_from_c(_status(host, home))


def start_mesh(lab_hosts, started: Started, workdir: Path, model: Path | None = None,
               serve_args: tuple[str, ...] = (), label: str = "mesh",
               node_args: tuple[str, ...] = ()) -> MeshSetup:
    """Start a, b, c as in the netns test, each with ``node_args`` (c serves `model`, by default the
    default one, with ``serve_args``); returns once c's llama-server runs, with its rpc order."""
    homes = {name: workdir / label / name for name in "abc"}

    def start(name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        homes[name].mkdir(parents=True)
        log = workdir / f"{label}-{name}.out"
        # One rpc-server thread a node: the three share this machine's cores (direct's take the same argv).
        argv = lab_hosts[name].exec_argv(sys.executable, "-m", "mesh_sidecar", "--home", str(homes[name]),
                                         "--name", name, "--port", str(host_port(QUIC_PORT, name)), "--threads", "1",
                                         *node_args,
                                         *args)
        return started.popen(f"mesh node {name}", argv, log), log

    def ticket(log: Path) -> str:
        return wait_until(lambda: _TICKET.search(log.read_text(errors="replace")), 60, "a ticket").group(1)

    procs = {}
    procs["a"] = start("a", "--api-port", str(host_port(WORKER_API_PORT, "a")))
    t_a = ticket(procs["a"][1])
    procs["b"] = start("b", "--join", t_a, "--api-port", str(host_port(WORKER_API_PORT, "b")))
    t_b = ticket(procs["b"][1])
    procs["c"] = start("c", "--join", t_b, "--serve", str(MESH_API_PORT), "--spread", "--min-peers", "2",
                       *(["--model", str(model)] if model is not None else []), *serve_args)

    def api_ready() -> bool:
        for name, (proc, log) in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"mesh node {name} exited:\n{log.read_text()[-3000:]}")
        return "API ready" in procs["c"][1].read_text(errors="replace")

    wait_until(api_ready, START_TIMEOUT_S, "c loads the model through the mesh")
    rpc_server_argv = {}
    for name in "abc":
        processes = _status(lab_hosts[name], homes[name])["processes"]
        started.extra_pids += [p["pid"] for p in processes]
        rpc_server_argv[name] = _cmdline(next(p["pid"] for p in processes if p["name"] == "ggml-rpc-server"))

    def llama_server_running() -> tuple[dict, list[str]] | None:
        # A replan right after the first load (free memory moved) restarts llama-server: wait for the next.
        status = _status(lab_hosts["c"], homes["c"])
        llama = next((p for p in status["processes"] if p["name"] == "llama-server" and p["running"]), None)
        try:
            return None if llama is None else (status, _cmdline(llama["pid"]))
        except FileNotFoundError:
            return None

    status, argv = wait_until(llama_server_running, START_TIMEOUT_S, "c's llama-server running")
    rpc_list = argv[argv.index("--rpc") + 1].split(",")
    by_port = {p["tunnel_port"]: p["name"] for p in status["peers"]}
    by_port[next(p["port"] for p in status["processes"] if p["name"] == "ggml-rpc-server")] = "c"
    order = [by_port[int(e.rsplit(":", 1)[1])] for e in rpc_list]
    info = {"rpc_list": rpc_list, "order": order, "llama_server_argv": argv, "rpc_server_argv": rpc_server_argv}
    return MeshSetup(lab_hosts, homes, procs, order, info, {n: _commands(lab_hosts[n], homes[n]) for n in "ab"})


def _cmdline(pid: int) -> list[str]:
    """A running process's argv, as its kernel has it."""
    return [arg.decode() for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if arg]


def run_mesh(lab_hosts, started: Started, workdir: Path, spec: dict[str, Any],
             model: Path | None = None, serve_args: tuple[str, ...] = (),
             label: str = "mesh", node_args: tuple[str, ...] = ()) -> tuple[dict, list[str], dict]:
    """``start_mesh``, then measure it alone through c's :8080; (client result, order, info)."""
    mesh = start_mesh(lab_hosts, started, workdir, model, serve_args, label, node_args)
    sides = {"mesh": mesh.side()}
    result = mesh.finish(_run_client(lab_hosts["c"], spec, sides, mesh.watched)["mesh"])
    result["concurrent"] = _run_streams(lab_hosts["c"], spec, sides, mesh.watched)["mesh"]
    return result, mesh.order, mesh.info


@dataclass
class DirectSetup:
    """llama.cpp's own way: rpc-servers over TCP, llama-server on c serving :8081."""

    watched: Watched
    info: dict[str, Any]

    def side(self) -> dict[str, Any]:
        return {"port": DIRECT_API_PORT}


def start_direct(lab_hosts, started: Started, workdir: Path, order: list[str],
                 mesh_info: dict[str, Any]) -> DirectSetup:
    """An rpc-server on each host and, on c, llama-server over TCP in ``order``, every process on a
    running mesh's own argv (``mesh_info``: binary, threads, devices, split), but over TCP."""
    watched, rpc_argvs = [], {}
    for name in "abc":
        host, port = lab_hosts[name], host_port(DIRECT_RPC_PORT, name)
        rpc_argvs[name] = direct_rpc_argv(mesh_info["rpc_server_argv"][name], host.ip, port)
        log = workdir / f"direct-rpc-{name}.out"
        watched.append((f"direct rpc-server {name}", started.popen(f"rpc {name}", host.exec_argv(*rpc_argvs[name]),
                                                                    log), log))
    for name in "abc":
        wait_until(partial(_listening, lab_hosts[name], host_port(DIRECT_RPC_PORT, name)), 30,
                   f"rpc-server on {name} listens")
    endpoints = [f"{lab_hosts[n].ip}:{host_port(DIRECT_RPC_PORT, n)}" for n in order]
    # The very argv the mesh gives its llama-server, but with TCP endpoints instead of tunnels.
    llama_argv = direct_llama_argv(mesh_info["llama_server_argv"], endpoints, DIRECT_API_PORT)
    argv = lab_hosts["c"].exec_argv(*llama_argv)
    log = workdir / "direct-llama-server.out"
    watched.append(("direct llama-server", started.popen("direct llama-server", argv, log), log))
    return DirectSetup(watched, {"rpc_list": endpoints, "order": order, "llama_server_argv": llama_argv,
                                 "rpc_server_argv": rpc_argvs})


def run_direct(lab_hosts, started: Started, workdir: Path, spec: dict[str, Any], order: list[str],
               mesh_info: dict[str, Any]) -> tuple[dict, dict]:
    """``start_direct``, then measure it alone; (client result, info)."""
    direct = start_direct(lab_hosts, started, workdir, order, mesh_info)
    sides = {"direct": direct.side()}
    result = _run_client(lab_hosts["c"], spec, sides, direct.watched)["direct"]
    result["concurrent"] = _run_streams(lab_hosts["c"], spec, sides, direct.watched)["direct"]
    return result, direct.info


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summary(result: dict) -> dict[str, Any]:
    reps = result["reps"]
    texts = {r["text"] for r in reps} | {r["stream_text"] for r in reps} | {result["warmup_text"]}
    summary = {
        "prompt_tokens": reps[0]["prompt_tokens"],
        "completion_tokens": [r["completion_tokens"] for r in reps],
        "prompt_tok_s": _stats([r["timings"]["prompt_per_second"] for r in reps]),
        "decode_tok_s": _stats([r["timings"]["predicted_per_second"] for r in reps]),
        "prompt_ms": _stats([r["timings"]["prompt_ms"] for r in reps]),
        "ttft_ms": _stats([r["ttft_ms"] for r in reps]),
        "text": reps[0]["text"],
        "texts_all_identical": len(texts) == 1,
    }
    if result["concurrent"]:
        summary["streams"] = _streams_summary(result["concurrent"]["reps"])
    return summary


def _streams_summary(reps: list[dict]) -> dict[str, Any]:
    """Aggregate decode rate of the concurrent streams: tokens all of them generated over the wall time
    from sending the first to receiving the last answer (their prompts' evaluation included)."""
    tokens = [[s["timings"]["predicted_n"] for s in r["streams"]] for r in reps]
    return {
        "count": len(reps[0]["streams"]),
        "completion_tokens": tokens,
        "wall_s": _stats([r["wall_s"] for r in reps]),
        "aggregate_tok_s": _stats([sum(t) / r["wall_s"] for t, r in zip(tokens, reps, strict=True)]),
        "texts": [s["text"] for s in reps[0]["streams"]],
    }


def _commands_from_c(status: dict[str, Any]) -> int:
    return next(p["rpc_commands"] for p in status["peers"] if p["name"] == "c")


def _tokens(result: dict) -> int:
    """Tokens generated in the timed repetitions: a plain and a streamed request each."""
    return sum(r["completion_tokens"] for r in result["reps"]) * 2


def _sidecar_cpu_ms_per_token(result: dict, cpu_s: dict[str, float]) -> dict[str, float]:
    """Each node's sidecar CPU (``cpu_s``, over the warm-up and the timed repetitions of ``result``) per token."""
    tokens = _tokens(result) * (len(result["reps"]) + 1) / len(result["reps"])
    return {name: 1000 * seconds / tokens for name, seconds in cpu_s.items()}


def _tunnel_bytes(result: dict) -> dict[str, Any]:
    """Bytes per generated token on each of c's tunnels over the timed repetitions."""
    tokens = _tokens(result)
    before = {p["name"]: p for p in result["status_before"]["peers"]}
    rows = {}
    for peer in result["status_after"]["peers"]:
        b = before[peer["name"]]
        to_peer = peer["bytes_to_peer"] - b["bytes_to_peer"]
        from_peer = peer["bytes_from_peer"] - b["bytes_from_peer"]
        # The command count also covers the warm-up requests: one more round of each.
        tokens_with_warmup = tokens * (len(result["reps"]) + 1) / len(result["reps"])
        rows[f"c<->{peer['name']}"] = {"bytes_to_peer": to_peer, "bytes_from_peer": from_peer,
                                     "tokens": tokens, "to_peer_per_token": to_peer / tokens,
                                     "from_peer_per_token": from_peer / tokens,
                                     "rpc_commands_per_token": result["rpc_commands"][peer["name"]]
                                     / tokens_with_warmup}
    return rows


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    d, m = report["direct"], report["mesh"]
    table = Table(title=f"decode on {report['profile']}: {report['model']}, {report['n_predict']} tokens, "
                        f"{report['reps']} reps, "
                        f"prompt {d['prompt_tokens']} tokens, rpc order {','.join(report['order'])}")
    streams = d.get("streams")
    for col in ("setup", "prompt tok/s (med)", "decode tok/s (med)", "decode min–max", "TTFT ms (med)",
                "decode /direct", "TTFT /direct",
                *((f"{streams['count']} streams tok/s (med)", "streams /direct") if streams else ())):
        table.add_column(col, justify="right" if col != "setup" else "left")
    setups = [("direct", d), ("mesh", m)] + ([("mesh --b2b", report["mesh_b2b"])] if "mesh_b2b" in report else [])

    def over_direct(name: str, s: dict[str, Any], *figure: str) -> str:
        return f"{_ratio({name: s, 'direct': d}, name, 'direct', *figure):.2f}" if name != "direct" else ""

    for name, s in setups:
        table.add_row(name, f"{s['prompt_tok_s']['median']:.1f}", f"{s['decode_tok_s']['median']:.1f}",
                      f"{s['decode_tok_s']['min']:.1f}–{s['decode_tok_s']['max']:.1f}",
                      f"{s['ttft_ms']['median']:.1f}", over_direct(name, s, "decode_tok_s"),
                      over_direct(name, s, "ttft_ms"),
                      *((f"{s['streams']['aggregate_tok_s']['median']:.1f}",
                         over_direct(name, s, "streams", "aggregate_tok_s")) if streams else ()))
    console.print(table)
    if "rounds_mesh_over_direct" in report:
        console.print("mesh/direct round by round (median, quartiles): " + "; ".join(
            f"{name} {r['median']:.2f} ({r['q1']:.2f}-{r['q3']:.2f})"
            for name, r in report["rounds_mesh_over_direct"].items()))
    if "b2b_over_stock" in report:
        console.print(f"decode mesh --b2b / stock mesh: {report['b2b_over_stock']:.2f}")
    tunnels = Table(title="mesh tunnels on c, over the timed repetitions")
    for col in ("tunnel", "bytes c→peer / token", "bytes peer→c / token", "RPC commands / token"):
        tunnels.add_column(col, justify="right" if col != "tunnel" else "left")
    for setup, key in (("", "mesh_tunnels"), (" (--b2b)", "mesh_b2b_tunnels")):
        for name, row in sorted(report.get(key, {}).items()):
            tunnels.add_row(name + setup, f"{row['to_peer_per_token']:,.0f}", f"{row['from_peer_per_token']:,.0f}",
                            f"{row['rpc_commands_per_token']:.1f}")
    console.print(tunnels)
    for setup, key in (("mesh", "mesh_sidecar_cpu_ms_per_token"), ("mesh --b2b", "mesh_b2b_sidecar_cpu_ms_per_token")):
        if key in report:
            console.print(f"{setup}: sidecar CPU ms per token " + ", ".join(
                f"{name} {ms:.2f}" for name, ms in sorted(report[key].items())))
    if "mesh_sidecar_cpu_ms_per_direct_token" in report:
        console.print("the idle mesh's sidecars during direct's turns, CPU ms per direct token " + ", ".join(
            f"{name} {ms:.2f}" for name, ms in sorted(report["mesh_sidecar_cpu_ms_per_direct_token"].items())))
    same = report["greedy_texts_identical"]
    console.print(f"greedy text direct == mesh: {'yes' if same else 'NO'}"
                  f" (every request within each setup identical: direct "
                  f"{'yes' if d['texts_all_identical'] else 'NO'}, mesh {'yes' if m['texts_all_identical'] else 'NO'})")
    if "stream_texts_identical" in report:
        console.print("concurrent streams' greedy text direct == mesh (informational: batched decoding is not "
                      "batch-invariant): " + ", ".join("yes" if s else "no" for s in report["stream_texts_identical"]))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def write_report(report: dict[str, Any], path: Path) -> None:
    """The JSON beside the printed tables."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {path}")


def lacks_root() -> bool:
    """True (after saying so) when this process cannot make network namespaces."""
    if os.geteuid() == 0:
        return False
    print("needs root (network namespaces)", file=sys.stderr)
    return True


def run_benchmark(body: Callable[[], int], started: Started, workdir: Path,
                  *closers: Callable[[], None]) -> int:
    """``body()``'s exit status; Ctrl-C or SIGTERM ends it through the same cleanup: every process
    ``started`` stopped by pid, then ``closers`` (labs) run. ``workdir`` (the runs' logs) is removed
    after a success and kept, and named, otherwise."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        status = body()
        if status == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs kept in {workdir}", file=sys.stderr)
        return status
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        started.stop_all()
        for close in closers:
            close()


def _resolve_model(given: str | None) -> Path:
    """A GGUF path, a synthetic preset's name (made if missing), or None: the default model."""
    from benchmarks.synthetic_model import PRESETS, ensure_synthetic_model
    from mesh_sidecar.llama.model import ensure_model

    if given in PRESETS:
        return ensure_synthetic_model(PRESETS[given])
    return ensure_model(Path(given) if given is not None else None, _quiet)


def run_profile(profile: str, model: Path, spec: dict[str, Any], workdir: Path,
                started: Started, b2b: bool = False, quic: bool = False, loopback: bool = False) -> dict[str, Any]:
    """The mesh, then the direct setup beside it (and with ``b2b`` the mesh on the b2b build, with ``quic`` the
    mesh with ``--data-path quic``), on a fresh lab with this link profile (``loopback``: every host on this
    machine's loopback, unshaped); its report entry."""
    from tests.helpers.netns import LINK_PROFILES, Lab

    workdir.mkdir(parents=True)
    began = datetime.now(UTC).isoformat(timespec="seconds")
    # The sniffer's per-frame loop would compete for the CPU.
    lab = None if loopback else Lab(**LINK_PROFILES[profile], sniff=False)
    try:
        hosts = {name: lab.add_host(name) if lab is not None else LoopbackHost(name) for name in "abc"}
        print(f"[{profile}] mesh: starting a, b, c (logs in {workdir})...", flush=True)
        # Plain decoding on both sides: speculation has its own benchmark (speculative.py).
        mesh = start_mesh(hosts, started, workdir, model, ("--speculation", "off"))
        order = mesh.order
        print(f"[{profile}] direct beside it: rpc-servers on a, b, c over TCP, order {','.join(order)}; "
              "the two take turns...", flush=True)
        direct = start_direct(hosts, started, workdir, order, mesh.info)
        sides, watched = {"mesh": mesh.side(), "direct": direct.side()}, mesh.watched + direct.watched
        paired = _run_client(hosts["c"], spec, sides, watched)
        mesh_result, direct_result = mesh.finish(paired["mesh"]), paired["direct"]
        concurrent = _run_streams(hosts["c"], spec, sides, watched)
        mesh_result["concurrent"], direct_result["concurrent"] = concurrent["mesh"], concurrent["direct"]
        mesh_info, direct_info = mesh.info, direct.info
        if b2b:
            started.stop_all()
            print(f"[{profile}] mesh with --b2b: workers pass activations to each other...", flush=True)
            b2b_result, _, b2b_info = run_mesh(hosts, started, workdir, spec, model,
                                                       ("--speculation", "off"), "mesh-b2b", ("--b2b",))
        if quic:
            started.stop_all()
            print(f"[{profile}] mesh with --data-path quic: every tunnel over QUIC...", flush=True)
            quic_result, _, quic_info = run_mesh(hosts, started, workdir, spec, model,
                                                 ("--speculation", "off"), "mesh-quic", ("--data-path", "quic"))
    finally:
        started.stop_all()
        if lab is not None:
            lab.close()
    entry = {
        "profile": profile,
        "link": "loopback" if loopback else LINK_PROFILES[profile],
        # To match against whatever else ran on the machine meanwhile.
        "began": began,
        "ended": datetime.now(UTC).isoformat(timespec="seconds"),
        "order": order,
        "direct": {**_summary(direct_result), **direct_info},
        "mesh": {**_summary(mesh_result), **mesh_info},
        "mesh_tunnels": _tunnel_bytes(mesh_result),
        "mesh_sidecar_cpu_ms_per_token": _sidecar_cpu_ms_per_token(mesh_result, mesh_result["cpu_s"]),
        # The idle mesh beside direct's turns (heartbeats, gossip): what it took from direct's CPU.
        "mesh_sidecar_cpu_ms_per_direct_token": _sidecar_cpu_ms_per_token(direct_result, mesh_result["cpu_s_beside"]),
        "raw": {"direct": direct_result["reps"], "mesh": mesh_result["reps"]},
    }
    entry["decode_ratio_mesh_over_direct"] = _ratio(entry, "mesh", "direct", "decode_tok_s")
    entry["ttft_ratio_mesh_over_direct"] = _ratio(entry, "mesh", "direct", "ttft_ms")
    # The two took turns: each round's own ratio, whose spread says how far the medians' ratio can be trusted.
    entry["rounds_mesh_over_direct"] = {
        "decode": _round_ratios(mesh_result, direct_result, lambda r: r["timings"]["predicted_per_second"]),
        "ttft": _round_ratios(mesh_result, direct_result, lambda r: r["ttft_ms"])}
    entry["greedy_texts_identical"] = entry["direct"]["text"] == entry["mesh"]["text"]
    if spec["streams"]:
        entry["raw"]["direct_streams"] = direct_result["concurrent"]["reps"]
        entry["raw"]["mesh_streams"] = mesh_result["concurrent"]["reps"]
        entry["aggregate_ratio_mesh_over_direct"] = _ratio(entry, "mesh", "direct", "streams", "aggregate_tok_s")
        # Informational only: llama.cpp's batched decoding is not batch-invariant, so concurrent
        # greedy streams may part ways between two runs of the same setup too.
        entry["stream_texts_identical"] = [m == d for m, d in zip(entry["mesh"]["streams"]["texts"],
                                                                   entry["direct"]["streams"]["texts"], strict=True)]
    if quic:
        entry["mesh_quic"] = {**_summary(quic_result), **quic_info}
        entry["decode_ratio_mesh_quic_over_direct"] = _ratio(entry, "mesh_quic", "direct", "decode_tok_s")
        entry["ttft_ratio_mesh_quic_over_direct"] = _ratio(entry, "mesh_quic", "direct", "ttft_ms")
    if b2b:
        entry["mesh_b2b"] = {**_summary(b2b_result), **b2b_info}
        entry["mesh_b2b_tunnels"] = _tunnel_bytes(b2b_result)
        entry["mesh_b2b_sidecar_cpu_ms_per_token"] = _sidecar_cpu_ms_per_token(b2b_result, b2b_result["cpu_s"])
        entry["raw"]["mesh_b2b"] = b2b_result["reps"]
        entry["decode_ratio_b2b_over_direct"] = _ratio(entry, "mesh_b2b", "direct", "decode_tok_s")
        entry["b2b_over_stock"] = _ratio(entry, "mesh_b2b", "mesh", "decode_tok_s")
        entry["greedy_texts_identical"] &= entry["mesh_b2b"]["text"] == entry["direct"]["text"]
        if spec["streams"]:
            entry["raw"]["mesh_b2b_streams"] = b2b_result["concurrent"]["reps"]
    if lab is not None and lab.switch_stats is not None:
        entry["delay_switch"] = lab.switch_stats
    return entry


def _round_ratios(setup: dict, over: dict, figure: Callable[[dict], float]) -> dict[str, float]:
    """``figure`` of each round of ``setup`` over that of the same round of ``over``: median and quartiles."""
    ratios = [figure(s) / figure(o) for s, o in zip(setup["reps"], over["reps"], strict=True)]
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median": median, "q1": q1, "q3": q3}


def _ratio(entry: dict[str, Any], setup: str, over: str, *figure: str) -> float:
    """Median of ``figure`` (a path of keys into a setup's summary) in ``setup`` over that in ``over``."""
    def median(name: str) -> float:
        value = entry[name]
        for key in figure:
            value = value[key]
        return value["median"]
    return median(setup) / median(over)


def _print_summary(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode across link profiles: {report['model']}, {report['n_predict']} tokens, "
                        f"{report['reps']} reps (medians)")
    columns = ("profile", "decode tok/s direct", "mesh", "mesh/direct", "mesh --b2b", "b2b/direct", "b2b/mesh",
               "TTFT ms direct", "mesh", "mesh/direct", "streams tok/s direct", "mesh",
               "mesh/direct", "prompt tok/s direct", "mesh", "same text")
    for col in columns:
        table.add_column(col, justify="left" if col == "profile" else "right")
    for e in report["profiles"]:
        if "error" in e:
            table.add_row(e["profile"], "failed", *[""] * (len(columns) - 2))
            continue
        d, m, b = e["direct"], e["mesh"], e.get("mesh_b2b")
        streams = (*(f"{s['streams']['aggregate_tok_s']['median']:.1f}" for s in (d, m)),
                   f"{e['aggregate_ratio_mesh_over_direct']:.2f}") if "streams" in d else ("-",) * 3
        table.add_row(e["profile"], f"{d['decode_tok_s']['median']:.1f}", f"{m['decode_tok_s']['median']:.1f}",
                      f"{e['decode_ratio_mesh_over_direct']:.2f}",
                      f"{b['decode_tok_s']['median']:.1f}" if b else "-",
                      f"{e['decode_ratio_b2b_over_direct']:.2f}" if b else "-",
                      f"{e['b2b_over_stock']:.2f}" if b else "-", f"{d['ttft_ms']['median']:.0f}",
                      f"{m['ttft_ms']['median']:.0f}", f"{e['ttft_ratio_mesh_over_direct']:.2f}", *streams,
                      f"{d['prompt_tok_s']['median']:.1f}",
                      f"{m['prompt_tok_s']['median']:.1f}", "yes" if e["greedy_texts_identical"] else "NO")
    Console(width=max(Console().width, 180)).print(table)
    for e in report["profiles"]:
        if "mesh_quic" in e:
            print(f"[{e['profile']}] mesh with --data-path quic: decode "
                  f"{e['mesh_quic']['decode_tok_s']['median']:.1f} tok/s, "
                  f"{e['decode_ratio_mesh_quic_over_direct']:.2f} of direct; TTFT "
                  f"{e['mesh_quic']['ttft_ms']['median']:.0f} ms, "
                  f"{e['ttft_ratio_mesh_quic_over_direct']:.2f} of direct")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--profiles",
                        help=f"comma-separated link profiles (default {DEFAULT_PROFILES}; also 0ms: the delay "
                             "switch with no delay)")
    parser.add_argument("--model", help="GGUF file, or a synthetic preset name such as bench-1gb "
                                        "(default: the default model)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--quic", action="store_true",
                        help="also run the mesh with --data-path quic (every tunnel over QUIC), for the "
                             "native data path's gain in the same run")
    parser.add_argument("--b2b", action="store_true",
                        help="also run the mesh on the b2b build (workers pass activations to each other)")
    parser.add_argument("--streams", type=int, default=0, choices=range(LLAMA_SERVER_AUTO_SLOTS + 1),
                        metavar=f"0..{LLAMA_SERVER_AUTO_SLOTS}",
                        help="after the single-stream requests, also send this many different prompts at once, "
                             "--reps times, and report their aggregate decode tok/s (default 0: none)")
    parser.add_argument("--loopback", action="store_true",
                        help="every host on this machine's loopback instead of network namespaces: no root, "
                             "no link profiles (unshaped only); for a GPU machine without namespaces")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        print(json.dumps(_client(json.loads(args.client))))
        return 0

    if not args.loopback and lacks_root():
        return 2
    sys.path.insert(0, str(REPO_ROOT))
    from mesh_sidecar.llama.backends import recorded_backend
    from mesh_sidecar.llama.build import B2B, STOCK, ensure_binaries
    from tests.helpers.netns import LINK_PROFILES

    profiles = (args.profiles or ("unshaped" if args.loopback else DEFAULT_PROFILES)).split(",")
    unknown = [p for p in profiles if p not in LINK_PROFILES]
    if unknown:
        print(f"unknown profile(s) {', '.join(unknown)}; choose from {', '.join(LINK_PROFILES)}", file=sys.stderr)
        return 2
    if args.loopback and profiles != ["unshaped"]:
        print("--loopback shapes no link: leave --profiles out (or give unshaped)", file=sys.stderr)
        return 2
    # Built now, not under a node's start timeout: the backend the nodes use (the last `setup --backend`);
    # the direct setup runs the nodes' own binaries.
    backend = recorded_backend()
    ensure_binaries(None, _quiet, STOCK.on(backend))
    if args.b2b:
        ensure_binaries(None, _quiet, B2B.on(backend))
    model = _resolve_model(args.model)
    spec = {"prompt": PROMPT, "n_predict": args.n_predict, "reps": args.reps, "streams": args.streams}
    report = {
        "benchmark": "decode",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": model.name,
        "prompt": PROMPT,
        "n_predict": args.n_predict,
        "reps": args.reps,
        "streams": args.streams,
        "stream_prompts": list(STREAM_PROMPTS[:args.streams]),
        "sampling": GREEDY,
        "cpu_count": os.cpu_count(),
        "profiles": [],
    }

    started = Started()
    workdir = Path(tempfile.mkdtemp(prefix="bench-decode-"))

    def body() -> int:
        failed = False
        for profile in profiles:
            try:
                entry = run_profile(profile, model, spec, workdir / profile, started, args.b2b, args.quic,
                                    args.loopback)
            except Exception as exc:  # noqa: BLE001 - a profile failing (timeout, crash) keeps the others' figures
                print(f"[{profile}] failed: {exc!r}", file=sys.stderr, flush=True)
                report["profiles"].append({"profile": profile, "error": repr(exc)})
                failed = True
                continue
            report["profiles"].append(entry)
            _print({**report, **entry})
        _print_summary(report)
        write_report(report, args.json)
        return 1 if failed else 0

    return run_benchmark(body, started, workdir)


if __name__ == "__main__":
    sys.exit(main())
