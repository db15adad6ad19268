"""Device speeds: when they differ enough to plan by, the slowdown the traffic shows, and one sample weighed no
device below another."""

from __future__ import annotations

import dataclasses

import pytest

from mesh_sidecar.llama.estimate import ModelEstimate
from mesh_sidecar.serve.assignment import SAME_SPEED_RATIO, speeds_differ
from mesh_sidecar.serve.planner import NodeCapacity, plan_layers
from mesh_sidecar.serve.speeds import (
    MIN_REQUESTS,
    MIN_TOKENS_OBSERVED,
    AnnouncedSpeed,
    ObservedSpeeds,
    weighable_speeds,
)

WORKER, HOST = b"w" * 32, b"h" * 32
MODEL = ModelEstimate(10, (1000,) * 10, 0, 0, 0, 4096, 0)
PLAN = plan_layers([NodeCapacity(WORKER, "w", 10**6), NodeCapacity(HOST, "h", 10**6)], MODEL)
WORKER_BYTES = sum(n.weights_bytes for n in PLAN.nodes if n.node_id == WORKER)


def owed_for(per_byte_s: float, tokens: int) -> dict[bytes, float]:
    return {WORKER: per_byte_s * WORKER_BYTES * tokens}


def test_speeds_differ_only_beyond_the_same_speed_ratio_and_when_all_are_known():
    assert not speeds_differ([1000.0, 1300.0, 1500.0])
    assert speeds_differ([1000.0, 4000.0])
    assert not speeds_differ([1000.0, 0.0, 4000.0]) and not speeds_differ([])


def test_a_worker_that_becomes_slower_shows_its_slowdown_and_noise_does_not():
    speeds = ObservedSpeeds()
    assert speeds.slowdown(WORKER) == 1.0  # never seen
    for per_byte_s in (1e-6, 1.1e-6, 0.95e-6, 1.2e-6):  # noise
        speeds.observe(PLAN, HOST, 32, owed_for(per_byte_s, 32))
    assert speeds.slowdown(WORKER) == 1.0
    for per_byte_s in (0.6e-6, 1.3e-6, 0.7e-6, 1.2e-6, 1.0e-6):  # one fast outlier sets no baseline
        speeds.observe(PLAN, HOST, 32, owed_for(per_byte_s, 32))
        assert speeds.slowdown(WORKER) == 1.0
    for _ in range(4):  # four times slower from now on
        speeds.observe(PLAN, HOST, 32, owed_for(4e-6, 32))
    assert 3.0 < speeds.slowdown(WORKER) <= 4.5
    assert speeds.to_json() == {WORKER.hex(): round(speeds.slowdown(WORKER), 2)}
    # It recovers: back to as measured.
    for _ in range(6):
        speeds.observe(PLAN, HOST, 32, owed_for(1e-6, 32))
    assert speeds.slowdown(WORKER) == 1.0


def test_short_requests_and_workers_outside_the_plan_teach_nothing():
    speeds = ObservedSpeeds()
    speeds.observe(PLAN, HOST, MIN_TOKENS_OBSERVED - 1, owed_for(1e-6, 4))
    speeds.observe(PLAN, HOST, 32, {b"x" * 32: 1.0})
    assert speeds.to_json() == {}


def test_one_slow_request_moves_nothing_and_each_model_has_its_own_figures():
    speeds = ObservedSpeeds()
    for per_byte_s in (1e-6, 1e-6, 5e-6, 1e-6, 1e-6):  # another program started there, once
        speeds.observe(PLAN, HOST, 32, owed_for(per_byte_s, 32))
    assert speeds.slowdown(WORKER) == 1.0
    # Another model (another weight type): its own baseline, nothing until MIN_REQUESTS of it.
    other = dataclasses.replace(PLAN, model="other.gguf")
    speeds.observe(other, HOST, 32, owed_for(9e-6, 32))
    assert speeds.slowdown(WORKER) == 1.0
    for _ in range(4):
        speeds.observe(other, HOST, 32, owed_for(9e-6, 32))
    assert speeds.slowdown(WORKER) == 1.0 and speeds.to_json() == {WORKER.hex(): 1.0}


GIB = 2**30


def test_a_plan_never_weighs_a_device_below_another_on_one_sample():
    """The issue's members: identical, one measured at 2.7 GiB/s while another node hashed on its cores."""
    busy, idle, host = "busy", "idle", "host"
    one_sample = {busy: AnnouncedSpeed(2.7 * GIB, settled=False), idle: AnnouncedSpeed(14.7 * GIB, settled=False),
                  host: AnnouncedSpeed(14.0 * GIB, settled=True)}
    weighed = weighable_speeds(one_sample)
    # The slow sample is unknown (a plan by memory, alike); the fast one is no risk: noise only slows.
    assert weighed == {busy: 0.0, idle: 14.7 * GIB, host: 14.0 * GIB}
    assert not speeds_differ(list(weighed.values()))
    # Settled (a second calibration agreed), a slow device is weighed slow: a quota that stays is its pace.
    settled = {**one_sample, busy: AnnouncedSpeed(2.7 * GIB, settled=True)}
    assert weighable_speeds(settled)[busy] == 2.7 * GIB
    # Alike within SAME_SPEED_RATIO, one sample is weighed as it is.
    near = 14.7 * GIB / SAME_SPEED_RATIO * 1.01
    assert weighable_speeds({**one_sample, busy: AnnouncedSpeed(near, settled=False)})[busy] == near


def test_the_traffic_confirms_a_speed_and_raises_one_measured_too_slow():
    busy = AnnouncedSpeed(2.7 * GIB, settled=False, observed_bytes_per_s=12.0 * GIB)  # its requests ran faster
    slow = AnnouncedSpeed(2.7 * GIB, settled=False, observed_bytes_per_s=2.5 * GIB)  # its link dilutes it
    fast = AnnouncedSpeed(14.7 * GIB, settled=True)
    assert weighable_speeds({"busy": busy, "fast": fast}) == {"busy": 12.0 * GIB, "fast": 14.7 * GIB}
    assert weighable_speeds({"slow": slow, "fast": fast}) == {"slow": 2.7 * GIB, "fast": 14.7 * GIB}


def test_a_workers_observed_speed_is_its_best_median_once_seen_enough():
    speeds = ObservedSpeeds()
    for count, per_byte_s in enumerate((2e-9, 1e-9, 1e-9, 1e-9, 3e-9), start=1):
        speeds.observe(PLAN, HOST, 32, owed_for(per_byte_s, 32))
        observed = speeds.observed_bytes_per_s(WORKER)
        assert (observed is None) == (count < MIN_REQUESTS)
    assert speeds.observed_bytes_per_s(WORKER) == pytest.approx(1e9)
    assert speeds.observed_bytes_per_s(HOST) is None
