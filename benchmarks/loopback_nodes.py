"""Nodes on loopback, for the benchmarks that crash, stop and restart them (churn, failover).

Each node is a ``mesh_sidecar`` process with a ``--home`` and a UDP ``--port`` of its own on this
machine (as in ``tests/integration/test_failover.py``), restarted with the same home and port as a
new incarnation. ``Spawned`` remembers every process a run started, and those its nodes spawned
(rpc-servers, llama-servers), by pid and creation time, and kills what is left at the end.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.setup import REPO_ROOT, TICKET
from tests.helpers.waiting import wait_until

NODE_READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    """One node's identity (home, UDP port) and its current incarnation."""

    name: str
    home: Path
    port: int
    workdir: Path
    args: tuple[str, ...] = ()
    serve_port: int | None = None
    proc: subprocess.Popen | None = None
    log: Path | None = None
    ticket: str | None = None
    rpc_pid: int | None = None
    incarnation: int = 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "mesh_sidecar", "status", "--home", str(self.home), "--json"],
                             check=False, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        if out.returncode != 0:
            raise RuntimeError(f"status of {self.name} failed: {out.stderr.strip()}")
        return json.loads(out.stdout)


class Spawned:
    """Every process this run started (or that a node it started spawned), killed by pid at the end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.children: list[tuple[int, float]] = []  # (pid, create_time): never kill a reused pid

    def remember(self, pids: list[int]) -> None:
        with self.lock:
            for pid in pids:
                try:
                    self.children.append((pid, psutil.Process(pid).create_time()))
                except psutil.Error:
                    pass

    def kill_leftovers(self) -> None:
        with self.lock:
            children, self.children = self.children, []
        for pid, created in children:
            try:
                p = psutil.Process(pid)
                if p.create_time() == created:
                    p.kill()
            except psutil.Error:
                pass


def start_node(node: Node, started: Spawned, *extra: str) -> None:
    """Start a new incarnation of ``node`` (same home, same UDP port); wait for its ticket and rpc-server."""
    node.incarnation += 1
    node.home.mkdir(parents=True, exist_ok=True)
    node.log = node.workdir / f"{node.name}-{node.incarnation}.out"
    argv = [sys.executable, "-m", "mesh_sidecar", "--home", str(node.home), "--name", node.name,
            "--port", str(node.port), "--no-mdns", *node.args, *extra]
    if node.serve_port is not None:
        argv += ["--serve", str(node.serve_port), "--spread"]
    # A session of its own: a terminal's Ctrl-C reaches only us, and we stop the nodes in order.
    node.proc = subprocess.Popen(argv, stdout=open(node.log, "w"), stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                 start_new_session=True)
    started.remember([node.proc.pid])

    def ready() -> bool:
        if node.proc.poll() is not None:
            raise RuntimeError(f"node {node.name} exited with {node.proc.returncode}:\n"
                               f"{node.log.read_text(errors='replace')[-3000:]}")
        match = TICKET.search(node.log.read_text(errors="replace"))
        if not match:
            return False
        try:
            if json.loads((node.home / "control.json").read_text()).get("pid") != node.proc.pid:
                return False  # the file a killed incarnation left behind
        except (OSError, ValueError):
            return False
        node.ticket = match.group(1)
        return True

    wait_until(ready, NODE_READY_TIMEOUT_S, f"node {node.name} starts")
    processes = node.status()["processes"]
    started.remember([p["pid"] for p in processes])
    node.rpc_pid = next(p["pid"] for p in processes if p["name"] == "ggml-rpc-server")


def stop_node(node: Node, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM (graceful), a second SIGTERM (stop now), then SIGKILL."""
    if not node.alive():
        return
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        node.proc.send_signal(sig)
        try:
            node.proc.wait(timeout if sig == signal.SIGTERM else None)
            return
        except subprocess.TimeoutExpired:
            timeout = 10.0


def llama_server_pid(home: Path) -> int | None:
    """The pid of the serving node's current llama-server (what `status --json` reads), or None.

    Asked of the node's control endpoint directly: a `status` subprocess per request would
    cost a second of CPU on a small machine."""
    try:
        port = json.loads((home / "control.json").read_text())["port"]
        status = httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()
        return next((p["pid"] for p in status["processes"] if p["name"] == "llama-server"), None)
    except (OSError, ValueError, KeyError, TypeError, httpx.HTTPError):
        return None

