"""Read-only commands answer at once: `status`, `plan`, `ticket`, `logs` and `--help` load none of the
node's network or serving layers (aiohttp, aioquic, numpy through gguf, the mesh, the supervisor).

Each command runs in a fresh Python as `mesh-inference` would, against a real control endpoint
(node/control.py's server, with a stand-in for the node behind it) or a home with no node; what it
imported is listed when it exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mesh_sidecar.errors import PlanError
from mesh_sidecar.home import NodeHome
from mesh_sidecar.node.control import ControlServer
from tests.unit.test_cli_views import STATUS

# What a read-only command must never load: the node's network (QUIC, the mesh, its HTTP servers, mDNS)
# and its serving layers (planner, supervisor, proxy, GGUF reading with numpy), and what only they need.
FORBIDDEN_PREFIXES = (
    "mesh_sidecar.net", "mesh_sidecar.mesh.runtime", "mesh_sidecar.mesh.membership", "mesh_sidecar.node.lifecycle",
    "mesh_sidecar.serve.supervisor", "mesh_sidecar.serve.proxy", "mesh_sidecar.serve.planner",
    "mesh_sidecar.llama.estimate", "aiohttp", "aioquic", "zeroconf", "numpy", "gguf", "httpx", "cryptography",
    "asyncio",
)
FORBIDDEN_MODULES = ("mesh_sidecar.node.control",)  # the endpoint's server side; the client is control_client

RUN_AND_LIST_MODULES = """
import json, os, sys
from mesh_sidecar.cli.main import main
sys.argv = ["mesh-inference", *sys.argv[1:]]
try:
    main()
    code = 0
except SystemExit as exit:
    code = exit.code
with open(os.environ["MODULES_FILE"], "w") as f:
    json.dump(sorted(sys.modules), f)
sys.exit(code)
"""

class StandInNode:
    """What the control endpoint asks of a node, with fixed answers."""

    def status_snapshot(self) -> dict[str, Any]:
        return STATUS

    async def plan_snapshot(self, model: Path | None, ctx_size: int | None) -> Any:
        raise PlanError("no member offers memory yet: start a worker with the ticket")

    def model_paths(self) -> list[Path]:
        return []

    def ticket(self) -> str:
        return "mesh1-stand-in-ticket"

    def rotate_secret(self) -> str:
        raise AssertionError("read-only commands rotate nothing")

    def kick(self, which: str) -> tuple[str, str]:
        raise AssertionError("read-only commands kick no one")

    def leave(self) -> None:
        raise AssertionError("read-only commands leave nothing")


@pytest.fixture
def running_home(tmp_path: Path) -> Iterator[NodeHome]:
    """A home whose control endpoint answers, served from a thread's event loop."""
    home = NodeHome(tmp_path / "home")
    home.create()
    (home.logs / "sidecar.log").write_text("one line\n")
    loop = asyncio.new_event_loop()
    server = ControlServer(home, StandInNode())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield home
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def run_command(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    modules_file = tmp_path / "modules.json"
    done = subprocess.run([sys.executable, "-c", RUN_AND_LIST_MODULES, *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "MODULES_FILE": str(modules_file), "COLUMNS": "100"})
    return done, json.loads(modules_file.read_text())


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m in FORBIDDEN_MODULES or any(m == p or m.startswith(p + ".")
                                                                for p in FORBIDDEN_PREFIXES)]


@pytest.mark.parametrize("args", [("--help",), ("status", "--help"), ("plan", "--help"), ("ticket", "--help"),
                                  ("logs", "--help")])
def test_help_loads_no_node_layer(tmp_path: Path, args: tuple[str, ...]) -> None:
    done, modules = run_command(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout
    assert heavy(modules) == []


def test_read_only_commands_against_a_running_node_load_no_node_layer(tmp_path: Path, running_home: NodeHome) -> None:
    home = str(running_home.root)
    done, modules = run_command(tmp_path, "status", "--json", "--home", home)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == STATUS
    assert heavy(modules) == []
    assert "mesh_sidecar.node.control_client" in modules  # the check would catch what it is for

    done, modules = run_command(tmp_path, "ticket", "--home", home)
    assert (done.returncode, done.stdout.strip()) == (0, "mesh1-stand-in-ticket"), done.stderr
    assert heavy(modules) == []

    done, modules = run_command(tmp_path, "plan", "--home", home)  # the node's refusal, as people read it
    assert done.returncode == 1 and "no member offers memory yet" in done.stderr, done.stderr
    assert heavy(modules) == []

    done, modules = run_command(tmp_path, "logs", "--home", home)
    assert done.returncode == 0 and "one line" in done.stdout, done.stderr
    assert heavy(modules) == []

    done, modules = run_command(tmp_path, "status", "--home", home)  # the table, rendered
    assert done.returncode == 0 and STATUS["node"]["name"] in done.stdout, done.stderr
    assert heavy(modules) == []


def test_status_without_a_node_says_how_to_start_one(tmp_path: Path) -> None:
    done, modules = run_command(tmp_path, "status", "--home", str(tmp_path / "nowhere"))
    assert done.returncode == 1
    assert "No node is running with home" in done.stderr and "Start one with `mesh-inference`" in done.stderr
    assert heavy(modules) == []


def test_the_check_catches_a_node_layer() -> None:
    assert heavy(["mesh_sidecar.cli.main", "aiohttp.web", "mesh_sidecar.net.quic", "mesh_sidecar.node.control",
                  "mesh_sidecar.node.control_client", "numpy"]) == ["aiohttp.web", "mesh_sidecar.net.quic",
                                                                   "mesh_sidecar.node.control", "numpy"]
