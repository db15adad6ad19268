"""Shared fixtures: the real llama.cpp build, the default model, and node processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from mesh_sidecar.llama.build import LLAMA_SERVER_BINARY, RPC_SERVER_BINARY, LlamaBinaries, ensure_binaries
from mesh_sidecar.llama.model import ensure_model
from mesh_sidecar.ports import free_tcp_port
from tests.waiting import wait_until

NODE_START_TIMEOUT_S = 180.0
TICKET_LINE = re.compile(r"Node ticket: (meshinf[a-z2-7]+)")


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet(message: str, done: int, total: int) -> None:
    pass


@pytest.fixture(scope="session")
def binaries() -> LlamaBinaries:
    """The pinned build (built on first use; `scripts/test.sh` runs setup first)."""
    return ensure_binaries(None, _quiet)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return ensure_model(None, _quiet)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
        prefix: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run `mesh-inference ARGS` to completion (``prefix``: e.g. `ip netns exec NS`)."""
    return subprocess.run([*prefix, sys.executable, "-m", "mesh_sidecar", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def api_healthy(port: int) -> bool:
    """Whether llama-server (or the node's proxy in front of it) on ``port`` is ready."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


PROMPT = "The three primary colors are"
N_PREDICT = 48
GREEDY = {"temperature": 0, "seed": 42, "top_k": 1}


def complete(port: int, prompt: str = PROMPT) -> str:
    """Greedy completion of N_PREDICT tokens from the API on ``port``."""
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": N_PREDICT, **GREEDY})
    response.raise_for_status()
    body = response.json()
    assert body["usage"]["completion_tokens"] == N_PREDICT
    return body["choices"][0]["text"]


def start_bare_rpc_server(binaries, port: int, log: Path) -> subprocess.Popen:
    """A bare rpc-server, returned once it listens (llama-server aborts on a port not yet open)."""
    proc = subprocess.Popen([str(binaries.rpc_server), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def listening() -> bool:  # its sockets, not a probe connection: that would be a client
        assert proc.poll() is None, log.read_text()
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(proc.pid).net_connections(kind="tcp"))

    wait_until(listening, 30, f"rpc-server listens on {port}")
    return proc


def plain_llama_server_answer(binaries: LlamaBinaries, model: Path, log_dir: Path,
                              ask: Callable[[int], str]) -> str:
    """``ask(port)`` against plain llama-server on this machine's CPU: the output to match."""
    port = free_tcp_port()
    log_path = log_dir / "plain.log"
    proc = subprocess.Popen([str(binaries.llama_server), "-m", str(model), "--host", "127.0.0.1",
                             "--port", str(port)], stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not api_healthy(port):
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        return ask(port)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def reference_text(binaries, model_path, tmp_path_factory) -> str:
    """What plain llama-server answers for the default model and PROMPT."""
    return plain_llama_server_answer(binaries, model_path, tmp_path_factory.mktemp("plain"), complete)


@dataclass
class NodeProcess:
    """A `mesh-inference` node started by a test; stopped by pid at teardown."""

    home: Path
    proc: subprocess.Popen
    output: Path
    serve_port: int | None = None
    extra_pids: list[int] = field(default_factory=list)
    prefix: Sequence[str] = ()

    def status(self) -> dict:
        result = cli("status", "--home", str(self.home), "--json", prefix=self.prefix)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def child_pids(self) -> list[int]:
        return [p["pid"] for p in self.status()["processes"]]

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def ticket(self) -> str:
        match = TICKET_LINE.search(self.text())
        assert match, self.text()
        return match.group(1)

    def diagnosis(self, log_lines: int = 40) -> str:
        """Its output, then the end of its sidecar log: what a failing test shows of a node."""
        log = self.home / "logs" / "sidecar.log"
        tail = log.read_text(errors="replace").splitlines()[-log_lines:] if log.exists() else []
        return "\n".join([self.text(), f"--- the last {len(tail)} lines of {log}:", *tail])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"node exited with {self.proc.returncode}:\n{self.diagnosis()}")
            if self.serve_port is None:
                if (self.home / "control.json").exists():
                    return
            elif api_healthy(self.serve_port):
                return
            time.sleep(0.2)
        raise AssertionError(f"node not ready in {NODE_START_TIMEOUT_S} s:\n{self.diagnosis()}")

    def stop_with_children(self) -> None:
        """Stop the node, then kill by pid any child it left behind (even if the test failed)."""
        self.stop()
        for pid in self.extra_pids:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass

    def restart(self, drop: Sequence[str] = ()) -> None:
        """Start the same command again (same home), as after a reboot, without the options named in
        ``drop`` (each with its value); output appends."""
        assert self.proc.poll() is not None, "stop the node first"
        argv, kept = list(self.proc.args), []
        while argv:
            arg = argv.pop(0)
            if arg in drop:
                argv.pop(0)
            else:
                kept.append(arg)
        self.proc = subprocess.Popen(kept, stdout=open(self.output, "a"), stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def start_node(tmp_path: Path, binaries: LlamaBinaries, model_path: Path) -> Iterator:
    """Start nodes: `start_node(name, *args, serve=True)`; all are stopped (and their children killed) after."""
    started: list[NodeProcess] = []

    def start(name: str, *args: str, serve: bool = False, wait: bool = True,
              env: dict[str, str] | None = None) -> NodeProcess:
        home = tmp_path / name
        home.mkdir()
        port = free_tcp_port() if serve else None
        # No mDNS: these nodes share the machine's own network, where a test must send nothing.
        argv = [sys.executable, "-m", "mesh_sidecar", "--home", str(home), "--name", name,
                "--port", str(free_udp_port()), "--no-mdns", *args]
        if port is not None:
            argv += ["--serve", str(port)]
        output = tmp_path / f"{name}.out"
        proc = subprocess.Popen(argv, stdout=open(output, "w"), stderr=subprocess.STDOUT,
                                env={**os.environ, **env} if env else None)
        node = NodeProcess(home, proc, output, port)
        started.append(node)
        if wait:
            try:
                node.wait_ready()
            except AssertionError as exc:  # the other nodes' side of it (one that exited, say)
                others = [f"--- {other.home.name}, "
                          f"{'running' if other.proc.poll() is None else f'exited with {other.proc.returncode}'}:\n"
                          f"{other.diagnosis(10)}" for other in started if other is not node]
                raise AssertionError("\n".join([str(exc), *others])) from None
            node.extra_pids = node.child_pids()
        return node

    yield start
    for node in started:
        node.stop_with_children()


def metrics(port: int) -> dict[str, float]:
    """Every sample of /metrics, as 'name{labels}' -> value (also checks it parses)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def kill_worker(node) -> None:
    """SIGKILL a worker's sidecar and its rpc-server, as a machine that loses power."""
    rpc_pid = next(p["pid"] for p in node.status()["processes"] if p["name"] == "ggml-rpc-server")
    node.proc.send_signal(signal.SIGKILL)
    os.kill(rpc_pid, signal.SIGKILL)
    node.proc.wait()


async def start_stand_in(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` (a stand-in llama-server) on a free loopback port: its runner (to clean up) and URL."""
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = free_tcp_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def stream_events(request: web.Request, events: Sequence[bytes], stall_after: int | None) -> web.StreamResponse:
    """A stand-in's server-sent ``events``, then ``[DONE]``; with ``stall_after``, it stops sending after
    that many (the fault a dead worker causes)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i, event in enumerate(events):
        if i == stall_after:
            await asyncio.sleep(3600)
        await response.write(event)
    await response.write(b"data: [DONE]\n\n")
    return response


FAULT_PROXY = Path(__file__).resolve().parent / "fault_proxy.py"


@pytest.fixture
def faulty_rpc_build(tmp_path, binaries) -> Callable[..., tuple[Path, Path]]:
    """``faulty_rpc_build(*fault_args)``: a --llama-bin directory whose rpc-server sits behind the fault
    proxy (fault_proxy.py; NaNs, or with ``"--delay-s", "S"`` late replies), and the file that arms it."""

    def build(*fault_args: str) -> tuple[Path, Path]:
        directory = tmp_path / "faulty-build"
        directory.mkdir()
        (directory / LLAMA_SERVER_BINARY).symlink_to(binaries.llama_server)
        trigger = tmp_path / "fault-armed"
        wrapper = directory / RPC_SERVER_BINARY
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAULT_PROXY}" --real "{binaries.rpc_server}" '
                           f'--trigger "{trigger}" {" ".join(fault_args)} "$@"\n')
        wrapper.chmod(0o755)
        return directory, trigger

    return build
