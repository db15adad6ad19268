"""Members that lie, between real nodes: each lie is caught and blamed on the liar, the request in flight
goes on over the others, nothing hangs, and no lie makes an honest member look corrupt or slow.

A worker's rpc-server is a lying stand-in (helpers/lying_worker.py) in front of the real one, switched to a
lie once an undisturbed answer came back: NaNs (the baseline), finite values scaled by 1e30, a reply nobody
asked for, a reply of another size than asked. On the serving node each is a fault of that worker
(corrupt_output, of the kind the output check names), on the native data path (the default between nodes
that reach each other) and on the QUIC tunnels (``--data-path quic``).

A member that sends bytes to an honest node's relay chooses what that relay reports about them (REGISTER_PEER's
endpoint): they must never become reports of the relay's own, such as an honest worker's corrupt output.
"""

from __future__ import annotations

import re
import socket
import ssl
import struct
import time
from collections.abc import Sequence

import pytest

from mesh_sidecar.identity import NodeIdentity, load_or_create_identity
from mesh_sidecar.mesh.exclusion import CORRUPT_OUTPUT, FAULT_TEXT
from mesh_sidecar.wire.rpc_framing import (
    B2B_HELLO_FLAG,
    HELLO_REPLY_CAPS_OFFSET,
    HELLO_REPLY_FLAGS_OFFSET,
    MESH_B2B_7,
    REGISTER_PEER_ENDPOINT_BYTES,
    REGISTER_PEER_PAYLOAD_BYTES,
    REPLY_SIZE_BYTES,
    RPC_CONN_CAPS_BYTES,
    RPC_HEADER,
)
from mesh_sidecar.wire.rpc_outputs import (
    ABSOLUTE_OUTLIER,
    NON_FINITE,
    PROTOCOL_VIOLATION,
    UNSOLICITED_REPLY,
    WRONG_REPLY_SIZE,
    protocol_fault,
)
from tests.helpers.llama import complete
from tests.helpers.lying_worker import EARLY_REPLY, NAN, SCALED, WRONG_SIZE, lying_rpc_build
from tests.helpers.nodes import NodeProcess, metrics
from tests.helpers.stranger import DATA_PREAMBLE, RPC_HELLO, presenting
from tests.helpers.waiting import wait_until
from tests.integration.test_data_path import PATH_TIMEOUT_S, peer_row, relay_connections_to, relay_process
from tests.integration.test_data_relay import read_exactly
from tests.integration.test_failover import LONG, Received, assert_goes_on_exactly, receive

pytestmark = pytest.mark.slow

NATIVE: tuple[str, ...] = ()  # the default: each node's native relay, once its peers' relays answer
QUIC = ("--data-path", "quic")
STORY = {**LONG, "max_tokens": 160}
ARMED_AFTER_CHARS = 100  # the lie starts with the client holding this much of the story
CAUGHT_WITHIN_S = 30.0  # from the lie to the next token: a fault is caught at once, not by a stall timer
# Per lie: the fault kind the serving node names, and what its output says of the fault.
FAULTS = {
    NAN: (NON_FINITE, "NaN or Inf among the"),
    SCALED: (ABSOLUTE_OUTLIER, "beyond any real model's"),
    EARLY_REPLY: (PROTOCOL_VIOLATION, protocol_fault(UNSOLICITED_REPLY).detail),
    WRONG_SIZE: (PROTOCOL_VIOLATION, protocol_fault(WRONG_REPLY_SIZE).detail),
}


@pytest.fixture
def lying_build(tmp_path, binaries):
    """``lying_build(b2b_hello=False)``: a --llama-bin directory whose rpc-server is the lying stand-in, and
    the file that names its lie (none yet: it tells the truth)."""

    def build(b2b_hello: bool = False):
        directory, lie_file = tmp_path / "lying-build", tmp_path / "lie"
        lying_rpc_build(binaries, directory, lie_file, b2b_hello=b2b_hello)
        return directory, lie_file

    return build


def three_nodes(start_node, liar_bin, path_args: Sequence[str]) -> tuple[NodeProcess, NodeProcess, NodeProcess]:
    """Workers a and b (b runs the lying rpc-server), c serving the default model split over all three."""
    a = start_node("a", *path_args)
    b = start_node("b", "--join", a.ticket(), "--llama-bin", str(liar_bin), *path_args)
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", *path_args, serve=True)
    return a, b, c


def plan_of(node: NodeProcess) -> set[str]:
    return {n["name"] for n in (node.status()["serving"]["plan"] or {"nodes": []})["nodes"]}


def answers_on_the_path(c: NodeProcess, worker: NodeProcess, path_args: Sequence[str], reference_text: str) -> None:
    """c answers as plain llama-server does, its llama-server reaching ``worker`` over the path ``path_args``
    chose."""
    name = worker.home.name
    if path_args == QUIC:
        assert complete(c.serve_port) == reference_text
        assert peer_row(c, name)["data_path"] == "quic"
        return
    # llama-server takes the native path once the worker's relay answered c's probe: ask until it has.
    port = relay_process(worker)["port"]
    wait_until(lambda: complete(c.serve_port) == reference_text and relay_connections_to(c, port),
               PATH_TIMEOUT_S, f"an answer with llama-server's connection to {name} on the native path")
    assert peer_row(c, name)["data_path"] == "tcp+tls"


def assert_blamed_on_b_alone(a: NodeProcess, b: NodeProcess, c: NodeProcess, lie: str) -> None:
    """b, and only b, is left out as corrupt_output for the fault ``lie`` is; nobody was judged slow."""
    kind, said = FAULTS[lie]
    samples = metrics(c.serve_port)
    assert samples["mesh_corrupt_outputs_total{}"] >= 1 and samples["mesh_slow_workers_total{}"] == 0
    assert plan_of(c) == {"a", "c"}
    peers = {p["name"]: p for p in c.status()["peers"]}
    assert peers["b"]["refused"] == CORRUPT_OUTPUT and peers["a"]["refused"] is None, peers
    assert FAULT_TEXT.get(kind, kind) in peers["b"]["refused_detail"], peers["b"]["refused_detail"]
    assert any("b returned a corrupt layer output (" in line and said in line for line in c.text().splitlines()), \
        c.diagnosis()
    assert "a returned a corrupt layer output" not in c.text()
    # b hears why; a is left out by nobody.
    wait_until(lambda: peer_row(b, "c")["refused"] == CORRUPT_OUTPUT, 30, "b says c leaves it out")
    assert peer_row(a, "c")["refused"] is None


@pytest.mark.parametrize(("lie", "path_args"), [
    pytest.param(NAN, NATIVE, id="nan-native"),
    pytest.param(SCALED, NATIVE, id="scaled-native"),
    pytest.param(EARLY_REPLY, NATIVE, id="early-reply-native"),
    pytest.param(WRONG_SIZE, NATIVE, id="wrong-size-native"),
    pytest.param(EARLY_REPLY, QUIC, id="early-reply-quic"),
    pytest.param(WRONG_SIZE, QUIC, id="wrong-size-quic"),
])
def test_a_worker_lying_mid_stream_is_caught_blamed_and_the_stream_goes_on(lie, path_args, start_node, lying_build,
                                                                            reference_text):
    liar_bin, lie_file = lying_build()
    a, b, c = three_nodes(start_node, liar_bin, path_args)
    assert plan_of(c) == {"a", "b", "c"}
    answers_on_the_path(c, b, path_args, reference_text)
    undisturbed = receive(c.serve_port, "/v1/completions", {**STORY, "logprobs": 1})
    armed_at: list[float] = []

    def lie_once_started(received: Received) -> None:
        if not armed_at and len(received.text()) > ARMED_AFTER_CHARS:
            armed_at.append(time.monotonic())
            lie_file.write_text(lie)

    survived = receive(c.serve_port, "/v1/completions", STORY, lie_once_started)
    assert armed_at
    # The text up to the failover is the undisturbed one, and goes on from exactly there (test_failover.py).
    seam = survived.seam()
    assert survived.text(seam) == undisturbed.text(seam)
    assert_goes_on_exactly(c, "/v1/completions", STORY, survived, undisturbed.token_ids(seam))
    assert survived.events[-1]["choices"][0]["finish_reason"] == "length"
    caught_s = survived.at_s[seam] - armed_at[0]
    print(f"\n{lie} ({'quic' if path_args else 'native'}): next token on the plan without b {caught_s:.1f} s "
          "after the lie began")
    assert caught_s < CAUGHT_WITHIN_S
    assert metrics(c.serve_port)["mesh_streams_resumed_total{how=continued}"] == 1
    assert_blamed_on_b_alone(a, b, c, lie)


def test_a_worker_lying_from_its_first_reply_is_left_out_before_the_first_answer(start_node, lying_build,
                                                                                  reference_text):
    """Values scaled by 1e30 from b's first reply on: b's own history would be all lies, so only the
    absolute bounds can tell; it is caught in llama-server's warm-up (on whichever path its first connection
    to b took) and the first answer comes from a and c."""
    liar_bin, lie_file = lying_build()
    lie_file.write_text(SCALED)
    a, b, c = three_nodes(start_node, liar_bin, NATIVE)
    assert complete(c.serve_port) == reference_text
    assert_blamed_on_b_alone(a, b, c, SCALED)


# --- a member forging an honest member's fault -------------------------------------------------------

MARK = "forged-by-m"
TUNNEL_LINE = re.compile(r"native tunnel (\d+): dialect")


def forged_endpoints(tunnel_ids: Sequence[int]) -> list[bytes]:
    """REGISTER_PEER endpoints that, were a relay to report them raw, would end its line and add reports about
    the serving node's tunnels ``tunnel_ids``: each one's layer output rejected as NaN, and its peer owing a
    minute of replies."""
    lines = [f"rejected {i} {NON_FINITE} l_out-1 1 0 0 0 0" for i in tunnel_ids]
    lines += [f"stats {i} 0 0 0 0 0 60000000" for i in tunnel_ids]
    # "error x" takes the rewritten endpoint the relay appends: a report of its own, read and logged.
    return [f"{MARK}\n{line}\nerror x".encode() for line in lines]


def member_tls(identity: NodeIdentity, source: str, host: str, port: int) -> ssl.SSLSocket:
    """A TLS connection to a node's data port presenting ``identity``'s key, from ``source`` (the address the node
    sees that member's QUIC connection come from: its data port answers no other), as that member's relay dials."""
    return presenting(identity).wrap_socket(socket.create_connection((host, port), timeout=30,
                                                                     source_address=(source, 0)))


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def send_forged_register_peers(member: NodeProcess, node: NodeProcess, endpoints: Sequence[bytes]) -> None:
    """As ``member`` (its key, from its address): RPC through ``node``'s relay to its rpc-server, HELLO, then one
    REGISTER_PEER (peer 0) per endpoint, each after the answer to the one before."""
    source = host_of(peer_row(node, member.home.name)["address"])
    host = host_of(peer_row(member, node.home.name)["address"])
    with member_tls(load_or_create_identity(member.home), source, host, relay_process(node)["port"]) as conn:
        conn.sendall(DATA_PREAMBLE + RPC_HELLO)
        reply = read_exactly(conn, REPLY_SIZE_BYTES + HELLO_REPLY_CAPS_OFFSET + RPC_CONN_CAPS_BYTES)
        assert reply[REPLY_SIZE_BYTES + HELLO_REPLY_FLAGS_OFFSET] & B2B_HELLO_FLAG, reply.hex()  # b2b: REGISTER_PEER
        for endpoint in endpoints:
            conn.sendall(RPC_HEADER.pack(MESH_B2B_7.register_peer_cmd, REGISTER_PEER_PAYLOAD_BYTES)
                         + struct.pack(f"<I{REGISTER_PEER_ENDPOINT_BYTES}s", 0, endpoint))
            read_exactly(conn, REPLY_SIZE_BYTES + 1)  # its u8 answer


def test_a_member_cannot_make_an_honest_worker_look_corrupt_or_slow(start_node, lying_build, reference_text):
    """m serves a model of its own (so it announces an RPC order: c's relay then maps REGISTER_PEER's peer 0),
    and sends c's rpc-server REGISTER_PEER frames whose endpoints carry report lines naming c's tunnels to its
    workers a and w. c's rpc-server answers HELLO as the b2b build does (the lying stand-in's --b2b-hello, telling
    no lie), and c holds no layers, so its rpc-server is free for m's connection as a b2b one would be."""
    honest_bin, _ = lying_build(b2b_hello=True)
    a = start_node("a")
    w = start_node("w", "--join", a.ticket())
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", "--max-memory", "60M",
                   "--llama-bin", str(honest_bin), serve=True)
    assert plan_of(c) == {"a", "w"}
    for worker in (a, w):
        answers_on_the_path(c, worker, NATIVE, reference_text)
    m = start_node("m", "--join", a.ticket(), serve=True, spread=False)
    assert plan_of(m) == {"m"}
    # c knows where m's relay is (so its data port answers m's address).
    wait_until(lambda: peer_row(c, "m")["data_path"] == "tcp+tls", PATH_TIMEOUT_S, "c reaches m's relay")
    log = c.home / "logs" / "sidecar.log"
    endpoints = forged_endpoints(sorted({int(i) for i in TUNNEL_LINE.findall(log.read_text(errors="replace"))}))
    assert endpoints, "c's llama-server has tunnel connections on the native path"
    send_forged_register_peers(m, c, endpoints)

    # The frames reached c's relay, which reported each endpoint it rewrote (so the test is not vacuous)...
    wait_until(lambda: log.read_text(errors="replace").count(MARK) >= len(endpoints), 10,
               "c's sidecar logs every REGISTER_PEER endpoint its relay rewrote")
    # ...as its own words about them, never as reports of its own.
    assert complete(c.serve_port) == reference_text
    samples = metrics(c.serve_port)
    assert samples["mesh_corrupt_outputs_total{}"] == 0 and samples["mesh_slow_workers_total{}"] == 0
    assert plan_of(c) == {"a", "w"}
    assert all(p["refused"] is None for p in c.status()["peers"]), c.status()["peers"]
    text = log.read_text(errors="replace") + c.text()
    assert "corrupt layer output" not in text and "holding tokens up" not in text
