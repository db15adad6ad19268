"""A node remembers its mesh: a restart rejoins without a ticket; `leave` forgets it (real processes)."""

from __future__ import annotations

import json

import pytest

from mesh_sidecar.mesh.saved import MESH_FILE_NAME
from tests.helpers.nodes import TICKET_LINE, cli
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow


def peer_state(node, name: str) -> str | None:
    return next((p["state"] for p in node.status()["peers"] if p["name"] == name), None)


def planned(node) -> list[str]:
    plan = node.status()["serving"]["plan"]
    return [n["name"] for n in plan["nodes"]] if plan else []


def test_restarted_worker_rejoins_without_a_ticket_and_leave_forgets(start_node):
    server = start_node("server", "--min-peers", "1", serve=True, wait=False)
    ticket = wait_until(lambda: TICKET_LINE.search(server.text()), 60, "the server's ticket").group(1)
    worker = start_node("worker", "--join", ticket)
    server.wait_ready()
    wait_until(lambda: "worker" in planned(server), 90, "the worker holds layers")
    worker_id = worker.status()["node"]["id"]

    assert worker.stop() == 0  # SIGTERM: a graceful stop; the mesh is remembered
    wait_until(lambda: peer_state(server, "worker") == "left", 60, "the server sees the worker leave")
    wait_until(lambda: planned(server) == ["server"], 90, "the server replans without it")

    worker.restart(drop=("--join",))  # as after a reboot: no ticket
    wait_until(lambda: "Rejoining the mesh" in worker.text(), 60, "the worker dials what it remembers")
    wait_until(lambda: peer_state(server, "worker") == "connected", 60, "the worker is back")
    wait_until(lambda: "worker" in planned(server), 90, "and back in the plan")

    left = cli("leave", "--home", str(worker.home))
    assert left.returncode == 0, left.stderr
    assert worker.proc.wait(90) == 0
    assert peer_state(server, "worker") == "left"
    assert "left the mesh for good" in server.text()
    # Both stops said Leave before the worker's data relay stopped: neither read as a loss.
    assert "Lost peer worker" not in server.text()
    assert not (worker.home / MESH_FILE_NAME).exists()
    assert worker_id not in json.loads((server.home / MESH_FILE_NAME).read_text())["members"]
