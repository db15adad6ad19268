"""Machines in different homes: a public member, two home routers doing masquerade, real processes.

Two hosts behind different routers join with the public member's ticket. Routers that keep
one mapping per local port let them punch through to each other (``direct``); a router that
maps every destination to a new port leaves them ``relayed`` through the public member.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from tests.helpers.natlab import (
    LOAD_TIMEOUT_S,
    NatMesh,
    can_make_nat_lab,
    metrics_in,
    peer,
    start_nat_mesh,
    stop_nat_mesh,
)
from tests.helpers.netns import QUIC_PORT, ns_complete
from tests.helpers.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(not can_make_nat_lab(), reason="needs root, `ip netns`, nft and conntrack"),
]

PATH_DEADLINE_S = 10.0  # the bound from both having joined to seeing each other on a path
# Punch retries back off 5, 10, 20, 40 s: both ends' retries meet within a few rounds.
DIRECT_AGAIN_TIMEOUT_S = 120.0
REBIND_DEADLINE_S = 10.0  # the bound for recovering from a router that forgot its mappings


@pytest.fixture(scope="module")
def nat_meshes(tmp_path_factory):
    """``nat_meshes(random_ports)``: the lab mesh of that kind; one at a time (two cores), made on first use."""
    running: dict[bool, NatMesh] = {}

    def get(random_ports: bool) -> NatMesh:
        if random_ports not in running:
            for other in running.values():
                stop_nat_mesh(other)
            running.clear()
            running[random_ports] = start_nat_mesh(tmp_path_factory.mktemp("nat"), random_ports=random_ports)
        return running[random_ports]

    yield get
    for mesh in running.values():
        stop_nat_mesh(mesh)


@pytest.fixture
def punched(nat_meshes) -> NatMesh:
    return nat_meshes(False)


@pytest.fixture
def relayed(nat_meshes) -> NatMesh:
    return nat_meshes(True)


def test_homes_behind_masquerade_go_direct_and_split_the_model(punched, reference_text):
    h1, h2 = punched.nodes["h1"], punched.nodes["h2"]
    print(f"\nboth home nodes up -> direct on both sides: {punched.joined_to_path_s:.1f} s")
    assert punched.joined_to_path_s <= PATH_DEADLINE_S
    for node, other, home in ((h1, "h2", punched.homes[1]), (h2, "h1", punched.homes[0])):
        row = peer(node, other)
        assert row["path"] == "direct" and row["via"] is None
        # Its router's public address: the mapping the punch opened, not the home LAN's.
        assert row["addr"].startswith(home.router.ip + ":"), row
    # Each learned its public address from the public member and said so.
    assert f"sees this node at {punched.homes[0].router.ip}:" in h1.text()
    plan = h2.status()["serving"]["plan"]
    assert {n["name"] for n in plan["nodes"]} == {"p", "h1", "h2"}
    assert ns_complete(punched.homes[1].host) == reference_text


def test_a_stranger_on_the_internet_cannot_use_a_member_as_a_relay(punched, tmp_path):
    p = punched.nodes["p"]
    stranger = punched.lab.add_public("s")
    before = p.status()["mesh"]
    h1_id = peer(p, "h1")["id"]
    argv = stranger.exec_argv(sys.executable, "-m", "tests.helpers.stranger", "relay", punched.public.ip,
                              str(QUIC_PORT), h1_id)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("no relay, closed by the node"), result.stdout
    after = p.status()["mesh"]
    # Refused at admission and its relay request never served, both counted; nothing reached h1.
    assert after["refused_connections"] == before["refused_connections"] + 1
    assert after["unadmitted_streams"] == before["unadmitted_streams"] + 1
    assert after["relay"] == before["relay"]


def test_a_router_with_a_port_per_destination_leaves_the_homes_relayed(relayed, reference_text):
    h1, h2, p = relayed.nodes["h1"], relayed.nodes["h2"], relayed.nodes["p"]
    print(f"\nboth home nodes up -> relayed on both sides: {relayed.joined_to_path_s:.1f} s")
    assert relayed.joined_to_path_s <= PATH_DEADLINE_S
    for node, other in ((h1, "h2"), (h2, "h1")):
        row = peer(node, other)
        assert row["path"] == "relayed" and row["via"] == "p", row
        assert row["addr"].startswith(relayed.public.ip + ":"), row
    assert ns_complete(relayed.homes[1].host) == reference_text
    relay = p.status()["mesh"]["relay"]
    assert relay["circuits_served"] >= 1 and relay["relayed_bytes"] > 100_000, relay
    # The serving node's /metrics: its punches (tried, none through) and what it relayed (nothing).
    samples = metrics_in(relayed.homes[1].host)
    assert samples["mesh_punch_attempts_total{}"] >= 1 and samples["mesh_punch_successes_total{}"] == 0
    assert samples["mesh_relayed_bytes_total{}"] == 0


def test_a_router_forgetting_its_mappings_mid_request_costs_no_request(punched, reference_text):
    """Its conntrack flushed and new ports for every mapping: h1's public address changes under a request."""
    h1, h2 = punched.nodes["h1"], punched.nodes["h2"]
    home1 = punched.homes[0]
    before = peer(h2, "h1")["addr"]
    answer: dict[str, str] = {}
    asker = threading.Thread(target=lambda: answer.update(text=ns_complete(punched.homes[1].host)))
    sent = peer(h2, "h1")["bytes_to_peer"]
    asker.start()
    wait_until(lambda: peer(h2, "h1")["bytes_to_peer"] > sent + 100_000, 60, "the request reaches h1")
    punched.lab.flush_mappings(home1, new_ports=True)
    flushed_at = time.monotonic()
    wait_until(lambda: (row := peer(h2, "h1")).get("path") and row["addr"] != before, REBIND_DEADLINE_S,
               "h2 reaches h1 at its new mapping")
    recovered_s = time.monotonic() - flushed_at
    asker.join(LOAD_TIMEOUT_S)
    print(f"\nmappings flushed: h1 reached at {peer(h2, 'h1')['addr']} (was {before}) after {recovered_s:.1f} s")
    assert answer.get("text") == reference_text
    assert peer(h1, "p")["path"] == "direct"


def test_a_relayed_pair_goes_direct_once_the_router_allows_it(relayed, reference_text):
    """The router that mapped every destination anew now keeps one mapping per port: the pair's
    punch retries get through, the direct path replaces the relay, and a request meanwhile completes."""
    h1, h2 = relayed.nodes["h1"], relayed.nodes["h2"]
    home2 = relayed.homes[1]
    assert peer(h2, "h1")["path"] == "relayed"
    relayed.lab.set_random_ports(home2, False)
    answer: dict[str, str] = {}
    asker = threading.Thread(target=lambda: answer.update(text=ns_complete(home2.host)))
    asker.start()
    wait_until(lambda: peer(h1, "h2").get("path") == "direct" and peer(h2, "h1").get("path") == "direct",
               DIRECT_AGAIN_TIMEOUT_S, "the pair goes direct")
    asker.join(LOAD_TIMEOUT_S)
    assert answer.get("text") == reference_text
    assert ns_complete(home2.host) == reference_text
