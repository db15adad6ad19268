"""`mesh-inference` node processes started by tests, and what a test asks of a running node."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from mesh_sidecar.ports import free_tcp_port
from tests.helpers.llama import api_healthy

NODE_START_TIMEOUT_S = 180.0
TICKET_LINE = re.compile(r"Node ticket: (meshinf[a-z2-7]+)")


def free_udp_port() -> int:
    """A UDP port on loopback that nothing holds now (a node's QUIC port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
        prefix: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run `mesh-inference ARGS` to completion (``prefix``: e.g. `ip netns exec NS`)."""
    return subprocess.run([*prefix, sys.executable, "-m", "mesh_sidecar", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@dataclass
class NodeProcess:
    """A `mesh-inference` node started by a test; stopped by pid at teardown."""

    home: Path
    proc: subprocess.Popen
    output: Path
    serve_port: int | None = None  # a serving node's API port (its readiness is the model's)
    extra_pids: list[int] = field(default_factory=list)
    prefix: Sequence[str] = ()
    api_port: int | None = None  # every node's API, serving or not

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


class LoopbackNodes:
    """Nodes on this machine's loopback, each with a home under ``root``: `start(name, *args, serve=True)`;
    `stop_all()` stops them and kills their children."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[NodeProcess] = []

    def start(self, name: str, *args: str, serve: bool = False, wait: bool = True,
              env: dict[str, str] | None = None, spread: bool = True) -> NodeProcess:
        """``spread``: a serving node splits its model over every free member (the tests of splitting
        use the default model, which fits on one node)."""
        home = self.root / name
        home.mkdir()
        # Every node has an API; each gets a free port here, never the machine's 8080.
        api_port = free_tcp_port()
        # No mDNS: these nodes share the machine's own network, where a test must send nothing.
        # One CPU thread per rpc-server: the nodes share this machine's cores, and llama.cpp's own --rpc,
        # which tests compare with, runs bare rpc-servers at their default of one.
        argv = [sys.executable, "-m", "mesh_sidecar", "--home", str(home), "--name", name,
                "--port", str(free_udp_port()), "--no-mdns", "--threads", "1", *args]
        if serve:
            argv += ["--serve", str(api_port)] + (["--spread"] if spread else [])
        else:
            argv += ["--api-port", str(api_port)]
        output = self.root / f"{name}.out"
        proc = subprocess.Popen(argv, stdout=open(output, "w"), stderr=subprocess.STDOUT,
                                env={**os.environ, **env} if env else None)
        node = NodeProcess(home, proc, output, api_port if serve else None, api_port=api_port)
        self.started.append(node)
        if wait:
            try:
                node.wait_ready()
            except AssertionError as exc:  # the other nodes' side of it (one that exited, say)
                others = [f"--- {other.home.name}, "
                          f"{'running' if other.proc.poll() is None else f'exited with {other.proc.returncode}'}:\n"
                          f"{other.diagnosis(10)}" for other in self.started if other is not node]
                raise AssertionError("\n".join([str(exc), *others])) from None
            node.extra_pids = node.child_pids()
        return node

    def stop_all(self) -> None:
        for node in self.started:
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


def kill_worker(node: NodeProcess) -> None:
    """SIGKILL a worker's sidecar and its rpc-server, as a machine that loses power."""
    rpc_pid = next(p["pid"] for p in node.status()["processes"] if p["name"] == "ggml-rpc-server")
    node.proc.send_signal(signal.SIGKILL)
    # The rpc-server may already be gone: it is told of its parent's death (PDEATHSIG).
    with contextlib.suppress(ProcessLookupError):
        os.kill(rpc_pid, signal.SIGKILL)
    node.proc.wait()
