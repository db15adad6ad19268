"""Corrupt layer outputs: the output rule (wire/rpc_outputs.py's OutputGuard), the refusal both sides name,
and its gossip."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mesh_sidecar.errors import MalformedMessageError
from mesh_sidecar.mesh.exclusion import CORRUPT_OUTPUT, exclusion_of
from mesh_sidecar.wire.gossip import MAX_JUDGED_MEMBERS, CorruptOutput, MemberInfo
from mesh_sidecar.wire.rpc_outputs import (
    ABSOLUTE_OUTLIER,
    GGML_TYPE_F32,
    MAX_OUTPUT_ABS,
    MAX_OUTPUT_RMS,
    MIN_HISTORY_SAMPLES,
    NON_FINITE,
    NORM_OUTLIER,
    NORM_RATIO,
    PROTOCOL_VIOLATION,
    UNSOLICITED_REPLY,
    OutputGuard,
    OutputRejected,
    RpcOutputCheck,
    TensorMeasured,
    protocol_fault,
    rejected_natively,
)
from tests.unit.test_gossip import info
from tests.unit.test_rpc_outputs import HELLO_REPLY, HELLO_REQUEST, get_tensor, reply

WORKER, OTHER, SERVING = b"\x0b" * 32, b"\x0a" * 32, b"\x0c" * 32


def tensor(rms: float, name: str = "l_out-11", finite: bool = True) -> TensorMeasured:
    return TensorMeasured(name, 576, finite, rms if finite else None)


def test_non_finite_is_a_fault_at_once() -> None:
    fault = OutputGuard().judge(WORKER, tensor(0, finite=False))
    assert fault is not None and fault.kind == NON_FINITE and "l_out-11" in fault.detail


def test_a_norm_far_outside_the_workers_own_range_is_a_fault_once_there_is_a_history() -> None:
    guard = OutputGuard()
    assert guard.judge(WORKER, tensor(1e6)) is None  # no history yet: nothing to compare with
    guard = OutputGuard()
    for rms in (0.8, 1.0, 1.2) * MIN_HISTORY_SAMPLES:
        assert guard.judge(WORKER, tensor(rms)) is None
    for outlier in (1.2 * NORM_RATIO * 1.01, 0.8 / NORM_RATIO / 1.01, 0.0, 1.2 * NORM_RATIO * 1.01):
        fault = guard.judge(WORKER, tensor(outlier))  # outliers do not widen the range
        assert fault is not None and fault.kind == NORM_OUTLIER
    assert guard.judge(WORKER, tensor(1.2 * NORM_RATIO * 0.99)) is None
    # Each worker and tensor has its own history.
    assert guard.judge(OTHER, tensor(1e6)) is None
    assert guard.judge(WORKER, tensor(1e6, "l_out-20")) is None


@pytest.mark.parametrize("rms, max_abs", [
    (1e30, 1e30),  # every value scaled far up from the first reply: no history would ever flag it
    (MAX_OUTPUT_RMS * 1.01, MAX_OUTPUT_RMS * 10),
    (5.0, MAX_OUTPUT_ABS * 1.01),  # one wild value among sane ones
])
def test_values_no_real_model_produces_are_a_fault_from_the_first_reply(rms: float, max_abs: float) -> None:
    guard = OutputGuard()
    fault = guard.judge(WORKER, TensorMeasured("l_out-11", 576, True, rms, max_abs))
    assert fault is not None and fault.kind == ABSOLUTE_OUTLIER and "l_out-11" in fault.detail
    # Not learnt either: the next sane output is judged on its own.
    assert guard.judge(WORKER, TensorMeasured("l_out-11", 576, True, 5.0, 40.0)) is None


def test_the_largest_outputs_of_real_models_pass() -> None:
    """A first token's warm-up (RMS 882 seen), a big model's massive activations (|value| ~1e4), F16's max."""
    guard = OutputGuard()
    for rms, max_abs in ((882.0, 2e4), (5e3, float(np.finfo(np.float16).max)), (1e5, 1e7)):
        assert guard.judge(WORKER, TensorMeasured("l_out-11", 4096, True, rms, max_abs)) is None


def test_a_workers_history_outlives_its_connections() -> None:
    """Each tunnel connection gets a check of its own, but judged by the one guard: a worker that drops its
    connection does not start afresh (only new_session, llama-server's restart, does)."""
    guard = OutputGuard()
    rng = np.random.default_rng(3)

    def connection(values: list[np.ndarray]) -> list[OutputRejected]:
        check = RpcOutputCheck(lambda tensor: guard.judge(WORKER, tensor))
        check.receive_from_client(HELLO_REQUEST)
        check.receive_from_server(HELLO_REPLY)
        for v in values:
            check.receive_from_client(get_tensor(GGML_TYPE_F32, "l_out-3", v.nbytes))
            check.receive_from_server(reply(v.tobytes()))
        return [e for e in iter(check.next_event, None) if isinstance(e, OutputRejected)]

    assert connection([rng.normal(0, 1, 64).astype(np.float32) for _ in range(MIN_HISTORY_SAMPLES)]) == []
    [rejected] = connection([rng.normal(0, 1e3, 64).astype(np.float32)])
    assert rejected.fault.kind == NORM_OUTLIER


def test_a_new_llama_server_session_starts_unjudged() -> None:
    """A restarted llama-server's warm-up (a first token: an RMS of 882 where 5-8 ran) is no fault."""
    guard = OutputGuard()
    for rms in (5.5, 8.4) * MIN_HISTORY_SAMPLES:
        assert guard.judge(WORKER, tensor(rms)) is None
    assert guard.judge(WORKER, tensor(882.0)) is not None
    guard.new_session()
    assert guard.judge(WORKER, tensor(882.0)) is None


def test_both_sides_name_corrupt_output_until_the_member_restarts() -> None:
    worker = info(WORKER, "b", run_id=7)
    serving = info(SERVING, "c", serving=True, corrupt_outputs=(CorruptOutput(WORKER, 7, NON_FINITE),))
    found = exclusion_of(worker, serving)
    assert found is not None and found.reason == CORRUPT_OUTPUT
    assert found.detail == "c found NaN or Inf values in the layer outputs b's rpc-server returned"
    assert "restart mesh-inference there" in found.message("b")
    assert exclusion_of(dataclasses.replace(worker, run_id=8), serving) is None  # restarted
    assert exclusion_of(info(OTHER, "a", run_id=7), serving) is None


def test_a_protocol_violation_is_named_as_such_with_its_own_remedy() -> None:
    worker = info(WORKER, "b", run_id=7)
    serving = info(SERVING, "c", serving=True, corrupt_outputs=(CorruptOutput(WORKER, 7, PROTOCOL_VIOLATION),))
    found = exclusion_of(worker, serving)
    assert found is not None and found.reason == CORRUPT_OUTPUT
    assert found.detail == "c found RPC protocol violations in the layer outputs b's rpc-server returned"
    assert "pinned llama.cpp build" in found.message("b") and "GPU" not in found.message("b")


def test_the_fields_are_optional_within_version_4() -> None:
    plain = info(WORKER)
    assert set(plain.to_body()) >= {"secret_epoch"} and "run_id" not in plain.to_body()
    assert MemberInfo.from_body(plain.to_body()) == plain
    serving = info(SERVING, serving=True, run_id=2**63 - 1,
                   corrupt_outputs=tuple(CorruptOutput(bytes([i]) * 32, i, NORM_OUTLIER)
                                         for i in range(MAX_JUDGED_MEMBERS)))
    assert MemberInfo.from_body(serving.to_body()) == serving
    body = serving.to_body()
    too_many = {**body, "corrupt_outputs": body["corrupt_outputs"] * 2}
    with pytest.raises(MalformedMessageError, match="corrupt_outputs"):
        MemberInfo.from_body(too_many)
    with pytest.raises(MalformedMessageError, match="fault"):
        MemberInfo.from_body({**body, "corrupt_outputs": [{**body["corrupt_outputs"][0], "fault": "Bad!"}]})
    with pytest.raises(MalformedMessageError, match="perhaps run_id"):
        MemberInfo.from_body({**body, "other": 1})


def test_a_fault_the_native_judge_reports_reads_as_the_rules_own() -> None:
    """judge.c judges by the same rule and reports figures; they become what OutputGuard would have said."""
    guard = OutputGuard()
    nan = TensorMeasured("l_out-11", 576, False, None)
    assert rejected_natively(NON_FINITE, "l_out-11", 576, 0.0, None, (0.0, 0.0, 0)) \
        == OutputRejected(nan, guard.judge(WORKER, nan))
    huge = TensorMeasured("l_out-11", 576, True, 1e30, 1e30)
    assert rejected_natively(ABSOLUTE_OUTLIER, "l_out-11", 576, 1e30, 1e30, (0.0, 0.0, 0)) \
        == OutputRejected(huge, guard.judge(WORKER, huge))
    for _ in range(MIN_HISTORY_SAMPLES):
        assert guard.judge(WORKER, tensor(1.0)) is None
    far = tensor(2 * NORM_RATIO)
    assert rejected_natively(NORM_OUTLIER, "l_out-11", 576, 2 * NORM_RATIO, None, (1.0, 1.0, MIN_HISTORY_SAMPLES)) \
        == OutputRejected(far, guard.judge(WORKER, far))
    assert rejected_natively(PROTOCOL_VIOLATION, UNSOLICITED_REPLY, 0, 0.0, None, (0.0, 0.0, 0)) \
        == OutputRejected(None, protocol_fault(UNSOLICITED_REPLY))
