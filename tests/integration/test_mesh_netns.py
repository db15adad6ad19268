"""Three (and a stranger's fourth) hosts in network namespaces, real processes end to end.

A runs a worker, B joins A, C joins with B's ticket only and serves the API.
The tests run in file order against one mesh: formation, output, wire, strangers,
and last the loss of B.
"""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass

import pytest

from mesh_sidecar.wire.ticket import PeerAddress, Ticket, decode_ticket, encode_ticket
from tests.helpers.netns import (
    API_PORT,
    MDNS_PORT,
    QUIC_PORT,
    Host,
    Lab,
    can_make_namespaces,
    connected_names,
    ns_complete,
    ns_python,
    ns_tcp_refused,
    start_in,
    ticket_of,
)
from tests.helpers.nodes import NodeProcess, cli
from tests.helpers.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(not can_make_namespaces(), reason="needs root and `ip netns`"),
]

# A bound that only a hang breaks: how fast the mesh forms is a figure, printed here and
# measured in benchmarks/churn.py, not a test (a busy machine would fail every test of the module).
FULL_MESH_TIMEOUT_S = 60.0
LOSS_DEADLINE_S = 30.0  # transport idle timeout (10 s) plus process and polling slack


@dataclass
class Mesh3:
    lab: Lab
    hosts: dict[str, Host]
    nodes: dict[str, NodeProcess]
    tickets: dict[str, str]


@pytest.fixture(scope="module")
def mesh3(binaries, model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh3")
    lab = Lab()
    nodes: dict[str, NodeProcess] = {}
    try:
        hosts = {name: lab.add_host(name) for name in ("a", "b", "c", "d")}
        nodes["a"] = start_in(hosts["a"], root / "a")
        tickets = {"a": ticket_of(nodes["a"])}
        nodes["b"] = start_in(hosts["b"], root / "b", "--join", tickets["a"])
        tickets["b"] = ticket_of(nodes["b"])
        wait_until(lambda: connected_names(nodes["a"]) == {"b"}, 30, "a and b connect")
        started = time.monotonic()  # includes C's Python start-up and its rpc-server's: an upper bound
        nodes["c"] = start_in(hosts["c"], root / "c", "--join", tickets["b"], "--serve", str(API_PORT), "--spread",
                              "--min-peers", "2")
        tickets["c"] = ticket_of(nodes["c"])
        wait_until(lambda: all(connected_names(nodes[n]) == {"a", "b", "c"} - {n} for n in "abc"),
                   FULL_MESH_TIMEOUT_S, "full mesh of a, b and c")
        formed_after_s = time.monotonic() - started
        wait_until(lambda: "API ready" in nodes["c"].text() or nodes["c"].proc.poll() is not None, 180,
                   "C loads the model")
        assert nodes["c"].proc.poll() is None, nodes["c"].text()
        for node in nodes.values():
            node.extra_pids = node.child_pids()
        print(f"\nfull mesh {formed_after_s:.2f} s after C was launched")
        yield Mesh3(lab, hosts, nodes, tickets)
    finally:
        for node in nodes.values():
            node.stop_with_children()
        lab.close()


def test_full_mesh_through_gossip(mesh3):
    assert "Connected to peer a" in mesh3.nodes["c"].text()
    assert "(learned via gossip from b)" in mesh3.nodes["c"].text()
    assert mesh3.tickets["a"] not in " ".join(str(a) for a in mesh3.nodes["c"].proc.args)
    for name, node in mesh3.nodes.items():
        peers = {p["name"]: p for p in node.status()["peers"]}
        assert {n for n, p in peers.items() if p["state"] == "connected"} == {"a", "b", "c"} - {name}
        assert all(p["rpc_server_up"] and p["tunnel_port"] for p in peers.values())


def test_layers_on_all_three_nodes_and_output_matches_one_machine(mesh3, reference_text):
    text = ns_complete(mesh3.hosts["c"])
    assert text == reference_text
    # llama-server on C lists one tunnel per peer, then its own rpc-server (it holds the output layer)...
    status = mesh3.nodes["c"].status()
    llama = next(p for p in status["processes"] if p["name"] == "llama-server")
    argv = subprocess.run(["cat", f"/proc/{llama['pid']}/cmdline"], capture_output=True).stdout.split(b"\0")
    rpc_list = argv[argv.index(b"--rpc") + 1].decode().split(",")
    tunnel_ports = {p["tunnel_port"] for p in status["peers"]}
    own_rpc = next(p for p in status["processes"] if p["name"] == "ggml-rpc-server")["port"]
    assert len(rpc_list) == 3 and {int(e.rsplit(":", 1)[1]) for e in rpc_list[:-1]} == tunnel_ports
    assert rpc_list[-1] == f"127.0.0.1:{own_rpc}"
    # ...and every rpc-server holds a share of the weights (its own memory grew by tens of MB).
    for name, node in mesh3.nodes.items():
        rpc = next(p for p in node.status()["processes"] if p["name"] == "ggml-rpc-server")
        rss_kib = int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{rpc['pid']}/status").read()).group(1))
        assert rss_kib > 15 * 1024, f"{name}'s rpc-server holds only {rss_kib} KiB"
    # Tunnels carried real traffic in both directions.
    assert all(p["bytes_to_peer"] > 1_000_000 and p["bytes_from_peer"] > 0 for p in status["peers"])


def test_only_quic_mdns_and_the_data_port_cross_between_hosts(mesh3):
    sniffer = mesh3.lab.sniffer
    # TCP only to and from members' data ports (the native relay takes the QUIC port's number): TLS there.
    assert sniffer.tcp and all(QUIC_PORT in ports for ports in sniffer.tcp), f"TCP between hosts: {dict(sniffer.tcp)}"
    assert sum(sniffer.udp_ports.values()) > 100
    # mDNS (LAN discovery) goes port 5353 to 5353; everything else is QUIC.
    assert all(QUIC_PORT in ports or ports == (MDNS_PORT, MDNS_PORT) for ports in sniffer.udp_ports), \
        dict(sniffer.udp_ports)
    # Nothing but the QUIC port and the data port (members only: test_data_path.py) answers from another host.
    c = mesh3.nodes["c"].status()
    ports = [p["port"] for p in c["processes"] if p["name"] != "mesh-data-relay"] + \
        [p["tunnel_port"] for p in c["peers"]]
    for port in ports:
        assert ns_tcp_refused(mesh3.hosts["a"], mesh3.hosts["c"].ip, port)


def _join_from_d(mesh3, tmp_path, ticket: str) -> subprocess.CompletedProcess:
    home = tmp_path / "d"
    return cli("--home", str(home), "--name", "d", "--join", ticket, timeout=90,
               prefix=mesh3.hosts["d"].exec_argv())


def test_stranger_with_wrong_secret_is_refused(mesh3, tmp_path):
    real = decode_ticket(mesh3.tickets["a"])
    forged = encode_ticket(Ticket(real.node_id, secrets.token_bytes(32),
                                  (PeerAddress(mesh3.hosts["a"].ip, QUIC_PORT),)))
    result = _join_from_d(mesh3, tmp_path, forged)
    assert result.returncode != 0
    assert "secret" in result.stderr, result.stderr
    log = (mesh3.nodes["a"].home / "logs" / "sidecar.log").read_text()
    assert "wrong mesh secret" in log
    assert "d" not in {p["name"] for p in mesh3.nodes["a"].status()["peers"]}


def test_node_whose_key_does_not_match_the_ticket_is_refused(mesh3, tmp_path):
    # B's id and the real secret, but A's address: whoever answers there is not B.
    real_b = decode_ticket(mesh3.tickets["b"])
    wrong = encode_ticket(Ticket(real_b.node_id, real_b.mesh_secret,
                                 (PeerAddress(mesh3.hosts["a"].ip, QUIC_PORT),)))
    result = _join_from_d(mesh3, tmp_path, wrong)
    assert result.returncode != 0
    assert "does not match" in result.stderr, result.stderr


def test_garbage_senders_change_nothing(mesh3):
    a_ip = mesh3.hosts["a"].ip
    ignored_before = mesh3.nodes["a"].status()["mesh"]["ignored_datagrams"]
    ns_python(mesh3.hosts["d"], f"""
import os, socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for size in (1, 20, 1200, 1500, 60000):
    for _ in range(40):
        u.sendto(os.urandom(size), ({a_ip!r}, {QUIC_PORT}))
t = socket.socket(); t.settimeout(3)
try:
    t.connect(({a_ip!r}, {QUIC_PORT})); t.sendall(os.urandom(4096))
except OSError:
    pass
""")
    # A has read the garbage once it counts the datagrams it ignored.
    wait_until(lambda: mesh3.nodes["a"].status()["mesh"]["ignored_datagrams"] > ignored_before
               or mesh3.nodes["a"].proc.poll() is not None, 30, "A counts the garbage datagrams")
    assert mesh3.nodes["a"].proc.poll() is None
    peers = {p["name"]: p["state"] for p in mesh3.nodes["a"].status()["peers"]}
    assert peers.get("b") == "connected" and peers.get("c") == "connected"


def test_losing_b_is_noticed_and_its_tunnel_closes(mesh3, reference_text):
    c_before = {p["name"]: p for p in mesh3.nodes["c"].status()["peers"]}
    tunnel_to_b = c_before["b"]["tunnel_port"]
    mesh3.nodes["b"].proc.send_signal(signal.SIGKILL)
    mesh3.nodes["b"].proc.wait()

    def b_lost_everywhere() -> bool:
        return all({p["name"]: p["state"] for p in mesh3.nodes[n].status()["peers"]}.get("b") == "lost"
                   for n in "ac")

    wait_until(b_lost_everywhere, LOSS_DEADLINE_S, "A and C mark B lost", poll_s=1.0)
    assert ns_tcp_refused(mesh3.hosts["c"], "127.0.0.1", tunnel_to_b)
    # C restarts llama-server over what is left and answers the same.
    wait_until(lambda: mesh3.nodes["c"].text().count("API ready") >= 2, 120, "C restarts llama-server")
    assert ns_complete(mesh3.hosts["c"]) == reference_text
