"""The native relay pair with a real ggml-rpc-server behind it: the tunnel tests' first checks on the
native path (test_tunnel.py runs them on QUIC), its counters, its refusals and its restart; and with a
stand-in one that times its bytes as a real one does only by chance."""

from __future__ import annotations

import contextlib
import datetime
import socket
import ssl
import struct
import subprocess
import threading
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from mesh_sidecar.identity import generate_identity
from mesh_sidecar.llama.launch import start_rpc_server
from mesh_sidecar.net.data_plane import control_lines as reports
from mesh_sidecar.net.data_plane.build import ensure_data_relay
from mesh_sidecar.net.data_plane.control_lines import MAX_HANDSHAKES_PER_ADDRESS
from mesh_sidecar.net.data_plane.process import MAX_HANDSHAKES
from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.wire.rpc_framing import GET_TENSOR_CMD, RPC_TENSOR_BYTES, RPC_TENSOR_NAME_OFFSET
from mesh_sidecar.wire.rpc_outputs import HISTORY_SAMPLES, MIN_HISTORY_SAMPLES, NORM_RATIO
from tests.helpers.relay_pair import RelayPair
from tests.helpers.tunnels import DEVICE_COUNT_CMD, GET_DEVICE_MEMORY_CMD, HELLO_REQUEST, RPC_HEADER, U64
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow


def read_exactly(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"closed after {len(data)} of {n} bytes"
        data += chunk
    return data


@pytest.fixture
async def rpc_server(binaries, tmp_path):
    port = free_tcp_port()
    server = await start_rpc_server(binaries, port, tmp_path)
    yield port
    await server.stop()


@pytest.fixture
def pair(rpc_server):
    relays = RelayPair(ensure_data_relay(lambda *_: None), rpc_server)
    yield relays
    relays.close()


def test_real_rpc_server_answers_through_the_native_tunnel(pair):
    sock = pair.tunnel(1, check=True)
    sock.settimeout(15)
    sock.sendall(HELLO_REQUEST)
    reply = read_exactly(sock, 8 + 28)
    assert U64.unpack_from(reply)[0] == 28 and reply[8:11] == bytes([7, 0, 0]), reply.hex()
    sock.sendall(RPC_HEADER.pack(DEVICE_COUNT_CMD, 0))
    size, count = struct.unpack("<QI", read_exactly(sock, 8 + 4))
    assert size == 4 and count >= 1
    sock.sendall(RPC_HEADER.pack(GET_DEVICE_MEMORY_CMD, 4) + struct.pack("<I", 0))
    size, free, total = struct.unpack("<QQQ", read_exactly(sock, 8 + 16))
    assert size == 16 and total > 0 and free <= total
    sock.shutdown(1)  # a half-close travels: the rpc-server ends, and so does our side
    assert sock.recv(16) == b""
    sock.close()
    pair.wait_for("a", lambda r: isinstance(r, reports.Closed) and r.id == 1, "the tunnel closed")
    stats = [r for r in pair.reports["a"] if isinstance(r, reports.Stats) and r.id == 1]
    assert sum(s.from_client_bytes for s in stats) == len(HELLO_REQUEST) + 9 + 13
    assert sum(s.from_server_bytes for s in stats) == 36 + 12 + 24
    # B's side: one member connection into the rpc-server, its commands counted by the watch.
    inbound = pair.wait_for("b", lambda r: isinstance(r, reports.Inbound), "B's inbound connection")
    assert inbound.node_id == pair.a_id.node_id
    pair.wait_for("b", lambda r: isinstance(r, reports.Stats) and r.id == inbound.id and r.frames, "B's counts")
    assert any(isinstance(r, reports.Event) and r.what == "dialect" and r.text.startswith("upstream-7 7.0")
               for r in pair.reports["b"])


def test_a_forgotten_member_is_refused_and_its_probe_fails(pair):
    seen_a, seen_b = len(pair.reports["a"]), len(pair.reports["b"])
    pair.call(lambda: pair.b.forget(pair.a_id.node_id))
    pair.call(lambda: pair.a.probe(pair.b_id.node_id, "127.0.0.1", pair.b.port))
    result = pair.wait_for("a", lambda r: isinstance(r, reports.ProbeResult), "the probe's result", seen_a)
    assert not result.ok
    refused = pair.wait_for("b", lambda r: isinstance(r, reports.Refused), "B refusing A", seen_b)
    assert dict(refused.reasons) == {"not-allowed": 1} and refused.address == "127.0.0.1"  # before any TLS
    # From an address a member dials from (another member's, here), the key is what refuses it.
    seen_a, seen_b = len(pair.reports["a"]), len(pair.reports["b"])
    pair.call(lambda: pair.b.member(generate_identity().node_id, ("127.0.0.1",)))
    pair.call(lambda: pair.a.probe(pair.b_id.node_id, "127.0.0.1", pair.b.port))
    assert not pair.wait_for("a", lambda r: isinstance(r, reports.ProbeResult), "the probe's result", seen_a).ok
    refused = pair.wait_for("b", lambda r: isinstance(r, reports.Refused), "B refusing A", seen_b, timeout_s=15)
    assert dict(refused.reasons) == {"not-a-member": 1}


def test_a_killed_relay_comes_back_on_the_same_port(pair):
    port, seen = pair.a.port, len(pair.reports["a"])
    pair.a.kill()
    hello = pair.wait_for("a", lambda r: isinstance(r, reports.Hello), "relay A started again", seen, timeout_s=20)
    assert hello.port == port == pair.a.port and pair.a.restarts == 1
    sock = pair.tunnel(2)  # members and routes were told again: it relays at once
    sock.sendall(HELLO_REQUEST)
    assert U64.unpack_from(read_exactly(sock, 8 + 28))[0] == 28
    sock.close()


def test_a_tunnel_whose_peer_relay_is_gone_comes_back_unread(pair):
    """The peer's relay does not answer (here: a closed port): the socket comes back to the sidecar with
    every byte llama-server sent still unread, for the QUIC path to carry."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    client.sendall(HELLO_REQUEST)
    closed_port = free_tcp_port()
    pair.call(lambda: pair.a.tunnel(7, pair.b_id.node_id, "127.0.0.1", closed_port, True, accepted))
    accepted.close()
    handed = pair.wait_for("a", lambda r: isinstance(r, reports.HandedBack), "the tunnel handed back")
    assert handed.id == 7 and not any(isinstance(r, reports.Closed) and r.id == 7 for r in pair.reports["a"])
    _, sock = pair.taken_back[-1]
    sock.settimeout(5)
    assert read_exactly(sock, len(HELLO_REQUEST)) == HELLO_REQUEST  # nothing was read on its way
    sock.sendall(b"still open")
    assert read_exactly(client, 10) == b"still open"


def checked_tunnel(relays: RelayPair, conn_id: int) -> socket.socket:
    """A tunnel with the output check on, past its HELLO (the stand-in servers answer a 7.x one)."""
    sock = relays.tunnel(conn_id, check=True)
    sock.settimeout(10)
    sock.sendall(HELLO_REQUEST)
    read_exactly(sock, 8 + 28)
    return sock


def _serve_one_get_tensor(listener: socket.socket, reply: bytes, first: int, pause_s: float) -> None:
    """A stand-in rpc-server for one client: it answers HELLO, then one GET_TENSOR with ``reply``, its
    first ``first`` bytes at once and the rest after ``pause_s`` (so the TLS records the relays carry
    end exactly there, with nothing after them for a while)."""
    conn, _ = listener.accept()
    with conn:
        read_exactly(conn, len(HELLO_REQUEST))
        conn.sendall(U64.pack(28) + bytes([7, 0, 0, 0]) + bytes(24))
        _, size = RPC_HEADER.unpack(read_exactly(conn, RPC_HEADER.size))
        read_exactly(conn, size)
        conn.sendall(reply[:first])
        time.sleep(pause_s)
        conn.sendall(reply[first:])
        conn.recv(1)  # until the client leaves


@pytest.mark.parametrize("first", [256 * 1024, 512 * 1024])  # the buffer as it starts, and grown once
def test_a_checked_reply_that_fills_the_buffer_to_a_record_boundary_goes_on(first):
    """A checked (F32) GET_TENSOR reply is held whole, its buffer grown as it fills. A TLS read that
    filled the buffer exactly, with nothing more read ahead, once left the connection watching no
    event (a full buffer is not read from) while the rest of the reply waited in the socket: the
    serving node's llama-server then waited for ever (test_b2b's 1.2 MB activations, once in a while)."""
    values = 256 * 1024  # 1 MiB of F32: the 256 KiB buffer fills and grows on the way
    data = struct.pack("<f", 1.0) * values
    reply = U64.pack(len(data)) + data
    head = bytearray(RPC_TENSOR_BYTES)
    struct.pack_into("<QI", head, 0, 1, 0)  # id, GGML_TYPE_F32
    head[RPC_TENSOR_NAME_OFFSET:RPC_TENSOR_NAME_OFFSET + 7] = b"l_out-3"
    get_tensor = bytes(head) + U64.pack(0) + U64.pack(len(data))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = threading.Thread(target=_serve_one_get_tensor, daemon=True,
                                  args=(listener, reply, first, 0.5))
        server.start()
        relays = RelayPair(ensure_data_relay(lambda *_: None), listener.getsockname()[1])
        try:
            sock = checked_tunnel(relays, 1)
            sock.sendall(RPC_HEADER.pack(GET_TENSOR_CMD, len(get_tensor)) + get_tensor)
            assert read_exactly(sock, len(reply)) == reply
            sock.close()
        finally:
            relays.close()
        server.join(10)


def _get_tensor_of(values: int) -> bytes:
    head = bytearray(RPC_TENSOR_BYTES)
    struct.pack_into("<QI", head, 0, 1, 0)  # id, GGML_TYPE_F32
    head[RPC_TENSOR_NAME_OFFSET:RPC_TENSOR_NAME_OFFSET + 8] = b"l_out-14"
    body = bytes(head) + U64.pack(0) + U64.pack(4 * values)
    return RPC_HEADER.pack(GET_TENSOR_CMD, len(body)) + body


def _serve_outputs(listener: socket.socket, sessions: list[list[float]], values: int) -> None:
    """A stand-in rpc-server for one client per session: HELLO, then a GET_TENSOR answered with ``values``
    F32 values of each RMS listed, in turn."""
    for session in sessions:
        conn, _ = listener.accept()
        with conn:
            read_exactly(conn, len(HELLO_REQUEST))
            conn.sendall(U64.pack(28) + bytes([7, 0, 0, 0]) + bytes(24))
            for rms in session:
                _, size = RPC_HEADER.unpack(read_exactly(conn, RPC_HEADER.size))
                read_exactly(conn, size)
                conn.sendall(U64.pack(4 * values) + struct.pack("<f", rms) * values)
            with contextlib.suppress(OSError):  # a rejected reply's connection is reset
                conn.recv(1)


def test_a_workers_outputs_are_judged_over_its_connections_until_a_new_session():
    """A worker's history spans its connections, so a fresh connection is no fresh start: a value that is an
    outlier within a session (RMS 882 where 5-8 ran) is one on the next connection too. A new llama-server
    session (the sidecar's ``new-session``) starts the histories anew: its warm-up's first token, far from
    a running session's outputs, passes."""
    values, running, warm_up = 64, [5.5, 8.4] * MIN_HISTORY_SAMPLES, 882.0
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = threading.Thread(target=_serve_outputs, daemon=True,
                                  args=(listener, [[*running, warm_up], [warm_up], [warm_up]], values))
        server.start()
        relays = RelayPair(ensure_data_relay(lambda *_: None), listener.getsockname()[1])
        try:
            first = checked_tunnel(relays, 1)
            for _ in running:
                first.sendall(_get_tensor_of(values))
                read_exactly(first, 8 + 4 * values)
            for conn_id in (1, 2):  # the stand-in server takes one connection at a time
                sock = first if conn_id == 1 else checked_tunnel(relays, conn_id)
                sock.sendall(_get_tensor_of(values))
                with pytest.raises((ConnectionError, AssertionError, TimeoutError)):
                    read_exactly(sock, 8 + 4 * values)  # held back, the connection reset
                sock.close()
                rejected = relays.wait_for("a", lambda r, i=conn_id: isinstance(r, reports.Rejected) and r.id == i,
                                           "the outlier rejected")
                assert rejected.kind == "norm_outlier" and rejected.count == len(running)
            relays.call(relays.a.new_session)
            third = checked_tunnel(relays, 3)
            third.sendall(_get_tensor_of(values))
            assert read_exactly(third, 8 + 4 * values)[8:12] == struct.pack("<f", warm_up)
            third.close()
        finally:
            relays.close()
        server.join(10)


def _replay(lines: list[str]) -> list[str]:
    """``mesh-data-relay --replay`` over ``lines`` (configured first, as a relay is at its start): the
    lines it printed that are not the bytes it released."""
    config = [line for line in reports.configuration_lines(
        b"", b"", handshake_timeout_s=5, max_connections=8, max_handshakes=4, history=HISTORY_SAMPLES,
        min_history=MIN_HISTORY_SAMPLES, norm_ratio=NORM_RATIO) if not line.startswith("identity")]
    out = subprocess.run([str(ensure_data_relay(lambda *_: None)), "--replay"],
                         input="\n".join(config + lines) + "\n", capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    return [line for line in out if not line.startswith(("up ", "down "))]


def test_an_endpoint_with_newlines_forges_no_report_line():
    """A member chooses REGISTER_PEER's endpoint bytes, and the relay reports the endpoint it rewrote: newlines
    in it once ended the "event" line and made the rest two reports of the member's choosing."""
    node = bytes(range(32))
    forged = b"x\nrejected 1 non_finite l_out-1 1 0 0 0 0\nstats 1 9 9 9 9 9 9\x00"
    hello_reply_b2b = U64.pack(28) + bytes([7, 0, 2, 1]) + bytes(24)
    register_peer = RPC_HEADER.pack(18, 132) + struct.pack("<I128s", 0, forged)
    lines = _replay([f"member {node.hex()}", f"endpoint {node.hex()} 0 127.0.0.1:50052", f"watch 0 1 {node.hex()}",
                     f"c {HELLO_REQUEST.hex()}", f"s {hello_reply_b2b.hex()}", f"c {register_peer.hex()}"])
    parsed = [reports.parse_report(line.encode()) for line in lines]  # each one printable, known report
    assert [type(r) for r in parsed] == [reports.Event, reports.Event], lines
    assert parsed[1].what == "rewritten" and parsed[1].text.startswith("0 x"), parsed[1]


def _silent(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


def _held(socks: list[socket.socket], settle_s: float = 0.5) -> list[bool]:
    """Which of ``socks`` the relay keeps open (waiting for a handshake) rather than reset."""
    time.sleep(settle_s)  # the relay accepts each at once: a refused one's RST is here by now
    held = []
    for sock in socks:
        sock.setblocking(False)
        try:
            held.append(sock.recv(1) != b"")
        except BlockingIOError:
            held.append(True)
        except ConnectionError:
            held.append(False)
    return held


@pytest.fixture
def bare_pair():
    """Two relays with no rpc-server behind B (what only the data port's front door needs)."""
    relays = RelayPair(ensure_data_relay(lambda *_: None), free_tcp_port())
    yield relays
    relays.close()


def test_probes_give_their_handshake_slot_back_once(bare_pair):
    """A probe's slot among the connections not yet authenticated was given back twice (after its preamble,
    and again as it was freed): after 20 probes, 36 silent strangers held the 16 slots. Here: after 20
    probes, exactly the caps hold (4 from one address, 16 in all), from addresses of a member's."""
    pair, per = bare_pair, MAX_HANDSHAKES_PER_ADDRESS
    sources = [f"127.0.0.{i}" for i in range(2, 3 + MAX_HANDSHAKES // per)]  # one more than the caps fill
    pair.call(lambda: pair.b.member(pair.a_id.node_id, ("127.0.0.1", *sources)))
    for _ in range(20):
        seen = len(pair.reports["a"])
        pair.call(lambda: pair.a.probe(pair.b_id.node_id, "127.0.0.1", pair.b.port))
        assert pair.wait_for("a", lambda r: isinstance(r, reports.ProbeResult), "a probe's result", seen).ok
    seen = len(pair.reports["b"])
    silent = [_silent(pair.b.port, sources[0]) for _ in range(per + 1)]
    silent += [_silent(pair.b.port, source) for source in sources[1:-1] for _ in range(per)]
    silent.append(_silent(pair.b.port, sources[-1]))
    try:
        assert _held(silent) == [True] * per + [False] + [True] * (MAX_HANDSHAKES - per) + [False]
        pair.wait_for("b", lambda r: isinstance(r, reports.Refused) and "too-many-connections" in dict(r.reasons),
                      "the refusals", seen)  # the first at once, the next within a second
        assert sorted(why for r in pair.reports["b"][seen:] for why, _ in r.reasons) == [
            "too-many-connections", "too-many-from-address"]
    finally:
        for sock in silent:
            sock.close()


def test_a_strangers_flood_moves_no_member_off_the_native_path(bare_pair):
    """A stranger keeps 40 connections to a member's data port, opening new ones as they are closed: its
    address is no member's, so each is closed at accept, before any TLS; the member's probes still pass,
    and the relay sums the refusals in one line a second."""
    pair, stop, opened = bare_pair, threading.Event(), [0]

    def flood() -> None:
        socks: list[socket.socket] = []
        while not stop.is_set():
            while len(socks) < 40:
                try:
                    socks.append(_silent(pair.b.port, "127.0.0.9"))
                except ConnectionResetError:
                    pass  # accepted and reset before connect() returned
                opened[0] += 1
            held = _held(socks, settle_s=0.02)
            for sock, alive in zip(list(socks), held, strict=True):
                if not alive:
                    sock.close()
                    socks.remove(sock)
        for sock in socks:
            sock.close()

    seen, started = len(pair.reports["b"]), time.monotonic()
    stranger = threading.Thread(target=flood, daemon=True)
    stranger.start()
    try:
        time.sleep(0.5)
        for _ in range(5):
            after = len(pair.reports["a"])
            pair.call(lambda: pair.a.probe(pair.b_id.node_id, "127.0.0.1", pair.b.port))
            assert pair.wait_for("a", lambda r: isinstance(r, reports.ProbeResult), "a probe's result", after).ok
            time.sleep(0.3)
    finally:
        stop.set()
        stranger.join(10)
    # The last second's sum comes within a second; waited for, so a busy machine cannot break it.
    wait_until(lambda: sum(r.count for r in pair.reports["b"][seen:] if isinstance(r, reports.Refused)) >= opened[0],
               30, "every refusal summed")
    elapsed_s = time.monotonic() - started
    lines = pair.reports["b"][seen:]
    assert all(isinstance(r, reports.Refused) for r in lines), lines
    assert sum(r.count for r in lines) == opened[0] and opened[0] > 100
    assert {why for r in lines for why, _ in r.reasons} == {"not-allowed"} and lines[-1].address == "127.0.0.9"
    assert len(lines) <= elapsed_s + 2

def _checked_replay(server_bytes: bytes, values: int = 64) -> list[str]:
    """A checked connection through --replay: HELLO, one GET_TENSOR, then ``server_bytes`` after the HELLO reply."""
    node = bytes(range(32))
    hello_reply = U64.pack(28) + bytes([7, 0, 0, 0]) + bytes(24)
    return _replay([f"member {node.hex()}", f"watch 1 0 {node.hex()}", f"c {HELLO_REQUEST.hex()}",
                    f"s {hello_reply.hex()}", f"c {_get_tensor_of(values).hex()}", f"s {server_bytes.hex()}"])


def test_a_value_no_real_model_produces_is_rejected_from_the_first_reply():
    """Judged before any history: a worker scaling its outputs from the first reply on builds no history to
    be an outlier against."""
    values = 64
    dense = _checked_replay(U64.pack(4 * values) + struct.pack("<f", 1e7) * values)
    spike = _checked_replay(U64.pack(4 * values) + struct.pack("<f", 1e9) + struct.pack("<f", 1.0) * (values - 1))
    for lines, rms, largest in ((dense, 1e7, 1e7), (spike, 1e9 / 8, 1e9)):
        rejected = [r for r in map(reports.parse_report, (line.encode() for line in lines))
                    if isinstance(r, reports.Rejected)]
        assert len(rejected) == 1 and rejected[0].kind == "absolute_outlier", lines
        assert rejected[0].rms == pytest.approx(rms, rel=1e-3) and rejected[0].max_abs == pytest.approx(largest)


def test_a_protocol_violation_is_rejected():
    """A reply of another size than the GET_TENSOR asked for: the worker's fault, reported as a rejection."""
    lines = _checked_replay(U64.pack(8) + bytes(8))
    rejected = [reports.parse_report(line.encode()) for line in lines if line.startswith("rejected ")]
    assert [(r.kind, r.name, r.values) for r in rejected] == [("protocol", "wrong-reply-size", 0)], lines
    assert any(line.startswith("event 1 violation wrong-reply-size") for line in lines), lines


def test_a_certificate_over_another_key_type_is_refused_in_the_handshake(bare_pair, tmp_path):
    """TLS takes Ed25519 keys and the X25519 group only: a stranger at a member's address presenting an RSA
    certificate is refused before any signature of it is checked."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stranger")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(datetime.datetime(2020, 1, 1))
            .not_valid_after(datetime.datetime(2100, 1, 1)).sign(key, hashes.SHA256()))
    pem = tmp_path / "stranger.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.load_cert_chain(pem)
    seen = len(bare_pair.reports["b"])
    with (socket.create_connection(("127.0.0.1", bare_pair.b.port), timeout=5) as raw,
          pytest.raises((ssl.SSLError, ConnectionError)), context.wrap_socket(raw) as conn):
        conn.sendall(b"MESH\x01\x02")
        assert conn.recv(1) == b""  # TLS 1.3: the client learns of the refusal on its first read
        raise ConnectionError("closed")
    refused = bare_pair.wait_for("b", lambda r: isinstance(r, reports.Refused), "the refusal", seen)
    assert dict(refused.reasons) == {"tls-handshake-failed": 1}


def test_a_member_reset_while_our_rpc_server_connect_is_pending_passes_nothing():
    """The member's side reset while B's connect to its rpc-server was still in progress once ran the pump
    with no watch set up (it was set up only once connected): the member's bytes went to rpc-server unread,
    or the relay crashed. Here the rpc-server's accept queue is full, so B's connect waits."""
    with socket.socket() as rpc_server:
        rpc_server.bind(("127.0.0.1", 0))
        rpc_server.listen(0)
        filler = socket.create_connection(rpc_server.getsockname())  # the one connection the queue holds
        relays = RelayPair(ensure_data_relay(lambda *_: None), rpc_server.getsockname()[1])
        try:
            pid, seen = relays.b.pid, len(relays.reports["b"])
            sock = relays.tunnel(1)
            sock.sendall(HELLO_REQUEST)
            time.sleep(0.3)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # an RST: relay A resets its connection to B
            time.sleep(1.0)
            assert relays.b.pid == pid and relays.b.restarts == 0
            assert not [r for r in relays.reports["b"][seen:] if not isinstance(r, reports.Refused)]
            accepted, _ = rpc_server.accept()  # the filler: nothing else reached rpc-server
            with accepted:
                rpc_server.setblocking(False)
                with pytest.raises(BlockingIOError):
                    rpc_server.accept()
        finally:
            relays.close()
            filler.close()
