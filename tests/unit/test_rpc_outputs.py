"""The layer-output check: replies paired with their commands, float tensors measured and judged, split anywhere."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mesh_sidecar.wire.rpc_outputs import (
    BAD_HELLO_REPLY,
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    NON_FINITE,
    PROTOCOL_VIOLATION,
    UNKNOWN_DIALECT,
    UNSOLICITED_REPLY,
    WRONG_REPLY_SIZE,
    CheckOff,
    Fault,
    OutputRejected,
    RpcOutputCheck,
    TensorMeasured,
    measure,
)

GET_ALIGNMENT, SET_TENSOR, GET_TENSOR, GRAPH_COMPUTE, HELLO = 1, 6, 8, 10, 14
GGML_TYPE_Q8_0 = 8


def frame(cmd: int, payload: bytes) -> bytes:
    return bytes([cmd]) + len(payload).to_bytes(8, "little") + payload


def reply(payload: bytes) -> bytes:
    return len(payload).to_bytes(8, "little") + payload


def rpc_tensor(ggml_type: int, name: str) -> bytes:
    tensor = bytearray(296)
    struct.pack_into("<I", tensor, 8, ggml_type)
    tensor[228 : 228 + len(name)] = name.encode()
    return bytes(tensor)


def get_tensor(ggml_type: int, name: str, size: int) -> bytes:
    return frame(GET_TENSOR, rpc_tensor(ggml_type, name) + struct.pack("<QQ", 0, size))


HELLO_REQUEST = frame(HELLO, bytes(24))
HELLO_REPLY = reply(bytes([7, 0, 0, 0]) + bytes(24))
GOOD = np.linspace(-2, 2, 64, dtype=np.float32)


def exchange(values: np.ndarray, ggml_type: int = GGML_TYPE_F32, name: str = "l_out-3") -> list[tuple[str, bytes]]:
    """A session as llama-server drives it: HELLO, a command with and one without a reply, a compute, a GET."""
    data = values.tobytes()
    return [
        ("client", HELLO_REQUEST), ("server", HELLO_REPLY),
        ("client", frame(GET_ALIGNMENT, struct.pack("<I", 0))), ("server", reply(struct.pack("<Q", 32))),
        ("client", frame(SET_TENSOR, rpc_tensor(GGML_TYPE_F32, "inp") + bytes(9) + bytes(40))),
        ("client", frame(GRAPH_COMPUTE, bytes(12))),
        ("client", get_tensor(ggml_type, name, len(data))), ("server", reply(data)),
    ]


class Judge:
    """Records what it was shown; names a fault for a tensor that is not finite."""

    def __init__(self) -> None:
        self.seen: list[TensorMeasured] = []

    def __call__(self, tensor: TensorMeasured) -> Fault | None:
        self.seen.append(tensor)
        return None if tensor.finite else Fault(NON_FINITE, "NaN or Inf")


def run(session: list[tuple[str, bytes]], split: int | None = None) -> tuple[bytes, list, Judge]:
    """Feed a session (each message cut at ``split`` when given); what the client got, the events, the judge."""
    judge = Judge()
    check = RpcOutputCheck(judge)
    to_client = b""
    for side, data in session:
        parts = [data] if split is None or split >= len(data) else [data[:split], data[split:]]
        for part in parts:
            if side == "client":
                check.receive_from_client(part)
            else:
                check.receive_from_server(part)
                to_client += check.data_to_client()
    events = []
    while (event := check.next_event()) is not None:
        events.append(event)
    return to_client, events, judge


def server_bytes(session: list[tuple[str, bytes]]) -> bytes:
    return b"".join(data for side, data in session if side == "server")


def test_healthy_outputs_pass_byte_for_byte_and_are_measured() -> None:
    session = exchange(GOOD)
    to_client, events, judge = run(session)
    assert to_client == server_bytes(session)
    assert events == []
    [tensor] = judge.seen
    assert tensor.name == "l_out-3" and tensor.values == 64 and tensor.finite
    assert tensor.rms == pytest.approx(float(np.sqrt(np.mean(GOOD.astype(np.float64) ** 2))))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_output_is_kept_back(bad: float) -> None:
    values = GOOD.copy()
    values[17] = bad
    session = exchange(values)
    to_client, events, judge = run(session)
    # Everything before the rejected reply went on; none of it did.
    assert to_client == server_bytes(session)[: -(8 + values.nbytes)]
    [event] = events
    assert isinstance(event, OutputRejected) and event.fault.kind == NON_FINITE and not event.tensor.finite


def test_nothing_passes_after_a_rejection() -> None:
    values = GOOD.copy()
    values[0] = math.nan
    session = exchange(values) + [("client", frame(GET_ALIGNMENT, bytes(4))), ("server", reply(bytes(8)))]
    to_client, _, _ = run(session)
    assert to_client == server_bytes(session)[: -(8 + values.nbytes) - 16]


def test_f16_outputs_are_checked_too() -> None:
    values = GOOD.astype(np.float16)
    values[3] = np.float16(np.inf)
    _, events, judge = run(exchange(values, GGML_TYPE_F16))
    assert judge.seen[0].values == 64
    assert isinstance(events[0], OutputRejected)


def test_quantized_tensors_are_not_judged() -> None:
    raw = np.frombuffer(np.full(16, np.nan, dtype=np.float32).tobytes(), dtype=np.uint8)  # NaN bits, not floats
    session = exchange(raw, GGML_TYPE_Q8_0)
    to_client, events, judge = run(session)
    assert to_client == server_bytes(session) and events == [] and judge.seen == []


@pytest.mark.parametrize("split", range(1, 330))
def test_every_split_gives_the_same_verdicts(split: int) -> None:
    good = exchange(GOOD)
    values = GOOD.copy()
    values[-1] = math.nan
    bad = good + exchange(values)[2:]
    for session in (good, bad):
        assert run(session, split)[0] == run(session)[0]
        assert run(session, split)[1] == run(session)[1]
        assert run(session, split)[2].seen == run(session)[2].seen


def test_once_off_a_chunk_passes_as_the_same_object() -> None:
    check = RpcOutputCheck(Judge())
    check.receive_from_client(frame(HELLO, b""))
    check.receive_from_server(reply(bytes([3, 0, 0])))  # the b2b fork: not checked
    check.data_to_client()
    chunk = reply(bytes(100))
    check.receive_from_server(chunk)
    assert check.data_to_client() is chunk


NAN = np.full(64, np.nan, "<f4")
NAN_TAIL = [("client", get_tensor(GGML_TYPE_F32, "l_out-1", NAN.nbytes)), ("server", reply(NAN.tobytes()))]


@pytest.mark.parametrize("session, reason", [
    ([("client", frame(HELLO, b"")), ("server", reply(bytes([3, 0, 0])))], "not checked"),  # the b2b fork
    ([("client", frame(HELLO, bytes(5)))], "no known dialect's size"),
    ([("client", frame(GET_ALIGNMENT, bytes(4)))], "before the HELLO reply"),
    ([("client", HELLO_REQUEST), ("server", HELLO_REPLY), ("client", frame(40, b""))], "unknown command 40"),
])
def test_the_client_may_lead_the_check_where_it_cannot_follow(session, reason: str) -> None:
    """llama-server is ours: what it alone does switches the check off, and every byte then passes."""
    to_client, events, judge = run(session + NAN_TAIL)
    assert to_client == server_bytes(session + NAN_TAIL)
    assert isinstance(events[0], CheckOff) and reason in events[0].reason
    assert judge.seen == []


# What a worker's rpc-server may send to get its later outputs through unchecked, were it obeyed; the last
# server message breaks the protocol.
WORKER_VIOLATIONS = {
    "early-reply": ([("client", HELLO_REQUEST), ("server", HELLO_REPLY), ("server", reply(b"x"))], UNSOLICITED_REPLY),
    "reply-first": ([("server", reply(b"x"))], UNSOLICITED_REPLY),
    "huge-hello-reply": ([("client", HELLO_REQUEST), ("server", reply(bytes(100)))], BAD_HELLO_REPLY),
    "foreign-hello-reply": ([("client", HELLO_REQUEST), ("server", reply(bytes([9, 0, 0, 0]) + bytes(24)))],
                            UNKNOWN_DIALECT),
    "short-hello-reply": ([("client", HELLO_REQUEST), ("server", reply(b""))], UNKNOWN_DIALECT),
    "short-tensor": ([("client", HELLO_REQUEST), ("server", HELLO_REPLY),
                      ("client", get_tensor(GGML_TYPE_F32, "l_out-1", 64)), ("server", reply(bytes(8)))],
                     WRONG_REPLY_SIZE),
}


@pytest.mark.parametrize("name", WORKER_VIOLATIONS)
def test_a_worker_cannot_switch_the_check_off(name: str) -> None:
    """A protocol violation by the server is a fault, blamed like a NaN: its reply and all after it stay back."""
    session, reason = WORKER_VIOLATIONS[name]
    to_client, events, judge = run(session + NAN_TAIL)
    assert to_client == server_bytes(session[:-1])
    [event] = events
    assert isinstance(event, OutputRejected) and event.tensor is None
    assert event.fault.kind == PROTOCOL_VIOLATION and reason in event.fault.detail
    assert judge.seen == []


def test_an_early_reply_sent_with_the_hello_reply_is_kept_back_with_it() -> None:
    """The finding: the early reply came in the HELLO reply's segment; nothing of that input goes on."""
    session = [("client", HELLO_REQUEST), ("server", HELLO_REPLY + reply(b"x"))] + NAN_TAIL
    to_client, [event], _ = run(session)
    assert to_client == b"" and isinstance(event, OutputRejected) and UNSOLICITED_REPLY in event.fault.detail


@pytest.mark.parametrize("name", WORKER_VIOLATIONS)
def test_every_split_gives_the_same_violation(name: str) -> None:
    violation, reason = WORKER_VIOLATIONS[name]
    session = violation + NAN_TAIL
    whole = run(session)
    before = server_bytes(violation[:-1])
    for split in range(1, max(len(data) for _, data in session)):
        to_client, events, judge = run(session, split)
        assert events == whole[1] and judge.seen == []
        if reason == UNKNOWN_DIALECT:  # the HELLO reply passes as it comes; its fault shows at its end
            assert to_client.startswith(before) and server_bytes(violation).startswith(to_client)
        else:  # found at the reply's size field, which is held until whole
            assert to_client == before


def test_a_b2b_servers_pushes_are_followed_and_its_outputs_checked() -> None:
    # Our b2b build: REGISTER_PEER (18) and the first PUSH (19) answer a byte; the asynchronous
    # pushes (20 to the source, 22 to the destination) answer nothing.
    values = GOOD.copy()
    values[5] = math.nan
    session = [("client", HELLO_REQUEST), ("server", reply(bytes([7, 0, 2, 0x03]) + bytes(24))),
               ("client", frame(18, bytes(132))), ("server", reply(b"\x01")),
               ("client", frame(19, bytes(620))), ("server", reply(b"\x01")),
               ("client", frame(20, bytes(628))), ("client", frame(22, bytes(8))),
               ("client", get_tensor(GGML_TYPE_F32, "l_out-1", values.nbytes)), ("server", reply(values.tobytes()))]
    to_client, events, judge = run(session)
    assert [e.name for e in judge.seen] == ["l_out-1"] and not judge.seen[0].finite
    assert not any(isinstance(e, CheckOff) for e in events)
    # What the server owes, message by message (the tunnel times only those waits).
    check = RpcOutputCheck(Judge())
    owed = []
    for side, data in session:
        if side == "client":
            check.receive_from_client(data)
        else:
            check.receive_from_server(data)
            check.data_to_client()
        owed.append(check.replies_owed)
    # (the last reply is rejected: the check stops there, and the tunnel closes the connection)
    assert owed == [True, False, True, False, True, False, False, False, True, True]


def test_measure_rms_and_limits() -> None:
    assert measure("t", b"", GGML_TYPE_F32) == TensorMeasured("t", 0, True, 0.0, 0.0)
    big = np.full(1000, np.finfo(np.float32).max, dtype=np.float32)
    assert measure("t", big.tobytes(), GGML_TYPE_F32).finite  # squares past float32's range are not Inf
    assert measure("t", np.zeros(8, np.float32).tobytes(), GGML_TYPE_F32).rms == 0.0
    assert measure("t", np.full(8, np.nan, np.float32).tobytes(), GGML_TYPE_F32).max_abs is None


@pytest.mark.parametrize(("dtype", "ggml_type", "scale"), [
    (np.float16, GGML_TYPE_F16, 1.0), (np.float16, GGML_TYPE_F16, float(np.finfo(np.float16).max)),
    (np.float32, GGML_TYPE_F32, 1.0), (np.float32, GGML_TYPE_F32, 1e38),  # squares past float32's range
])
def test_measure_matches_an_exact_sum_of_squares(dtype: type[np.floating], ggml_type: int, scale: float) -> None:
    values = (np.random.default_rng(7).uniform(-1, 1, 4096) * scale).astype(dtype)
    values[0] = -scale  # the largest |value| itself, negative: max_abs must not take the plain max
    # Squares of f16 and f32 values are exact in float64, and fsum rounds their sum once.
    square_sum = math.fsum(float(v) ** 2 for v in values)
    got = measure("t", values.tobytes(), ggml_type)
    assert got.values == values.size and got.finite
    assert got.rms == pytest.approx(math.sqrt(square_sum / values.size), rel=1e-12)
    assert got.max_abs == float(dtype(scale))


# Other threads' CPU time in a fresh process, around replies measured. OpenBLAS starts its pool when
# numpy is imported, so counting threads shows nothing; a BLAS call wakes the pool, which then spins.
_OTHER_THREADS_CPU = """
import os, numpy as np
from mesh_sidecar.wire.rpc_outputs import GGML_TYPE_F32, measure
def others():
    ticks = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            ticks += int(stat[11]) + int(stat[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")
data = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32).tobytes()  # 4 MiB
before = others()
for _ in range(100):
    measure("t", data, GGML_TYPE_F32)
print(others() - before)
"""
OTHER_THREADS_MAX_CPU_S = 0.05  # np.dot took 0.2 to 0.4 s here on 2 cores; idle threads take 0


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads threads' CPU time from /proc")
def test_measure_keeps_to_its_own_thread() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _OTHER_THREADS_CPU], env=env, capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[2]).stdout
    assert float(out) < OTHER_THREADS_MAX_CPU_S
