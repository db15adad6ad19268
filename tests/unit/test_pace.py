"""A slow worker: the stream's pace, the tunnels' reply waits, the verdict both sides name, and its gossip."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh_sidecar.errors import MalformedMessageError
from mesh_sidecar.mesh.exclusion import CORRUPT_OUTPUT, SLOW, SLOW_EXCLUSION_S, exclusion_of
from mesh_sidecar.mesh.verdicts import Verdicts
from mesh_sidecar.net.reply_waits import REPLY_WAIT_HISTORY_S, ReplyWaits
from mesh_sidecar.serve.pace import PLANNED_SLACK, SLOW_FACTOR, STALL_FLOOR_S, StreamPace, TokenPace
from mesh_sidecar.wire.gossip import MAX_JUDGED_MEMBERS, CorruptOutput, MemberInfo, SlowWorker
from mesh_sidecar.wire.rpc_outputs import NON_FINITE
from tests.unit.test_gossip import info

WORKER, OTHER, SERVING = b"\x0b" * 32, b"\x0a" * 32, b"\x0c" * 32
TOKEN_S = 0.05  # a token's time on a healthy plan


def streamed(pace: StreamPace, start: float, gap_s: float, count: int) -> float:
    """``count`` chunks ``gap_s`` apart from ``start``; the time of the last."""
    for i in range(count):
        pace.arrived(start + i * gap_s)
    return start + (count - 1) * gap_s


# --- the pace -------------------------------------------------------------------------------

def test_the_expected_token_time_comes_from_finished_requests_and_is_never_below_the_links() -> None:
    pace = TokenPace()
    assert pace.expected_s(0.01) is None  # no request finished yet: nothing to judge by
    pace.finished(1 / TOKEN_S)
    assert pace.expected_s(0.0) == pytest.approx(TOKEN_S)
    assert pace.expected_s(0.2) == 0.2  # a token crosses every link once
    pace.finished(1 / (2 * TOKEN_S))  # a slower request moves the average, not all the way
    assert TOKEN_S < pace.expected_s(0.0) < 2 * TOKEN_S


def test_before_any_answer_a_token_is_expected_to_take_the_plans_time_with_slack() -> None:
    """The first request after a start is judged too: a link that turns bad before it would hold it up unjudged."""
    pace = TokenPace()
    assert pace.expected_s(0.01, None) is None  # a plan without speeds: nothing to judge by
    assert pace.expected_s(0.0, TOKEN_S) == pytest.approx(PLANNED_SLACK * TOKEN_S)
    assert pace.expected_s(1.0, TOKEN_S) == 1.0
    pace.finished(1 / TOKEN_S)  # measured now: the plan's guess is no longer used
    assert pace.expected_s(0.0, 10 * TOKEN_S) == pytest.approx(TOKEN_S)
    stream = StreamPace()
    start = streamed(stream, 100.0, 1.0, 3)  # a token a second, against a plan of 50 ms a token
    assert stream.judge(start + STALL_FLOOR_S + 1, TokenPace().expected_s(0.0, TOKEN_S), False) is not None


def test_a_stream_keeping_pace_is_never_slow() -> None:
    pace = StreamPace()
    last = streamed(pace, 100.0, TOKEN_S, 400)
    assert pace.judge(last, TOKEN_S, prompts_waiting=False) is None
    # Four streams batched take a few times longer per token each: still far within SLOW_FACTOR.
    batched = StreamPace()
    last = streamed(batched, 100.0, 3 * TOKEN_S, 200)
    assert batched.judge(last, TOKEN_S, prompts_waiting=False) is None


def test_tokens_read_together_count_each() -> None:
    """A fast model's tokens (1 ms each) read 20 ms apart, 20 to a chunk: the pace counts tokens, not
    chunks, so a healthy stream is not slow, and one whose chunks carry a token a second is."""
    token_s, chunk_gap_s, per_chunk = 0.001, 0.02, 20
    pace = StreamPace()
    now = 100.0
    for _ in range(int(STALL_FLOOR_S / chunk_gap_s) + 1):
        pace.arrived(now, per_chunk)
        now += chunk_gap_s
    assert pace.judge(now, token_s, prompts_waiting=False) is None
    for _ in range(int(STALL_FLOOR_S) + 1):
        now += 1.0
        pace.arrived(now, 1)
    slow = pace.judge(now, token_s, prompts_waiting=False)
    assert slow is not None and slow.tokens == int(STALL_FLOOR_S)


def test_a_stream_that_stops_is_slow_within_the_floor() -> None:
    pace = StreamPace()
    last = streamed(pace, 100.0, TOKEN_S, 100)
    assert pace.judge(last + 0.5, TOKEN_S, prompts_waiting=False) is None
    slow = pace.judge(last + STALL_FLOOR_S, TOKEN_S, prompts_waiting=False)
    assert slow is not None and slow.tokens == 0 and slow.window_s == STALL_FLOOR_S
    assert slow.since == pytest.approx(last)
    assert slow.describe() == "0 token(s) in 3.0 s where one takes about 50 ms"


def test_a_stream_is_never_judged_over_less_than_the_floor() -> None:
    pace = StreamPace()
    pace.arrived(100.0)  # its first token, then nothing
    assert pace.judge(100.0 + STALL_FLOOR_S - 0.01, TOKEN_S, prompts_waiting=False) is None
    assert pace.judge(100.0 + STALL_FLOOR_S, TOKEN_S, prompts_waiting=False) is not None


def test_a_stream_a_second_a_token_is_slow_where_a_token_takes_50_ms() -> None:
    pace = StreamPace()
    last = streamed(pace, 100.0, TOKEN_S, 20)
    last = streamed(pace, last + 1.0, 1.0, 4)  # every RPC a second late
    slow = pace.judge(last, TOKEN_S, prompts_waiting=False)
    assert slow is not None and slow.tokens == 3


def test_a_slow_model_gets_a_window_of_many_tokens() -> None:
    pace = StreamPace()
    token_s = 2.0  # a big model on CPUs
    last = streamed(pace, 100.0, token_s, 3)
    assert pace.judge(last + 3 * token_s, token_s, prompts_waiting=False) is None
    slow = pace.judge(last + SLOW_FACTOR * token_s, token_s, prompts_waiting=False)
    assert slow is not None and slow.window_s == SLOW_FACTOR * token_s


def test_nothing_is_judged_before_the_first_byte_while_prompts_wait_or_without_history() -> None:
    pace = StreamPace()
    assert pace.judge(1000.0, TOKEN_S, prompts_waiting=False) is None  # its own prompt: no byte yet
    assert pace.last_progress(began=5.0) == 5.0
    last = streamed(pace, 100.0, TOKEN_S, 20)
    assert pace.last_progress(began=5.0) == last
    assert pace.judge(last + 30, TOKEN_S, prompts_waiting=True) is None  # another request's prompt
    assert pace.judge(last + 30, None, prompts_waiting=False) is None  # no finished request yet
    assert pace.judge(last + 30, TOKEN_S, prompts_waiting=False) is not None


def test_an_excused_stream_is_judged_afresh_from_then() -> None:
    pace = StreamPace()
    last = streamed(pace, 100.0, TOKEN_S, 20)
    excused_at = last + STALL_FLOOR_S
    assert pace.judge(excused_at, TOKEN_S, prompts_waiting=False) is not None
    pace.excuse(excused_at)
    assert pace.judge(excused_at + STALL_FLOOR_S / 2, TOKEN_S, prompts_waiting=False) is None
    assert pace.judge(excused_at + STALL_FLOOR_S, TOKEN_S, prompts_waiting=False) is not None


@given(st.lists(st.floats(min_value=0.0, max_value=SLOW_FACTOR * TOKEN_S / 2), min_size=1, max_size=300))
def test_gaps_under_half_the_slow_bound_are_never_slow(gaps_s: list[float]) -> None:
    pace = StreamPace()
    now = 100.0
    pace.arrived(now)
    for gap_s in gaps_s:
        now += gap_s
        pace.arrived(now)
        assert pace.judge(now, TOKEN_S, prompts_waiting=False) is None


# --- reply waits ----------------------------------------------------------------------------

def test_reply_waits_sum_the_time_a_reply_was_owed_within_the_window() -> None:
    waits = ReplyWaits()
    waits.sent(10.0)
    waits.sent(10.1)  # more of the same request: the wait began at the first byte
    waits.received(10.5)
    waits.received(10.6)  # more of the reply: nothing owed
    waits.sent(11.0)
    assert waits.owed_s(0.0, 12.0) == pytest.approx(0.5 + 1.0)  # one still owed counts up to now
    assert waits.owed_s(10.4, 12.0) == pytest.approx(0.1 + 1.0)
    assert waits.owed_s(12.0, 12.0) == 0.0
    waits.received(11.0 + REPLY_WAIT_HISTORY_S + 1)
    waits.received(11.0 + 2 * REPLY_WAIT_HISTORY_S + 2)
    assert waits.owed_s(0.0, 11.0 + 2 * REPLY_WAIT_HISTORY_S + 2) == 0.0  # forgotten


# --- verdicts, refusal and gossip -----------------------------------------------------------

def slow_verdict(node_id: bytes = WORKER, run_id: int = 7) -> SlowWorker:
    return SlowWorker(node_id, run_id, owed_ms=3000, window_ms=3100, token_ms=50)


def test_both_sides_name_slow_until_the_member_restarts() -> None:
    worker = info(WORKER, "b", run_id=7)
    serving = info(SERVING, "c", serving=True, slow_workers=(slow_verdict(),))
    found = exclusion_of(worker, serving)
    assert found is not None and found.reason == SLOW
    assert found.detail == "c waited 3.0 s of 3.1 s for the replies of b's rpc-server while a token takes about 50 ms"
    assert "given layers again in 10 minutes" in found.message("b")
    assert exclusion_of(dataclasses.replace(worker, run_id=8), serving) is None  # restarted
    assert exclusion_of(info(OTHER, "a", run_id=7), serving) is None


def test_a_slow_verdict_ends_by_itself_and_a_corrupt_one_only_with_a_restart() -> None:
    verdicts = Verdicts()
    verdicts.corrupt_found(CorruptOutput(OTHER, 3, NON_FINITE))
    verdicts.slow_found(slow_verdict(), now=1000.0)
    assert verdicts.expire(1000.0 + SLOW_EXCLUSION_S - 1) == []
    assert verdicts.expire(1000.0 + SLOW_EXCLUSION_S) == [WORKER]
    assert verdicts.slow == () and len(verdicts.corrupt) == 1
    assert verdicts.forgive_restarted(info(OTHER, run_id=3)) is None  # the same run
    assert verdicts.forgive_restarted(info(OTHER, run_id=4)) == CORRUPT_OUTPUT
    assert verdicts.corrupt == ()


def test_verdicts_keep_the_newest_one_per_member_within_gossips_limit() -> None:
    verdicts = Verdicts()
    verdicts.corrupt_found(CorruptOutput(WORKER, 7, NON_FINITE))
    verdicts.slow_found(slow_verdict(WORKER), now=0.0)  # replaces the older verdict on the same member
    assert verdicts.corrupt == () and verdicts.slow == (slow_verdict(WORKER),)
    for i in range(MAX_JUDGED_MEMBERS + 2):
        verdicts.corrupt_found(CorruptOutput(bytes([i]) * 32, i, NON_FINITE))
    assert len(verdicts.corrupt) + len(verdicts.slow) == MAX_JUDGED_MEMBERS
    assert verdicts.slow == ()  # the oldest went first
    assert verdicts.forgive_restarted(info(WORKER, run_id=8)) is None


def test_the_slow_list_is_optional_and_shares_the_limit_with_corrupt_outputs() -> None:
    serving = info(SERVING, serving=True, run_id=1, slow_workers=(slow_verdict(),),
                   corrupt_outputs=(CorruptOutput(OTHER, 1, NON_FINITE),))
    assert MemberInfo.from_body(serving.to_body()) == serving
    body = serving.to_body()
    with pytest.raises(MalformedMessageError, match="at most 4 items together"):
        MemberInfo.from_body({**body, "slow_workers": body["slow_workers"] * MAX_JUDGED_MEMBERS})
    with pytest.raises(MalformedMessageError, match="owed_ms"):
        MemberInfo.from_body({**body, "slow_workers": [{**body["slow_workers"][0], "owed_ms": -1}]})
