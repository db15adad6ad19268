"""The calibration's decisions, without a server: how many passes a sample takes, when to stop, the rate."""

from __future__ import annotations

import pytest

from mesh_sidecar.llama.calibration import (
    MAX_MEASURE_S,
    MIN_MEASURE_S,
    MIN_SAMPLES,
    SAMPLE_TARGET_S,
    passes_for,
    rate,
    settled,
)
from mesh_sidecar.wire.gossip import MAX_BYTES_PER_S
from mesh_sidecar.wire.rpc_calibration import MAX_PASSES


def test_passes_fill_a_sample_within_bounds() -> None:
    assert passes_for(SAMPLE_TARGET_S / 10) == 10
    assert passes_for(SAMPLE_TARGET_S / 10 * 1.01) == 10  # rounded up to the next whole pass
    assert passes_for(SAMPLE_TARGET_S * 5) == 1  # a slow device: one pass a sample
    assert passes_for(1e-6) == MAX_PASSES  # a GPU behind a fast loopback: as many as one graph holds
    assert passes_for(0.0) == MAX_PASSES


def test_steady_samples_settle_once_enough_time_is_spent() -> None:
    steady = [0.02] * (round(MIN_MEASURE_S / 0.02) + 1)
    assert not settled([])
    assert not settled(steady[:-2])  # under MIN_MEASURE_S
    assert settled(steady)
    assert MIN_SAMPLES * MIN_MEASURE_S / 2 < MAX_MEASURE_S
    assert not settled([MIN_MEASURE_S / 2] * (MIN_SAMPLES - 1))  # enough time, too few samples
    assert settled([MIN_MEASURE_S / 2] * MIN_SAMPLES)


def test_unsteady_samples_run_to_the_budget() -> None:
    # A CPU under a CFS quota: fast bursts, then a throttled sample; the median is far from the mean.
    throttled = [0.005, 0.005, 0.08] * 4
    assert sum(throttled) >= MIN_MEASURE_S and not settled(throttled)
    assert settled(throttled * 3)  # past MAX_MEASURE_S: the samples so far decide
    assert settled([MAX_MEASURE_S * 2])  # one sample longer than the budget is all a very slow device gives


def test_the_rate_is_the_mean_over_every_sample() -> None:
    assert rate(1000, [0.5, 1.5]) == 1000  # 2,000 bytes in 2 s, not the best sample's 2,000 B/s
    assert rate(10**18, [1e-3]) == MAX_BYTES_PER_S  # what gossip carries at most


@pytest.mark.parametrize("samples", [[0.01] * 30, [0.3, 0.31, 0.29]])
def test_a_settled_measurement_spends_at_most_the_budget_plus_one_sample(samples: list[float]) -> None:
    taken: list[float] = []
    for sample in samples:
        if settled(taken):
            break
        taken.append(sample)
    assert sum(taken) <= MAX_MEASURE_S + max(samples)
