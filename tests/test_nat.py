"""Machines in different homes: a public member, two home routers doing masquerade, real processes.

Two hosts behind different routers join with the public member's ticket. Routers that keep
one mapping per local port let them punch through to each other (``direct``); a router that
maps every destination to a new port leaves them ``relayed`` through the public member.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import NodeProcess
from tests.natlab import Home, NatLab, can_make_nat_lab
from tests.netns import API_PORT, Host, ns_complete, start_in, ticket_of
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(not can_make_nat_lab(), reason="needs root, `ip netns`, nft and conntrack"),
]

PATH_DEADLINE_S = 10.0  # the bound from both having joined to seeing each other on a path
MESH_TIMEOUT_S = 60.0  # only a hang breaks it
LOAD_TIMEOUT_S = 180.0


@dataclass
class NatMesh:
    lab: NatLab
    public: Host
    homes: list[Home]
    nodes: dict[str, NodeProcess]
    joined_to_path_s: float  # both home nodes up -> each sees the other on a path


def peer(node: NodeProcess, name: str) -> dict:
    return next((p for p in node.status()["peers"] if p["name"] == name), {})


def event_time(node: NodeProcess, starting: str) -> float:
    """When ``node`` first said a line starting with ``starting`` (its recent events, epoch seconds)."""
    return next(e["time"] for e in node.status()["events"] if e["message"].startswith(starting))


def nat_mesh(tmp_path_factory, *, random_ports: bool) -> Iterator[NatMesh]:
    root = tmp_path_factory.mktemp("nat")
    lab = NatLab()
    nodes: dict[str, NodeProcess] = {}
    try:
        public = lab.add_public("p")
        homes = [lab.add_home("r1", "h1"), lab.add_home("r2", "h2", random_ports=random_ports)]
        nodes["p"] = start_in(public, root / "p", "--no-mdns")
        ticket = ticket_of(nodes["p"])
        nodes["h1"] = start_in(homes[0].host, root / "h1", "--no-mdns", "--join", ticket)
        nodes["h2"] = start_in(homes[1].host, root / "h2", "--no-mdns", "--join", ticket,
                               "--serve", str(API_PORT), "--min-peers", "2")
        wait_until(lambda: peer(nodes["h1"], "h2").get("path") and peer(nodes["h2"], "h1").get("path"),
                   MESH_TIMEOUT_S, "h1 and h2 see each other")
        # From the nodes' own clocks: both joined the public member -> both connected to each other.
        joined = max(event_time(nodes[n], "Connected to peer p ") for n in ("h1", "h2"))
        met = max(event_time(nodes["h1"], "Connected to peer h2 "), event_time(nodes["h2"], "Connected to peer h1 "))
        joined_to_path_s = met - joined
        wait_until(lambda: "API ready" in nodes["h2"].text() or nodes["h2"].proc.poll() is not None,
                   LOAD_TIMEOUT_S, "h2 loads the model over the three")
        assert nodes["h2"].proc.poll() is None, nodes["h2"].text()
        for node in nodes.values():
            node.extra_pids = node.child_pids()
        yield NatMesh(lab, public, homes, nodes, joined_to_path_s)
    finally:
        for node in nodes.values():
            node.stop_with_children()
        lab.close()


@pytest.fixture(scope="module")
def punched(tmp_path_factory):
    yield from nat_mesh(tmp_path_factory, random_ports=False)


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
