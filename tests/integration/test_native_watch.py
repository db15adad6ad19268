"""The native relay's RPC watch against the Python filters it mirrors, on the same byte streams.

``mesh-data-relay --replay`` (net/data_plane/native/README.md, "Testing") runs rpc_watch.c and the relay's judge
over client and server chunks; wire/rpc_outputs.py (its check and its rule, OutputGuard)
and wire/rpc_framing.py get the same chunks. Every stream is also split at every byte boundary.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import mesh_sidecar.net.data_plane.native
from mesh_sidecar.mesh.data_paths import DataPaths
from mesh_sidecar.net.data_plane.build import ensure_data_relay
from mesh_sidecar.net.data_plane.control_lines import Event, ProbeResult, configuration_lines, parse_report
from mesh_sidecar.wire.rpc_framing import EndpointRewritten, RpcStreamFilter, printable_word
from mesh_sidecar.wire.rpc_outputs import (
    ABSOLUTE_OUTLIER,
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    HISTORY_SAMPLES,
    MIN_HISTORY_SAMPLES,
    NORM_RATIO,
    PROTOCOL_VIOLATION,
    OutputGuard,
    OutputRejected,
    RpcOutputCheck,
    measure,
    protocol_fault,
)
from tests.unit.test_rpc_outputs import WORKER_VIOLATIONS

NODE = bytes(range(32))
HELLO = bytes([14]) + struct.pack("<Q", 24) + bytes(24)
HELLO_REPLY_7 = struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24)
HELLO_REPLY_B2B = struct.pack("<Q", 28) + bytes([7, 0, 2, 1]) + bytes(24)


def tensor(name: str, ggml_type: int = 0) -> bytes:
    raw = bytearray(296)
    struct.pack_into("<QI", raw, 0, 1, ggml_type)
    raw[228:228 + len(name)] = name.encode()
    return bytes(raw)


def get_tensor(name: str, size: int) -> bytes:
    payload = tensor(name) + struct.pack("<QQ", 0, size)
    return bytes([8]) + struct.pack("<Q", len(payload)) + payload


def reply(values: np.ndarray) -> bytes:
    data = values.astype("<f4").tobytes()
    return struct.pack("<Q", len(data)) + data


def register_peer(index: int, endpoint: bytes) -> bytes:
    return bytes([18]) + struct.pack("<Q", 132) + struct.pack("<I128s", index, endpoint)


@pytest.fixture(scope="module")
def relay_binary():
    return ensure_data_relay(lambda *_: None)


def setup_lines() -> list[str]:
    """What a relay is told at its start, but its identity (--replay has no TLS)."""
    lines = configuration_lines(b"", b"", handshake_timeout_s=5, max_connections=8, max_handshakes=4,
                                history=HISTORY_SAMPLES, min_history=MIN_HISTORY_SAMPLES, norm_ratio=NORM_RATIO)
    return [line for line in lines if not line.startswith("identity")]


def replay_lines(binary, lines: list[str]) -> list[str]:
    return subprocess.run([str(binary), "--replay"], input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=60, check=True).stdout.splitlines()


def replay(binary, check: bool, rewrite: bool, chunks: list[tuple[str, bytes]],
           endpoints=()) -> tuple[bytes, bytes, list[str]]:
    lines = setup_lines()
    lines += [f"member {NODE.hex()}", *(f"endpoint {NODE.hex()} {i} {e}" for i, e in endpoints),
              f"watch {int(check)} {int(rewrite)} {NODE.hex()}"]
    lines += [f"{side} {data.hex()}" for side, data in chunks]
    out = replay_lines(binary, lines)
    up = b"".join(bytes.fromhex(line[3:]) for line in out if line.startswith("up "))
    down = b"".join(bytes.fromhex(line[5:]) for line in out if line.startswith("down "))
    return up, down, [line for line in out if not line.startswith(("up ", "down "))]


def splits(side: str, data: bytes, every: int) -> list[tuple[str, bytes]]:
    return [(side, data[i:i + every]) for i in range(0, len(data), every)]


def python_check(chunks: list[tuple[str, bytes]]) -> tuple[bytes, list[OutputRejected]]:
    guard = OutputGuard()
    check = RpcOutputCheck(lambda t: guard.judge(NODE, t))
    down, rejected = b"", []
    for side, data in chunks:
        if side == "c":
            check.receive_from_client(data)
        else:
            check.receive_from_server(data)
            down += check.data_to_client()
        while (event := check.next_event()) is not None:
            if isinstance(event, OutputRejected):
                rejected.append(event)
    return down, rejected


def checked_stream(last: np.ndarray) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(7)
    client = [("c", HELLO), ("s", HELLO_REPLY_7)]
    for _ in range(MIN_HISTORY_SAMPLES + 2):
        client += [("c", get_tensor("l_out-3", 64 * 4)), ("s", reply(rng.normal(0, 1, 64)))]
    return client + [("c", get_tensor("l_out-3", 64 * 4)), ("s", reply(last))]


@pytest.mark.parametrize("last, kind", [
    (np.ones(64), None),
    (np.full(64, np.nan), "non_finite"),
    (np.full(64, 1e4), "norm_outlier"),
])
@pytest.mark.parametrize("every", [1, 7, 1 << 20])
def test_the_output_check_agrees_with_pythons(relay_binary, last, kind, every):
    stream = checked_stream(last)
    chunks = [piece for side, data in stream for piece in splits(side, data, every)]
    _, down, events = replay(relay_binary, True, False, chunks)
    python_down, python_rejected = python_check(chunks)
    assert down == python_down  # byte for byte: a rejected reply is kept back by both
    rejected = [e for e in events if e.startswith("rejected ")]
    assert [r.split()[2] for r in rejected] == [e.fault.kind for e in python_rejected] == ([kind] if kind else [])


def violation_stream(name: str) -> list[tuple[str, bytes]]:
    """A worker's protocol violation (tests/unit/test_rpc_outputs.py), then a NaN it would slip through."""
    session, _ = WORKER_VIOLATIONS[name]
    nan = np.full(64, np.nan)
    return [("c" if side == "client" else "s", data) for side, data in session] + [
        ("c", get_tensor("l_out-3", nan.size * 4)), ("s", reply(nan))]


VIOLATION_STREAMS = {
    **{name: violation_stream(name) for name in WORKER_VIOLATIONS},
    # The finding itself: the early reply rides in the HELLO reply's segment.
    "early-reply-with-hello-reply": [("c", HELLO), ("s", HELLO_REPLY_7 + struct.pack("<Q", 1) + b"x"),
                                     ("c", get_tensor("l_out-3", 256)), ("s", reply(np.full(64, np.nan)))],
}


@pytest.mark.parametrize("name", VIOLATION_STREAMS)
@pytest.mark.parametrize("every", [1, 7, 1 << 20])
def test_a_worker_cannot_switch_the_check_off_in_either(relay_binary, name, every):
    """A reply to no command, a first reply too big for HELLO, a HELLO reply of no dialect, a tensor of another
    size: the watch stops and keeps the bytes back, byte for byte as Python's check, and never goes off."""
    chunks = [piece for side, data in VIOLATION_STREAMS[name] for piece in splits(side, data, every)]
    _, down, events = replay(relay_binary, True, False, chunks)
    python_down, python_rejected = python_check(chunks)
    assert down == python_down
    assert [e.fault.kind for e in python_rejected] == [PROTOCOL_VIOLATION]
    assert not any(" check-off " in e for e in events), events
    assert not any(e.startswith("rejected ") and " protocol " not in e for e in events)  # the NaN never judged


def sidecar_verdicts(relay_lines: list[str]) -> list[OutputRejected]:
    """The relay's report lines as the sidecar turns them into verdicts (mesh/data_paths.py), for tunnel 1."""
    relay = SimpleNamespace(port=1, running=True, member=lambda *_: None, probe=lambda *_: None,
                            tunnel=lambda *_: True)
    verdicts: list[OutputRejected] = []
    paths = DataPaths(relay, SimpleNamespace(rejected=lambda _, event: verdicts.append(event)), lambda _: None)
    paths.peer_seen(NODE, SimpleNamespace(relayed=False, remote_address=("10.0.0.2", 1)), 5000)
    paths.on_report(ProbeResult(NODE, True, 1, ""))
    assert paths.hand_over(NODE, None, True, SimpleNamespace(native_opened=lambda _: None))
    for line in relay_lines:
        paths.on_report(parse_report(line.encode()))
    return verdicts


@pytest.mark.parametrize("name", WORKER_VIOLATIONS)
def test_the_relay_reports_a_workers_protocol_violation(relay_binary, name):
    """...and the sidecar blames the worker for it as the QUIC path does."""
    stream = violation_stream(name)
    _, _, events = replay(relay_binary, True, False, stream)
    reason = WORKER_VIOLATIONS[name][1]
    assert [e for e in events if e.startswith("rejected ")] == [f"rejected 1 protocol {reason} 0 0 0 0 0"]
    [python] = python_check(stream)[1]
    [verdict] = sidecar_verdicts(events)
    assert verdict.tensor is python.tensor is None and verdict.fault.kind == python.fault.kind == PROTOCOL_VIOLATION
    assert reason in verdict.fault.detail
    [text] = [e.removeprefix("event 1 violation ") for e in events if e.startswith("event 1 violation ")]
    assert python.fault == protocol_fault(*text.split(" ", 1))  # the same words as the watch's event


@pytest.mark.parametrize("scale", [1e30, 1e7])
def test_values_beyond_any_real_model_are_rejected_from_the_first_reply_by_both(relay_binary, scale):
    """The relative rule needs a history; a worker scaling every value from its first reply builds its own."""
    values = np.random.default_rng(5).normal(0, 1, 64) * scale
    chunks = [("c", HELLO), ("s", HELLO_REPLY_7), ("c", get_tensor("l_out-3", 256)), ("s", reply(values))]
    _, down, events = replay(relay_binary, True, False, chunks)
    python_down, python_rejected = python_check(chunks)
    assert [e.fault.kind for e in python_rejected] == [ABSOLUTE_OUTLIER]
    assert down == python_down
    assert [e.split()[2] for e in events if e.startswith("rejected ")] == [ABSOLUTE_OUTLIER]
    [verdict] = sidecar_verdicts(events)
    assert verdict.fault.kind == ABSOLUTE_OUTLIER and verdict.tensor is not None
    assert verdict.tensor.max_abs == pytest.approx(python_rejected[0].tensor.max_abs, rel=1e-5)


_MEASURE_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
#include "rpc_watch.h"
int main(void) { /* lines "TYPE HEX" in, "FINITE RMS MAX_ABS" out */
    int type;
    static char hex[1 << 16];
    static unsigned char data[1 << 15];
    while (scanf("%d %65535s", &type, hex) == 2) {
        size_t n = 0;
        for (; hex[2 * n] && hex[2 * n] != '-'; n++) sscanf(hex + 2 * n, "%2hhx", &data[n]);
        struct rw_measured m;
        rw_measure(&m, data, n, type);
        printf("%d %.17g %.17g\n", m.finite, m.rms, m.max_abs);
    }
    return 0;
}
"""


def test_rw_measure_finds_the_largest_value_as_pythons_measure(tmp_path):
    native = Path(mesh_sidecar.net.data_plane.native.__file__).parent
    (tmp_path / "measure_main.c").write_text(_MEASURE_MAIN)
    binary = tmp_path / "measure"
    subprocess.run(["cc", "-O2", "-I", str(native), str(tmp_path / "measure_main.c"), str(native / "rpc_watch.c"),
                    "-lm", "-o", str(binary)], check=True, capture_output=True, timeout=120)
    rng = np.random.default_rng(9)
    samples = []
    for dtype, ggml_type in ((np.float32, GGML_TYPE_F32), (np.float16, GGML_TYPE_F16)):
        for values in (rng.normal(0, 1, 512), np.array([1.0, -300.0, 2.0]), rng.uniform(-6e4, 6e4, 8),
                       np.array([1.0, np.nan]), np.zeros(0)):
            samples.append((ggml_type, values.astype(dtype).tobytes()))
    lines = "".join(f"{t} {data.hex() or '-'}\n" for t, data in samples)
    out = subprocess.run([str(binary)], input=lines, capture_output=True, text=True, check=True).stdout.split("\n")
    for (ggml_type, data), line in zip(samples, out, strict=False):
        finite, rms, max_abs = line.split()
        python = measure("t", data, ggml_type)
        assert bool(int(finite)) == python.finite
        if python.finite:  # else neither figure means anything
            assert float(max_abs) == python.max_abs and float(rms) == pytest.approx(python.rms, rel=1e-12)


FORGED_ENDPOINT = b"10.0.0.9:1\nrejected 7 non_finite l_out-1 1 0 0 0 0\r \\\x1b[31m\xff"


def test_a_members_endpoint_is_reported_escaped_as_pythons_event_holds_it(relay_binary):
    """The REGISTER_PEER endpoint is a member's bytes: one printable word in the report, the same word as the
    QUIC path's EndpointRewritten, so no forged line reaches the sidecar and one grep finds both."""
    chunks = [("c", HELLO), ("s", HELLO_REPLY_B2B), ("c", register_peer(0, FORGED_ENDPOINT))]
    _, _, events = replay(relay_binary, False, True, chunks, endpoints=[(0, "127.0.0.1:40001")])
    python = RpcStreamFilter(lambda index: "127.0.0.1:40001")
    for side, data in chunks:
        (python.receive_from_client if side == "c" else python.receive_from_server)(data)
    python.data_to_server()
    python_events = [e for e in iter(python.next_event, None) if isinstance(e, EndpointRewritten)]
    assert python_events == [EndpointRewritten(0, printable_word(FORGED_ENDPOINT), "127.0.0.1:40001")]
    assert [e for e in events if e.startswith("event 1 rewritten ")] == [
        f"event 1 rewritten 0 {python_events[0].original} 127.0.0.1:40001"]
    assert not any(e.startswith("rejected ") for e in events)


@pytest.mark.parametrize("every", [1, 5, 1 << 20])
def test_register_peer_is_rewritten_as_pythons_filter_rewrites_it(relay_binary, every):
    client = HELLO + register_peer(0, b"10.0.0.9:50052") + register_peer(1, b"10.0.0.8:50052") + get_tensor("x", 8)
    chunks = splits("c", HELLO, every) + [("s", HELLO_REPLY_B2B)] + splits("c", client[len(HELLO):], every)
    up, _, events = replay(relay_binary, False, True, chunks, endpoints=[(0, "127.0.0.1:40001")])
    python = RpcStreamFilter(lambda index: "127.0.0.1:40001" if index == 0 else None)
    expected = b""
    for side, data in chunks:
        if side == "c":
            python.receive_from_client(data)
        else:
            python.receive_from_server(data)
        expected += python.data_to_server()
    assert up == expected and b"127.0.0.1:40001" in up and b"10.0.0.9" not in up and b"10.0.0.8" not in up
    assert any(" rewritten 0 " in e for e in events) and any(" unresolved 1" in e for e in events)


OTHER = bytes(range(32, 64))


def test_a_members_register_peer_resolves_through_its_own_endpoints_only(relay_binary):
    """Member OTHER's table (from its own rpc order) maps index 0; NODE's maps only index 1. NODE's
    REGISTER_PEER for 0 is cleared, never sent where OTHER's order says, in the relay as in Python."""
    chunks = [("c", HELLO), ("s", HELLO_REPLY_B2B),
              ("c", register_peer(0, b"10.0.0.9:50052") + register_peer(1, b"10.0.0.8:50052"))]
    lines = setup_lines() + [
        f"member {NODE.hex()}", f"member {OTHER.hex()}", f"endpoint {OTHER.hex()} 0 127.0.0.1:40009",
        f"endpoint {NODE.hex()} 1 127.0.0.1:40001", f"endpoint {OTHER.hex()} 1 127.0.0.1:40008",
        f"watch 0 1 {NODE.hex()}", *(f"{side} {data.hex()}" for side, data in chunks),
        # forgotten, then named again: its old table is gone with it
        f"forget {NODE.hex()}", f"member {NODE.hex()}", f"watch 0 1 {NODE.hex()}",
        *(f"{side} {data.hex()}" for side, data in chunks)]
    out = replay_lines(relay_binary, lines)
    ups = [bytes.fromhex(line[3:]) for line in out if line.startswith("up ") and len(line) > 3]
    tables = {NODE: {1: "127.0.0.1:40001"}, OTHER: {0: "127.0.0.1:40009", 1: "127.0.0.1:40008"}}
    python = RpcStreamFilter(lambda index: tables[NODE].get(index))  # as serve_streams binds it for NODE
    for side, data in chunks:
        (python.receive_from_client if side == "c" else python.receive_from_server)(data)
    expected = HELLO + register_peer(0, b"") + register_peer(1, b"127.0.0.1:40001")
    assert python.data_to_server() == expected
    assert b"".join(ups[:2]) == expected
    assert b"".join(ups[2:]) == HELLO + register_peer(0, b"") + register_peer(1, b"")
    assert [e for e in out if e.startswith("event 1 ") and " dialect " not in e] == [
        "event 1 unresolved 0", "event 1 rewritten 1 10.0.0.8:50052 127.0.0.1:40001",
        "event 1 unresolved 0", "event 1 unresolved 1"]


def test_endpoints_for_a_member_not_named_are_refused(relay_binary):
    lines = [f"endpoint {OTHER.hex()} 0 127.0.0.1:40009", f"member {OTHER.hex()}", f"endpoint {OTHER.hex()} 0 -",
             "endpoint 0 127.0.0.1:40009"]  # the old form, with no member: refused whole
    assert replay_lines(relay_binary, lines) == [f"error endpoint for no member {OTHER.hex()}",
                                                 "error malformed control line endpoint"]


def test_events_lost_to_a_full_queue_are_counted_in_one_line(relay_binary):
    """32 REGISTER_PEERs in one read: the watch keeps 16 events, then says how many it lost."""
    chunks = [("c", HELLO), ("s", HELLO_REPLY_B2B), ("c", register_peer(0, b"10.0.0.9:50052") * 32)]
    _, _, events = replay(relay_binary, False, True, chunks, endpoints=[(0, "127.0.0.1:40001")])
    rewritten = [e for e in events if e.startswith("event 1 rewritten ")]
    assert len(rewritten) == 16 and events[-1] == "event 1 dropped 16", events
    assert isinstance(parse_report(events[-1].encode()), Event)


def test_a_stream_that_is_not_rpc_passes_untouched(relay_binary):
    data = b"E" + bytes(range(256)) * 40
    up, down, _ = replay(relay_binary, True, True, splits("c", data, 100) + splits("s", data, 333))
    assert up == data and down == data


def test_an_oversized_frame_breaks_the_worker_side(relay_binary):
    huge = bytes([6]) + struct.pack("<Q", 1 << 40)
    _, _, events = replay(relay_binary, False, True, [("c", HELLO), ("s", HELLO_REPLY_7), ("c", huge)])
    assert any(" broken " in e for e in events)


def test_the_watch_survives_random_and_mutated_streams_under_sanitizers(tmp_path):
    """fuzz_rpc_watch.c's standalone driver, built with AddressSanitizer and UBSan: any crash,
    out-of-bounds access or release of more than was shown fails it."""
    native = Path(mesh_sidecar.net.data_plane.native.__file__).parent
    binary = tmp_path / "fuzz_rpc_watch"
    subprocess.run(["cc", "-O1", "-g", "-DMESH_FUZZ_STANDALONE", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", str(native / "fuzz_rpc_watch.c"), str(native / "rpc_watch.c"),
                    "-lm", "-o", str(binary)], check=True, capture_output=True, timeout=120)
    result = subprocess.run([str(binary), "100000", "11"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("ok 100000"), result.stderr[-3000:]
