"""A failover's phases: each from the end of the one before, for /metrics and the log."""

from __future__ import annotations

import pytest

from mesh_sidecar.serve.failover_timeline import FailoverTimeline


def test_each_phase_runs_from_the_end_of_the_one_before():
    timeline = FailoverTimeline(100.0, detect_s=0.12)
    assert timeline.lap("stop", 100.3) == pytest.approx(0.3)
    assert timeline.lap("plan", 100.31) == pytest.approx(0.01)
    assert timeline.lap("load", 101.81) == pytest.approx(1.5)
    assert timeline.phases_s == pytest.approx({"detect": 0.12, "stop": 0.3, "plan": 0.01, "load": 1.5})
    assert timeline.describe() == "detect 0.12 s, stop 0.30 s, plan 0.01 s, load 1.50 s (1.93 s in all)"


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown failover phase"):
        FailoverTimeline(0.0).lap("coffee", 1.0)
