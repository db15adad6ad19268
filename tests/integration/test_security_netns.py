"""The security boundary, with real nodes in network namespaces (issue: no stranger reaches an rpc-server).

A and B are workers, C serves the API; D is a stranger's host, E a member
with a different model file and F one whose firewall drops TCP. The tests run in file order against one mesh.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mesh_sidecar.mesh.exclusion import WEIGHTS_MISMATCH
from tests.helpers.netns import (
    API_PORT,
    MDNS_PORT,
    QUIC_PORT,
    Host,
    Lab,
    can_make_namespaces,
    connected_names,
    ns_python,
    start_in,
    ticket_of,
)
from tests.helpers.nodes import cli
from tests.helpers.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(not can_make_namespaces(), reason="needs root and `ip netns`"),
]

MARKER = "zebra-quartz-marker-7731"  # a prompt word that must never reach a log
FLOOD_DATAGRAMS = 20000
REPO = Path(__file__).resolve().parents[2]


def stranger(host: Host, *args: str) -> str:
    result = subprocess.run(host.exec_argv(sys.executable, "-m", "tests.helpers.stranger", *args), cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def sidecar_log(node) -> str:
    return (node.home / "logs" / "sidecar.log").read_text(errors="replace")


def peer_states(node) -> dict[str, str]:
    return {p["name"]: p["state"] for p in node.status()["peers"]}


def ns_chat(host: Host, prompt: str) -> str:
    code = f"""
import httpx, json
r = httpx.post("http://127.0.0.1:{API_PORT}/v1/chat/completions", timeout=120,
               json={{"messages": [{{"role": "user", "content": {prompt!r}}}], "max_tokens": 16,
                      "temperature": 0}})
r.raise_for_status()
print(r.json()["choices"][0]["message"]["content"])
"""
    return ns_python(host, code)


@pytest.fixture(scope="module")
def lab_mesh(binaries, model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    lab = Lab()
    nodes = {}
    try:
        hosts = {name: lab.add_host(name) for name in "abcde"}
        nodes["a"] = start_in(hosts["a"], root / "a")
        ticket_a = ticket_of(nodes["a"])
        nodes["b"] = start_in(hosts["b"], root / "b", "--join", ticket_a)
        nodes["c"] = start_in(hosts["c"], root / "c", "--join", ticket_a, "--serve", str(API_PORT), "--spread",
                              "--min-peers", "2")
        wait_until(lambda: all(connected_names(nodes[n]) >= {"a", "b", "c"} - {n} for n in "abc"), 60,
                   "full mesh of a, b and c")
        wait_until(lambda: "API ready" in nodes["c"].text() or nodes["c"].proc.poll() is not None, 180,
                   "C loads the model")
        assert nodes["c"].proc.poll() is None, nodes["c"].text()
        for node in nodes.values():
            node.extra_pids = node.child_pids()
        yield lab, hosts, nodes, ticket_a, root
    finally:
        for node in nodes.values():
            node.stop_with_children()
        lab.close()


def test_only_the_quic_and_mdns_ports_face_the_network(lab_mesh):
    lab, hosts, nodes, _, _ = lab_mesh
    scan = """
import json, psutil
print(json.dumps([[c.type == 1 and "tcp" or "udp", c.laddr.ip, c.laddr.port, c.status]
                  for c in psutil.net_connections(kind="inet")]))
"""
    for name in "abc":
        # Each namespace holds only this node's processes: every socket in it is the node's.
        sockets = json.loads(ns_python(hosts[name], scan))
        listening_tcp = [s for s in sockets if s[0] == "tcp" and s[3] == "LISTEN"]
        assert len(listening_tcp) >= 2  # rpc-server and control, at least
        exposed = [s for s in sockets if s[1] not in ("127.0.0.1", "::1") and s[3] in ("LISTEN", "NONE")]
        # mDNS (LAN discovery, off with --no-mdns) answers only for this node's public record.
        mdns = [s for s in exposed if s[0] == "udp" and s[2] == MDNS_PORT]
        assert mdns, f"{name}: {exposed}"
        # QUIC, and the native data relay's TCP port (the same number): TLS, members' keys only.
        assert sorted(s for s in exposed if s not in mdns) == [["tcp", "0.0.0.0", QUIC_PORT, "LISTEN"],
                                                               ["udp", "0.0.0.0", QUIC_PORT, "NONE"]], \
            f"{name}: {exposed}"
        # A stranger's TLS (a key of its own) and plain garbage on the data port get nothing.
        for mode in ("data-port", "data-garbage"):
            result = stranger(hosts["d"], mode, hosts[name].ip, str(QUIC_PORT))
            assert result.startswith("refused"), (name, mode, result)
        # And from another host, no other TCP port of it answers.
        for _, _, port, _ in listening_tcp:
            if port == QUIC_PORT:
                continue
            refused = ns_python(hosts["d"], f"""
import socket
s = socket.socket(); s.settimeout(3)
try:
    s.connect(({hosts[name].ip!r}, {port})); print("open")
except OSError as e:
    print("closed", e)
""")
            assert refused.startswith("closed"), (name, port, refused)


def test_llama_server_port_needs_the_proxys_key(lab_mesh):
    _, hosts, nodes, _, _ = lab_mesh
    llama = next(p for p in nodes["c"].status()["processes"] if p["name"] == "llama-server")
    code = f"""
import httpx
r = httpx.post("http://127.0.0.1:{llama['port']}/completion", json={{"prompt": "hi", "n_predict": 1}})
print(r.status_code)
"""
    assert ns_python(hosts["c"], code).strip() == "401"


def test_strangers_are_refused_once_each_and_members_keep_serving(lab_mesh):
    lab, hosts, nodes, ticket_a, _ = lab_mesh
    a_ip = hosts["a"].ip
    a_id = nodes["a"].status()["node"]["id"]
    b_id = nodes["b"].status()["node"]["id"]
    secret = json.loads((nodes["a"].home / "mesh.json").read_text())["secret"]
    answer_before = ns_chat(hosts["c"], "Say hello.")

    outcomes = {
        "silent": stranger(hosts["d"], "silent", a_ip, str(QUIC_PORT)),
        "wrong-secret": stranger(hosts["d"], "wrong-secret", a_ip, str(QUIC_PORT), a_id),
        # B's id and even the real secret, but not B's key.
        "impostor": stranger(hosts["d"], "impostor", a_ip, str(QUIC_PORT), a_id, b_id, secret),
    }
    assert "authentication timed out" in outcomes["silent"], outcomes
    assert "wrong mesh secret" in outcomes["wrong-secret"], outcomes
    assert "node key proof failed" in outcomes["impostor"], outcomes
    assert not any("ADMITTED" in o for o in outcomes.values()), outcomes

    flood = subprocess.Popen(hosts["d"].exec_argv(sys.executable, "-m", "tests.helpers.stranger", "flood", a_ip,
                                                  str(QUIC_PORT), str(FLOOD_DATAGRAMS)),
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    # Members keep serving while the flood runs: the request's layers cross A.
    assert ns_chat(hosts["c"], "Say hello.") == answer_before
    assert flood.wait(120) == 0

    log = sidecar_log(nodes["a"])
    for reason in ("authentication timed out", "wrong mesh secret", "node key proof failed"):
        refusals = [line for line in log.splitlines() if "refused" in line and reason in line]
        assert len(refusals) == 1, (reason, refusals)
    assert "ignored" in log and "datagram(s) that belong to no connection" in log
    for name in "abc":
        assert nodes[name].proc.poll() is None
        assert all(state == "connected" for state in peer_states(nodes[name]).values()), name
    assert nodes["a"].status()["mesh"]["ignored_datagrams"] > 0


def test_rotated_secret_shuts_out_the_old_ticket(lab_mesh):
    _, hosts, nodes, old_ticket, root = lab_mesh
    rotated = cli("ticket", "--rotate", "--home", str(nodes["b"].home), prefix=hosts["b"].exec_argv())
    assert rotated.returncode == 0, rotated.stderr
    new_ticket = rotated.stdout.strip()
    assert new_ticket.startswith("meshinf") and new_ticket != old_ticket
    wait_until(lambda: all(nodes[n].status()["mesh"]["secret_epoch"] == 1 for n in "abc"), 20,
               "every member holds the new secret")
    assert all(set(peer_states(nodes[n]).values()) == {"connected"} for n in "abc")

    joined = cli("--home", str(root / "d-old"), "--name", "d", "--join", old_ticket, timeout=90,
                 prefix=hosts["d"].exec_argv())
    assert joined.returncode != 0
    assert "wrong mesh secret" in joined.stderr, joined.stderr
    assert "d" not in peer_states(nodes["a"])
    # `ticket` without --rotate prints a ticket with the new secret.
    current = cli("ticket", "--home", str(nodes["a"].home), prefix=hosts["a"].exec_argv())
    assert current.returncode == 0 and current.stdout.strip() != old_ticket


def test_member_with_other_weights_is_refused_then_kicked(lab_mesh, model_path):
    _, hosts, nodes, _, root = lab_mesh
    other_model = root / "other.gguf"
    data = bytearray(model_path.read_bytes())
    data[-1] ^= 0xFF  # same shape, different weights: only the sha256 can tell
    other_model.write_bytes(bytes(data))
    ticket = cli("ticket", "--home", str(nodes["a"].home), prefix=hosts["a"].exec_argv()).stdout.strip()
    nodes["e"] = start_in(hosts["e"], root / "e", "--join", ticket, "--model", str(other_model))
    wait_until(lambda: WEIGHTS_MISMATCH in nodes["e"].text(), 60, "E is told its weights differ")
    nodes["e"].extra_pids = nodes["e"].child_pids()
    wait_until(lambda: any(p["name"] == "e" and p.get("refused") == WEIGHTS_MISMATCH
                           for p in nodes["c"].status()["peers"]), 20, "C sees E's mismatch")
    plan = json.loads(cli("plan", "--json", "--home", str(nodes["c"].home), prefix=hosts["c"].exec_argv()).stdout)
    assert [r["name"] for r in plan["refused"]] == ["e"] and plan["refused"][0]["reason"] == WEIGHTS_MISMATCH
    assert "e" not in {n["name"] for n in plan["nodes"]}
    assert "e" not in {n["name"] for n in nodes["c"].status()["serving"]["plan"]["nodes"]}

    kicked = cli("kick", "e", "--home", str(nodes["a"].home), prefix=hosts["a"].exec_argv())
    assert kicked.returncode == 0, kicked.stderr
    assert "Removed e" in kicked.stderr
    wait_until(lambda: all(peer_states(nodes[n]).get("e") == "removed" for n in "abc"), 20, "E removed everywhere")
    wait_until(lambda: set(peer_states(nodes["e"]).values()) <= {"lost"}, 20, "E cut off")
    time.sleep(2)  # E would redial now if it could
    assert all(peer_states(nodes[n]).get("e") == "removed" for n in "abc")


def test_no_prompt_text_in_any_log(lab_mesh):
    _, hosts, nodes, _, root = lab_mesh
    llama_log = nodes["c"].home / "logs" / "llama-server.log"
    timings_before = llama_log.read_text(errors="replace").count("prompt eval time")
    ns_chat(hosts["c"], f"Repeat this word: {MARKER}")
    # llama-server logs a request's timings when it ends; once that line is in its log file, the
    # sidecar has copied out everything the request made it print.
    wait_until(lambda: llama_log.read_text(errors="replace").count("prompt eval time") > timings_before, 30,
               "llama-server's log shows the request's timings")
    leaks = [path for path in root.rglob("*") if path.is_file() and MARKER.encode() in path.read_bytes()]
    assert leaks == []


def test_a_member_whose_firewall_drops_tcp_is_named_in_status(lab_mesh):
    # Issue 52: a user who opened only UDP got the QUIC path and no word of it. F's firewall drops TCP to
    # its mesh port (its data path's), as `ufw allow 47470/udp` alone would; A and B stay open.
    lab, hosts, nodes, _, root = lab_mesh
    f = lab.add_host("f")
    for command in ("add table inet firewall",
                    "add chain inet firewall input { type filter hook input priority 0 ; policy accept ; }",
                    f"add rule inet firewall input tcp dport {QUIC_PORT} drop"):
        subprocess.run(f.exec_argv("nft", command), check=True, capture_output=True)
    # The ticket now: kicking E rotated the secret.
    ticket = cli("ticket", "--home", str(nodes["a"].home), prefix=hosts["a"].exec_argv()).stdout.strip()
    nodes["f"] = start_in(f, root / "f", "--join", ticket)
    wait_until(lambda: peer_states(nodes["c"]).get("f") == "connected" or nodes["f"].proc.poll() is not None, 60,
               "F joins")
    assert nodes["f"].proc.poll() is None, nodes["f"].text()
    nodes["f"].extra_pids = nodes["f"].child_pids()
    wait_until(lambda: all(peer_row["data_path"] == "tcp+tls" for peer_row in nodes["c"].status()["peers"]
                           if peer_row["name"] in ("a", "b")), 30, "C reaches A and B over the native path")
    shown = cli("status", "--home", str(nodes["c"].home), prefix=hosts["c"].exec_argv())
    text = " ".join(shown.stdout.split())
    assert f"UDP port {QUIC_PORT}, TCP port" in text, text
    assert "f: reached over QUIC only" in text, text
    assert next(p for p in nodes["c"].status()["peers"] if p["name"] == "f")["data_path"] == "quic"
