"""The benchmarks' shared setup: processes started and stopped by pid, and the mesh and the direct
llama.cpp ``--rpc`` setup side by side on the same hosts.

- Processes: ``Started`` holds every process a run starts (stopped by pid, last first, and a node's
  children killed should the node not have stopped them); ``run_benchmark`` runs a benchmark's body
  so that Ctrl-C or SIGTERM ends it through the same cleanup; ``run_watched`` runs a client while
  watching the processes it measures.
- Hosts: a lab's namespaces (``tests/helpers/netns.py``) or ``LoopbackHost``, names on this
  machine's loopback with ports of their own (``host_port``).
- The mesh: ``start_mesh`` starts a, b and c as in ``tests/integration/test_mesh_netns.py`` (a works, b
  joins a, c joins b and serves the API on :8080) and reads back the argvs the mesh gave its
  processes; ``start_direct`` starts llama.cpp's own way beside it, rpc-servers over TCP and a
  llama-server on c, every process on the mesh's own argv (binary, threads, devices, split), so both
  split the model alike.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from tests.helpers.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
QUIC_PORT = 47470
MESH_API_PORT = 8080
DIRECT_API_PORT = 8081
WORKER_API_PORT = 8090  # a's (b's the next): every node has an API, and on --loopback they share 127.0.0.1
DIRECT_RPC_PORT = 50052
START_TIMEOUT_S = 180.0
TICKET = re.compile(r"Node ticket: (meshinf[a-z2-7]+)")


def quiet(message: str, done: int, total: int) -> None:
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

    procs: list[tuple[str, subprocess.Popen, Path]] = field(default_factory=list)
    extra_pids: list[int] = field(default_factory=list)
    stop_timeout_s: float = 30.0

    def popen(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        # A session of its own: a terminal's Ctrl-C reaches only us, and we stop them in order.
        proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                start_new_session=True, env=env)
        self.procs.append((name, proc, log))
        return proc

    def check(self) -> None:
        """Raises if any process started here has exited."""
        check_alive(self.procs)

    def stop(self, proc: subprocess.Popen) -> None:
        terminate(proc, self.stop_timeout_s)
        self.procs = [p for p in self.procs if p[1] is not proc]

    def stop_all(self) -> None:
        while self.procs:
            self.stop(self.procs[-1][1])
        for pid in self.extra_pids:  # a node's children, should the node not have stopped them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.extra_pids.clear()


Watched = list[tuple[str, subprocess.Popen, Path]]


def check_alive(watched: Watched) -> None:
    """Raises, with the end of its log, if a watched process has exited."""
    for name, proc, log in watched:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")


def run_watched(argv: list[str], check: Callable[[], None], poll_s: float) -> tuple[int, str, str]:
    """Run ``argv`` to its end, calling ``check()`` every ``poll_s`` meanwhile (it raises when a process the
    run needs has died; the run is then killed); (returncode, stdout, stderr)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        while proc.poll() is None:
            check()
            time.sleep(poll_s)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def node_status(host, home: Path) -> dict[str, Any]:
    out = subprocess.run(host.exec_argv(sys.executable, "-m", "mesh_sidecar", "status", "--home", str(home),
                                        "--json"), capture_output=True, text=True, check=True, timeout=60,
                         cwd=REPO_ROOT)
    return json.loads(out.stdout)


def listening(host, port: int) -> bool:
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
    return _commands_from_c(node_status(host, home))


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
        return wait_until(lambda: TICKET.search(log.read_text(errors="replace")), 60, "a ticket").group(1)

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
        processes = node_status(lab_hosts[name], homes[name])["processes"]
        started.extra_pids += [p["pid"] for p in processes]
        rpc_server_argv[name] = cmdline(next(p["pid"] for p in processes if p["name"] == "ggml-rpc-server"))

    def llama_server_running() -> tuple[dict, list[str]] | None:
        # A replan right after the first load (free memory moved) restarts llama-server: wait for the next.
        status = node_status(lab_hosts["c"], homes["c"])
        llama = next((p for p in status["processes"] if p["name"] == "llama-server" and p["running"]), None)
        try:
            return None if llama is None else (status, cmdline(llama["pid"]))
        except FileNotFoundError:
            return None

    status, argv = wait_until(llama_server_running, START_TIMEOUT_S, "c's llama-server running")
    rpc_list = argv[argv.index("--rpc") + 1].split(",")
    by_port = {p["tunnel_port"]: p["name"] for p in status["peers"]}
    by_port[next(p["port"] for p in status["processes"] if p["name"] == "ggml-rpc-server")] = "c"
    order = [by_port[int(e.rsplit(":", 1)[1])] for e in rpc_list]
    info = {"rpc_list": rpc_list, "order": order, "llama_server_argv": argv, "rpc_server_argv": rpc_server_argv}
    return MeshSetup(lab_hosts, homes, procs, order, info, {n: _commands(lab_hosts[n], homes[n]) for n in "ab"})


def cmdline(pid: int) -> list[str]:
    """A running process's argv, as its kernel has it."""
    return [arg.decode() for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if arg]


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
        wait_until(partial(listening, lab_hosts[name], host_port(DIRECT_RPC_PORT, name)), 30,
                   f"rpc-server on {name} listens")
    endpoints = [f"{lab_hosts[n].ip}:{host_port(DIRECT_RPC_PORT, n)}" for n in order]
    # The very argv the mesh gives its llama-server, but with TCP endpoints instead of tunnels.
    llama_argv = direct_llama_argv(mesh_info["llama_server_argv"], endpoints, DIRECT_API_PORT)
    argv = lab_hosts["c"].exec_argv(*llama_argv)
    log = workdir / "direct-llama-server.out"
    watched.append(("direct llama-server", started.popen("direct llama-server", argv, log), log))
    return DirectSetup(watched, {"rpc_list": endpoints, "order": order, "llama_server_argv": llama_argv,
                                 "rpc_server_argv": rpc_argvs})


def _commands_from_c(status: dict[str, Any]) -> int:
    return next(p["rpc_commands"] for p in status["peers"] if p["name"] == "c")


def raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


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
    signal.signal(signal.SIGTERM, raise_interrupt)
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


def attempt(part: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s figures or, should it fail (a timeout, a crash), ``{"error": ...}`` after saying so on
    stderr: one part of a benchmark failing keeps the others' figures."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - any failure of a part is reported as its result
        print(f"[{part}] failed: {exc!r}", file=sys.stderr, flush=True)
        return {"error": repr(exc)}


def resolve_model(given: str | None) -> Path:
    """A GGUF path, a synthetic preset's name (made if missing), or None: the default model."""
    from benchmarks.synthetic_model import PRESETS, ensure_synthetic_model
    from mesh_sidecar.llama.model import ensure_model

    if given in PRESETS:
        return ensure_synthetic_model(PRESETS[given])
    return ensure_model(Path(given) if given is not None else None, quiet)

