"""A path between two members breaks while a third still reaches both: they find each other
again, first relayed by the third, then direct once the path is back (namespaces, real processes).

Only a peer whose view changes re-sends its member list, so without redials on heartbeats the
two would stay apart for good: a partial mesh that a serving node waiting for --min-peers never leaves.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.netns import Host, Lab, can_make_namespaces, start_in, ticket_of
from tests.helpers.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(not (can_make_namespaces() and shutil.which("nft")), reason="needs root, `ip netns` and nft"),
]

BLOCK_TABLE = "mi_block"
LOSS_TIMEOUT_S = 60.0  # the transport's idle timeout (10 s) plus start-up and polling slack
REJOIN_TIMEOUT_S = 90.0  # the redial's first backoff, a direct dial's timeout per address, the relay


def drop_packets_from(host: Host, source_ip: str) -> None:
    rules = (f"table inet {BLOCK_TABLE} {{\n chain input {{\n type filter hook input priority 0;\n"
             f" ip saddr {source_ip} drop\n }}\n}}\n")
    subprocess.run(host.exec_argv("nft", "-f", "-"), input=rules, text=True, check=True)


def stop_dropping(host: Host) -> None:
    subprocess.run(host.exec_argv("nft", "delete", "table", "inet", BLOCK_TABLE), check=True)


def peer_path(node, name: str) -> tuple[str | None, str | None]:
    peer = next((p for p in node.status()["peers"] if p["name"] == name), None)
    return (peer["state"], peer.get("path")) if peer else (None, None)


def test_two_members_whose_path_broke_find_each_other_again(tmp_path):
    lab = Lab(sniff=False)
    nodes = []
    try:
        a, b, c = (lab.add_host(name) for name in "abc")
        # --no-mdns: the hosts share a LAN here, and a LAN member redials what it sees advertised;
        # members in different homes have only gossip.
        nodes.append(node_a := start_in(a, tmp_path / "a", "--no-mdns"))
        ticket = ticket_of(node_a)
        nodes.append(start_in(b, tmp_path / "b", "--no-mdns", "--join", ticket))
        nodes.append(node_c := start_in(c, tmp_path / "c", "--no-mdns", "--join", ticket))
        node_c.wait_ready()
        wait_until(lambda: peer_path(node_c, "b") == ("connected", "direct"), LOSS_TIMEOUT_S, "c reaches b")

        drop_packets_from(b, c.ip)  # both ways: b hears nothing from c, so nothing c sends is answered
        wait_until(lambda: "Lost peer b" in node_c.text(), LOSS_TIMEOUT_S, "c loses b")
        wait_until(lambda: peer_path(node_c, "b") == ("connected", "relayed"), REJOIN_TIMEOUT_S,
                   "c reaches b again, relayed by a")
        assert node_c.text().count("Connected to peer b") == 2

        stop_dropping(b)
        wait_until(lambda: peer_path(node_c, "b") == ("connected", "direct"), REJOIN_TIMEOUT_S,
                   "c and b go direct again")
        assert all(node.proc.poll() is None for node in nodes)
    finally:
        for node in nodes:
            node.stop_with_children()
        lab.close()
