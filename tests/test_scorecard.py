"""The scorecard reads each goal's figure from the benchmarks' own JSON and judges it by its bound."""

from benchmarks.scorecard import evaluate, greedy_texts_identical


def _relay(gbit_s: dict[str, float]) -> dict:
    labels = {"aioquic": "aioquic 1.7.2", "qh3": "qh3 1.9.4"}
    return {"libraries": {labels[lib]: lib for lib in gbit_s},
            "paths": {"tcp": {"bulk_gbit_s": {"median": 15.0}},
                      **{f"tunnel {labels[lib]}": {"bulk_gbit_s": {"median": v}} for lib, v in gbit_s.items()}}}


def _load_setup(load_s: float, tunnel_bytes: dict[str, int]) -> dict:
    return {"load_s": load_s, "tunnel_bytes_to_peer": tunnel_bytes}


REPORTS = {
    "decode": {"profiles": [
        {"profile": "unshaped", "decode_ratio_mesh_over_direct": 0.80, "greedy_texts_identical": True},
        {"profile": "20ms", "decode_ratio_mesh_over_direct": 0.97, "greedy_texts_identical": True},
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
    assert rows["decode tok/s mesh/direct, unshaped veth"] == (0.80, False)
    assert rows["decode tok/s mesh/direct, +20 ms one way"] == (0.97, True)
    # The product's library, not the fastest one in the report.
    assert rows["relay bulk Gbit/s (aioquic), MTU 1500"] == (0.55, False)
    assert rows["relay bulk Gbit/s (aioquic), MTU 9000"] == (2.1, True)
    assert rows["load: weight bytes over tunnels, seeded/stock"] == (0.0005, True)
    assert rows["load: load time, seeded/stock"] == (0.15, True)
    assert greedy_texts_identical(REPORTS) is True


def test_a_benchmark_that_did_not_run_leaves_its_goals_without_a_figure():
    partial = {"decode": {"profiles": [
        {"profile": "unshaped", "error": "TimeoutError()"},
        {"profile": "20ms", "decode_ratio_mesh_over_direct": 0.90, "greedy_texts_identical": False},
    ]}}
    rows = _by_goal(partial)
    assert rows["decode tok/s mesh/direct, unshaped veth"] == (None, None)
    assert rows["decode tok/s mesh/direct, +20 ms one way"] == (0.90, False)
    assert all(rows[goal] == (None, None) for goal in rows if not goal.startswith("decode"))
    assert greedy_texts_identical(partial) is False
    assert greedy_texts_identical({}) is None
