"""The scorecard reads each goal's figure from the benchmarks' own JSON and judges it by its bound."""

import argparse

from benchmarks.scorecard import GOALS, _runs, evaluate, greedy_texts_identical


def _relay(gbit_s: dict[str, float]) -> dict:
    labels = {"aioquic": "aioquic 1.7.2", "qh3": "qh3 1.9.4"}
    return {"libraries": {labels[lib]: lib for lib in gbit_s},
            "paths": {"tcp": {"bulk_gbit_s": {"median": 15.0}},
                      **{f"tunnel {labels[lib]}": {"bulk_gbit_s": {"median": v}} for lib, v in gbit_s.items()}}}


def _load_setup(load_s: float, tunnel_bytes: dict[str, int]) -> dict:
    return {"load_s": load_s, "tunnel_bytes_to_peer": tunnel_bytes}


REPORTS = {
    "decode": {"profiles": [
        {"profile": "unshaped", "decode_ratio_mesh_over_direct": 0.80, "ttft_ratio_mesh_over_direct": 1.3,
         "aggregate_ratio_mesh_over_direct": 0.96, "b2b_over_stock": 1.05, "greedy_texts_identical": True,
         "stream_texts_identical": [True, False, True, True]},
    ]},
    "decode-20ms": {"profiles": [
        {"profile": "20ms", "decode_ratio_mesh_over_direct": 0.97, "b2b_over_stock": 0.99,
         "greedy_texts_identical": True},
    ]},
    "decode-1gb": {"profiles": [
        {"profile": "unshaped", "decode_ratio_mesh_over_direct": 0.96, "ttft_ratio_mesh_over_direct": 1.25,
         "greedy_texts_identical": True},
        {"profile": "5ms", "decode_ratio_mesh_over_direct": 0.93, "ttft_ratio_mesh_over_direct": 1.08,
         "greedy_texts_identical": True},
    ]},
    "relay-1500": _relay({"aioquic": 0.55, "qh3": 1.2}),
    "relay-9000": _relay({"aioquic": 2.1}),
    "load": {"mesh stock": _load_setup(20.0, {"a": 400_000_000, "b": 400_000_000}),
             "mesh seeded": _load_setup(3.0, {"a": 200_000, "b": 200_000})},
}


def _by_goal(reports: dict) -> dict[str, tuple]:
    return {row["goal"]: (row["figure"], row["met"]) for row in evaluate(reports)}


def test_each_goal_is_judged_by_its_own_figure_and_bound():
    rows = _by_goal(REPORTS)
    assert rows == {
        "decode tok/s mesh/direct, 135M (worst case), unshaped veth": (0.80, False),
        "decode tok/s mesh/direct, 135M (worst case), +20 ms one way": (0.97, True),
        "aggregate decode tok/s mesh/direct, 4 streams, 135M, unshaped veth": (0.96, True),
        "decode tok/s b2b/stock mesh, 135M, unshaped veth": (1.05, True),
        "decode tok/s b2b/stock mesh, 135M, +20 ms one way": (0.99, False),
        "decode tok/s mesh/direct, 1 GB, unshaped veth": (0.96, True),
        "decode tok/s mesh/direct, 1 GB, +5 ms one way": (0.93, False),
        # At most 1.10: the lower the better.
        "TTFT mesh/direct, 1 GB, unshaped veth": (1.25, False),
        "TTFT mesh/direct, 1 GB, +5 ms one way": (1.08, True),
        # The product's library, not the fastest one in the report.
        "relay bulk Gbit/s (aioquic), MTU 1500": (0.55, False),
        "relay bulk Gbit/s (aioquic), MTU 9000": (2.1, True),
        "load: weight bytes over tunnels, seeded/stock": (0.0005, True),
        "load: load time, seeded/stock": (0.15, True),
    }
    # Concurrent streams' texts are not part of it: batched decoding is not batch-invariant.
    assert greedy_texts_identical(REPORTS) is True


def test_a_benchmark_that_did_not_run_leaves_its_goals_without_a_figure():
    partial = {
        "decode": {"profiles": [{"profile": "unshaped", "error": "TimeoutError()"}]},
        "decode-20ms": {"profiles": [
            {"profile": "20ms", "decode_ratio_mesh_over_direct": 0.90, "greedy_texts_identical": False},
        ]},
    }
    rows = _by_goal(partial)
    assert rows["decode tok/s mesh/direct, 135M (worst case), unshaped veth"] == (None, None)
    assert rows["aggregate decode tok/s mesh/direct, 4 streams, 135M, unshaped veth"] == (None, None)
    assert rows["decode tok/s mesh/direct, 135M (worst case), +20 ms one way"] == (0.90, False)
    # A run without --b2b has no b2b figure.
    assert rows["decode tok/s b2b/stock mesh, 135M, +20 ms one way"] == (None, None)
    assert all(value == (None, None) for goal, value in rows.items() if "135M" not in goal)
    assert greedy_texts_identical(partial) is False
    assert greedy_texts_identical({}) is None


def test_no_reports_at_all_give_every_goal_no_figure():
    assert [(row["figure"], row["met"]) for row in evaluate({})] == [(None, None)] * len(GOALS)


def test_every_decode_goal_reads_a_figure_its_run_measures():
    """Reports shaped by each decode run's own arguments (its profiles; b2b and aggregate figures only
    with --b2b and --streams) give every decode goal a figure: goals and runs agree."""
    args = argparse.Namespace(decode_reps=1, n_predict=16, decode_1gb_reps=1, n_predict_1gb=8, relay_mb=1,
                              load_model="bench-1gb", load_reps=1)
    reports = {}
    for name, argv in _runs(args).items():
        if argv[0] != "benchmarks.decode":
            continue
        entry = {"decode_ratio_mesh_over_direct": 1.0, "ttft_ratio_mesh_over_direct": 1.0,
                 **({"b2b_over_stock": 1.0} if "--b2b" in argv else {}),
                 **({"aggregate_ratio_mesh_over_direct": 1.0} if "--streams" in argv else {})}
        profiles = argv[argv.index("--profiles") + 1].split(",")
        reports[name] = {"profiles": [{"profile": profile, **entry} for profile in profiles]}
    decode_goals = [row for row in evaluate(reports) if not row["goal"].startswith(("relay", "load"))]
    assert len(decode_goals) == 9
    assert all(row["figure"] == 1.0 for row in decode_goals), decode_goals
