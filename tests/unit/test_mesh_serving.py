"""The serving node's side of the mesh (mesh/serving.py): installed once, a check per worker, members left out."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mesh_sidecar.mesh.exclusion import SLOW_EXCLUSION_S
from mesh_sidecar.mesh.peers import PeerTable
from mesh_sidecar.mesh.serving import ServingVerdicts
from mesh_sidecar.wire.gossip import CorruptOutput, MemberInfo
from mesh_sidecar.wire.rpc_outputs import MIN_HISTORY_SAMPLES, NON_FINITE, NORM_OUTLIER, NORM_RATIO, OutputRejected
from tests.unit.test_gossip import info
from tests.unit.test_rpc_outputs import exchange

WORKER, STRANGER, SERVING = b"\x0b" * 32, b"\x0d" * 32, b"\x0c" * 32


class Side:
    """A ServingVerdicts over one member, with what it said and how often it changed."""

    def __init__(self) -> None:
        self.members: dict[bytes, MemberInfo] = {WORKER: info(WORKER, "b", run_id=7)}
        self.said: list[str] = []
        self.changes = 0
        self.verdicts = ServingVerdicts(PeerTable(SERVING, lambda coroutine: coroutine.close()), self.members.get,
                                        lambda node_id: self.members[node_id].name, self.said.append, self._changed)

    def _changed(self) -> None:
        self.changes += 1


def rejections_of(side: Side, node_id: bytes, values: np.ndarray) -> list[OutputRejected]:
    """Run one session's replies through the check a tunnel to ``node_id`` gets, as the tunnel does."""
    check = side.verdicts.check_for(node_id)
    assert check is not None
    rejected = []
    for who, data in exchange(values):
        if who == "client":
            check.receive_from_client(data)
        else:
            check.receive_from_server(data)
        while (event := check.next_event()) is not None:
            if isinstance(event, OutputRejected):
                side.verdicts.rejected(node_id, event)
                rejected.append(event)
    return rejected


def test_tunnels_relay_unchecked_until_serving_is_installed_then_each_check_names_its_worker() -> None:
    side = Side()
    assert side.verdicts.check_for(WORKER) is None
    reported: list[tuple[bytes, OutputRejected]] = []
    side.verdicts.install(True, lambda node_id, event: reported.append((node_id, event)))
    for _ in range(MIN_HISTORY_SAMPLES):
        assert rejections_of(side, WORKER, np.ones(16, dtype=np.float32)) == []
    far = np.full(16, 2 * NORM_RATIO, dtype=np.float32)
    assert rejections_of(side, STRANGER, far) == []  # judged by its own history, not WORKER's
    (rejected,) = rejections_of(side, WORKER, far)
    assert rejected.fault.kind == NORM_OUTLIER and reported == [(WORKER, rejected)]
    (rejected,) = rejections_of(side, STRANGER, np.full(16, np.nan, dtype=np.float32))
    assert rejected.fault.kind == NON_FINITE and reported[1:] == [(STRANGER, rejected)]
    with pytest.raises(RuntimeError, match="installed once"):
        side.verdicts.install(True, lambda node_id, event: None)


def test_installed_without_the_check_nothing_is_checked() -> None:
    side = Side()
    side.verdicts.install(False, lambda node_id, event: None)
    assert side.verdicts.check_for(WORKER) is None


def test_a_new_session_judges_every_worker_afresh() -> None:
    """The rule's histories are the serving side's, cleared as llama-server starts again (Mesh.new_serving_session)."""
    side = Side()
    side.verdicts.install(True, lambda node_id, event: None)
    for _ in range(MIN_HISTORY_SAMPLES):
        assert rejections_of(side, WORKER, np.ones(16, dtype=np.float32)) == []
    side.verdicts.new_session()
    assert rejections_of(side, WORKER, np.full(16, 2 * NORM_RATIO, dtype=np.float32)) == []


def test_a_member_left_out_is_announced_until_it_restarts() -> None:
    side = Side()
    side.verdicts.exclude_corrupt(STRANGER, NON_FINITE)  # not a member: nothing to announce
    assert side.changes == 0 and side.verdicts.corrupt == ()
    side.verdicts.exclude_corrupt(WORKER, NON_FINITE)
    assert side.changes == 1 and side.verdicts.corrupt == (CorruptOutput(WORKER, 7, NON_FINITE),)
    side.verdicts.member_seen(side.members[WORKER])  # the same run: still left out
    assert side.changes == 1
    side.verdicts.member_seen(info(WORKER, "b", run_id=8))
    assert side.changes == 2 and side.verdicts.corrupt == ()
    assert side.said == ["b restarted: it may be given layers again (it was left out as corrupt_output)"]


def test_a_slow_member_is_given_layers_again_after_its_time() -> None:
    side = Side()
    side.verdicts.exclude_slow(WORKER, owed_s=3.0, window_s=3.1, token_s=0.05)
    (slow,) = side.verdicts.slow
    assert (slow.node_id, slow.run_id, slow.owed_ms, slow.window_ms, slow.token_ms) == (WORKER, 7, 3000, 3100, 50)
    side.verdicts.expire(time.monotonic())
    assert side.verdicts.slow == (slow,)
    side.verdicts.expire(time.monotonic() + SLOW_EXCLUSION_S)
    assert side.verdicts.slow == () and side.changes == 2
    assert side.said == ["b may be given layers again: it was left out as slow 10 minutes ago"]
