"""Builds that do not speak the same RPC, with real nodes: a member whose rpc-server answers
HELLO with 6.0.0 is left out and told why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

from mesh_sidecar.mesh.exclusion import LLAMA_BUILD_MISMATCH
from tests.helpers.llama import complete, wrapped_rpc_build
from tests.helpers.nodes import TICKET_LINE, cli
from tests.helpers.waiting import wait_until

# --- with real processes: a member whose rpc-server answers HELLO with 6.0.0 -----------------


FAKE_RPC_SERVER = Path(__file__).resolve().parents[1] / "helpers" / "fake_rpc_server.py"


@pytest.fixture
def other_rpc_build(tmp_path, binaries) -> Path:
    """A --llama-bin directory: the real llama-server beside an rpc-server that speaks RPC 6.0.0."""
    return wrapped_rpc_build(binaries, tmp_path / "other-build", f'exec "{sys.executable}" "{FAKE_RPC_SERVER}" "$@"')


def rpc_endpoints(node) -> list[str]:
    llama = next(p for p in node.status()["processes"] if p["name"] == "llama-server")
    argv = psutil.Process(llama["pid"]).cmdline()
    return argv[argv.index("--rpc") + 1].split(",")


@pytest.mark.slow
def test_a_member_of_another_rpc_version_is_left_out_and_told_why(start_node, other_rpc_build):
    serving = start_node("c", "--min-peers", "2", serve=True, wait=False)
    ticket = wait_until(lambda: TICKET_LINE.search(serving.text()), 60, "c prints its ticket").group(1)
    good = start_node("a", "--join", ticket)
    other = start_node("b", "--join", ticket, "--llama-bin", str(other_rpc_build))
    serving.wait_ready()  # llama-server's first start comes after both joined (--min-peers 2)
    serving.extra_pids = serving.child_pids()

    both_versions = ("b's rpc-server speaks RPC 6.0.0", "c's llama-server speaks RPC 7.0.")
    planned = cli("plan", "--home", str(serving.home), "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert [r["name"] for r in plan["refused"]] == ["b"] and plan["refused"][0]["reason"] == LLAMA_BUILD_MISMATCH
    assert all(part in plan["refused"][0]["detail"] for part in both_versions), plan["refused"]
    status = serving.status()
    assert [n["name"] for n in status["serving"]["plan"]["nodes"]] == ["a", "c"]
    peers = {p["name"]: p for p in status["peers"]}
    assert peers["b"]["refused"] == LLAMA_BUILD_MISMATCH and peers["a"]["refused"] is None
    assert all(part in peers["b"]["refused_detail"] for part in both_versions)
    # llama-server never gets b's tunnel; a's and c's own rpc-server are all it uses.
    endpoints = rpc_endpoints(serving)
    assert f"127.0.0.1:{peers['b']['tunnel_port']}" not in endpoints
    assert endpoints[0] == f"127.0.0.1:{peers['a']['tunnel_port']}" and len(endpoints) == 2
    assert complete(serving.serve_port)

    # b's own output and status say it was left out, and why.
    line = wait_until(lambda: next((said for said in other.text().splitlines()
                                    if said.startswith(LLAMA_BUILD_MISMATCH)), None), 30, "b says it is left out")
    assert all(part in line for part in both_versions) and "./scripts/bootstrap.sh" in line
    own = other.status()
    assert own["node"]["llama_build"].startswith("RPC 6.0.0")
    row = next(p for p in own["peers"] if p["name"] == "c")
    assert row["refused"] == LLAMA_BUILD_MISMATCH and all(part in row["refused_detail"] for part in both_versions)
    shown = cli("status", "--home", str(other.home))
    assert shown.returncode == 0 and "llama.cpp: RPC 6.0.0" in shown.stdout, shown.stdout
    assert f"c: {LLAMA_BUILD_MISMATCH}: b's rpc-server" in shown.stdout, shown.stdout
    assert good.proc.poll() is None and LLAMA_BUILD_MISMATCH not in good.text()
