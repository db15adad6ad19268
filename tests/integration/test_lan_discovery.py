"""LAN discovery over mDNS with real nodes in network namespaces on one bridge.

The bridge carries multicast between the namespaces like a home switch does, and
nothing else sees it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mesh_sidecar.mesh.saved import MESH_FILE_NAME
from mesh_sidecar.net.discovery import LanRecord, mesh_id
from mesh_sidecar.wire.ticket import PeerAddress
from tests.helpers.netns import QUIC_PORT, Lab, can_make_namespaces, start_in, ticket_of
from tests.helpers.nodes import cli
from tests.helpers.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(not can_make_namespaces(), reason="needs root and `ip netns`"),
]

REPO = Path(__file__).resolve().parents[2]
# A first record needs mDNS probing (about 2 s) and an answer to the browser's query.
SEEN_TIMEOUT_S = 30


def lan_seen(node) -> dict[str, dict]:
    """The records a node has seen, by node name."""
    return {r["name"]: r for r in node.status()["mesh"]["lan"] or []}


def peer_state(node, name: str) -> str | None:
    """A member's state as ``node`` sees it; None also while the node (re)starts and has no status yet."""
    result = cli("status", "--home", str(node.home), "--json", prefix=node.prefix)
    peers = json.loads(result.stdout)["peers"] if result.returncode == 0 else []
    return next((p["state"] for p in peers if p["name"] == name), None)


def sidecar_log(node) -> str:
    return (node.home / "logs" / "sidecar.log").read_text(errors="replace")


def own_secret(node) -> str:
    return json.loads((node.home / MESH_FILE_NAME).read_text())["secret"]


@pytest.fixture
def lab(binaries):
    lab = Lab(sniff=False)
    nodes = []
    try:
        yield lab, nodes
    finally:
        for node in nodes:
            node.stop_with_children()
        lab.close()


def test_fresh_nodes_see_each_others_mesh_and_lan_lists_them(lab, tmp_path):
    lab, nodes = lab
    a, b, c = (lab.add_host(name) for name in "abc")
    node_a = start_in(a, tmp_path / "a")
    node_b = start_in(b, tmp_path / "b")
    nodes += [node_a, node_b]
    ticket_of(node_a), ticket_of(node_b)
    mesh_a, mesh_b = node_a.status()["mesh"]["mesh_id"], node_b.status()["mesh"]["mesh_id"]
    assert mesh_a != mesh_b  # two fresh nodes: two meshes

    wait_until(lambda: "b" in lan_seen(node_a) and "a" in lan_seen(node_b), SEEN_TIMEOUT_S,
               "each sees the other's record")
    seen_by_a = lan_seen(node_a)["b"]
    assert seen_by_a["mesh_id"] == mesh_b and not seen_by_a["this_mesh"]
    assert seen_by_a["addresses"] == [f"{b.ip}:{QUIC_PORT}"]
    assert lan_seen(node_b)["a"]["mesh_id"] == mesh_a
    # Seeing a mesh is not joining it.
    assert peer_state(node_a, "b") is None and peer_state(node_b, "a") is None

    listing = cli("--lan", "--home", str(tmp_path / "c"), prefix=c.exec_argv())
    assert listing.returncode == 0, listing.stderr
    out = " ".join(listing.stdout.split())  # the table may wrap long cells
    for expected in (mesh_a, mesh_b, f"{a.ip}:{QUIC_PORT}", f"{b.ip}:{QUIC_PORT}", "mesh-inference --join"):
        assert expected in out, listing.stdout
    for secret in (own_secret(node_a), own_secret(node_b)):
        assert secret not in listing.stdout


def test_members_with_new_addresses_are_refound_without_a_ticket(lab, tmp_path):
    lab, nodes = lab
    a, b = lab.add_host("a"), lab.add_host("b")
    node_a = start_in(a, tmp_path / "a")
    node_b = start_in(b, tmp_path / "b", "--join", ticket_of(node_a))
    nodes += [node_a, node_b]
    wait_until(lambda: peer_state(node_a, "b") == "connected", 60, "b joins a")
    old_a, old_b = a.ip, b.ip

    assert node_a.stop() == 0 and node_b.stop() == 0
    # Both come back elsewhere: every address either remembers is now wrong.
    lab.readdress(a, 11)
    lab.readdress(b, 12)
    node_a.restart(drop=("--join",))
    node_b.restart(drop=("--join",))

    wait_until(lambda: peer_state(node_a, "b") == "connected" and peer_state(node_b, "a") == "connected",
               60, "a and b find each other on the LAN")
    assert old_a != a.ip and old_b != b.ip
    address_of_b = next(p["address"] for p in node_a.status()["peers"] if p["name"] == "b")
    address_of_a = next(p["address"] for p in node_b.status()["peers"] if p["name"] == "a")
    assert {address_of_b.split(":")[0], address_of_a.split(":")[0]} <= {a.ip, b.ip}
    assert "advertises this mesh" in sidecar_log(node_a) + sidecar_log(node_b)


def test_a_strangers_record_with_our_mesh_id_is_dialed_and_refused(lab, tmp_path):
    lab, nodes = lab
    a, s = lab.add_host("a"), lab.add_host("s")
    node_a = start_in(a, tmp_path / "a")
    # The stranger runs a real node of its own mesh, and advertises A's mesh id for it.
    node_s = start_in(s, tmp_path / "s", "--no-mdns")
    nodes += [node_a, node_s]
    ticket_of(node_a), ticket_of(node_s)
    victim_mesh = node_a.status()["mesh"]["mesh_id"]
    assert victim_mesh == mesh_id(bytes.fromhex(own_secret(node_a)))
    forged = LanRecord(victim_mesh, bytes.fromhex(node_s.status()["node"]["id"]), "stranger",
                       (PeerAddress(s.ip, QUIC_PORT),))
    advertiser = subprocess.Popen(s.exec_argv(sys.executable, "-c", f"""
import asyncio
from mesh_sidecar.net.discovery import LanPresence, LanRecord
from mesh_sidecar.wire.ticket import PeerAddress
record = LanRecord({forged.mesh_id!r}, {forged.node_id!r}, "stranger", (PeerAddress({s.ip!r}, {QUIC_PORT}),))
async def main():
    await asyncio.wait_for(LanPresence(lambda: record, lambda r: None).run(), 60)
try:
    asyncio.run(main())
except TimeoutError:
    pass
"""), cwd=REPO)
    try:
        wait_until(lambda: "stranger" in lan_seen(node_a), SEEN_TIMEOUT_S, "A sees the forged record")
        assert lan_seen(node_a)["stranger"]["this_mesh"]
        wait_until(lambda: "advertises this mesh" in sidecar_log(node_a)
                   and "did not answer" in sidecar_log(node_a), 30, "A dials the stranger, and fails")
    finally:
        advertiser.terminate()
        advertiser.wait(10)
    assert peer_state(node_a, "stranger") is None and not node_a.status()["peers"]
    assert not node_s.status()["peers"]
    assert "refused" in sidecar_log(node_s).lower()
