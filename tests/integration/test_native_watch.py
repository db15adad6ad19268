"""The native relay's RPC watch against the Python filters it mirrors, on the same byte streams.

``mesh-data-relay --replay`` (net/native/README.md, "Testing") runs rpc_watch.c and the relay's judge
over client and server chunks; wire/rpc_outputs.py with serve/output_guard.py and
wire/rpc_framing.py get the same chunks. Every stream is also split at every byte boundary.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mesh_sidecar.net.native
from mesh_sidecar.net.data_relay_build import ensure_data_relay
from mesh_sidecar.serve.output_guard import OutputGuard
from mesh_sidecar.wire.data_relay import configuration_lines
from mesh_sidecar.wire.rpc_framing import RpcStreamFilter
from mesh_sidecar.wire.rpc_outputs import (
    HISTORY_SAMPLES,
    MIN_HISTORY_SAMPLES,
    NORM_RATIO,
    OutputRejected,
    RpcOutputCheck,
)

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


def replay(binary, check: bool, rewrite: bool, chunks: list[tuple[str, bytes]],
           endpoints=()) -> tuple[bytes, bytes, list[str]]:
    lines = configuration_lines(b"", b"", handshake_timeout_s=5, max_connections=8, max_handshakes=4,
                                history=HISTORY_SAMPLES, min_history=MIN_HISTORY_SAMPLES, norm_ratio=NORM_RATIO)
    lines = [line for line in lines if not line.startswith("identity")]
    lines += [f"member {NODE.hex()}", *(f"endpoint {i} {e}" for i, e in endpoints),
              f"watch {int(check)} {int(rewrite)} {NODE.hex()}"]
    lines += [f"{side} {data.hex()}" for side, data in chunks]
    out = subprocess.run([str(binary), "--replay"], input="\n".join(lines) + "\n", capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
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
    native = Path(mesh_sidecar.net.native.__file__).parent
    binary = tmp_path / "fuzz_rpc_watch"
    subprocess.run(["cc", "-O1", "-g", "-DMESH_FUZZ_STANDALONE", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", str(native / "fuzz_rpc_watch.c"), str(native / "rpc_watch.c"),
                    "-lm", "-o", str(binary)], check=True, capture_output=True, timeout=120)
    result = subprocess.run([str(binary), "100000", "11"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("ok 100000"), result.stderr[-3000:]
