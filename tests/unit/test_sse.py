"""Replaying a stream after a failover: the client sees each piece of text exactly once."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh_sidecar.errors import MalformedMessageError, ReplayMismatchError
from mesh_sidecar.serve.sse import EventSplitter, Replay, StreamLedger


def chat_event(content: str | None, *, id_: str = "chatcmpl-1", role: bool = False, finish: str | None = None) -> bytes:
    delta = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    body = {"id": id_, "created": 1, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def completion_event(text: str, id_: str = "cmpl-1") -> bytes:
    body = {"id": id_, "created": 1, "choices": [{"index": 0, "text": text}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def text_of(events: list[bytes]) -> str:
    out = ""
    for event in events:
        line = event.strip()[len(b"data: "):]
        if line == b"[DONE]":
            continue
        choice = json.loads(line)["choices"][0]
        out += choice.get("delta", {}).get("content") or choice.get("text", "")
    return out


def deliver(ledger: StreamLedger, events: list[bytes]) -> list[bytes]:
    for event in events:
        ledger.record(event)
    return events


PIECES = ["Once", " upon", " a", " time", ",", " a", " keeper", " watched", " the", " sea", "."]


@pytest.mark.parametrize("cut", range(len(PIECES) + 1))
def test_replay_continues_exactly_where_the_client_stopped(cut: int) -> None:
    original = [chat_event(None, role=True)] + [chat_event(p) for p in PIECES]
    ledger = StreamLedger()
    sent = deliver(ledger, original[: cut + 1])
    replay = Replay(ledger)
    replayed = [chat_event(None, role=True, id_="chatcmpl-2")] + [chat_event(p, id_="chatcmpl-2") for p in PIECES]
    replayed += [chat_event(None, id_="chatcmpl-2", finish="stop"), b"data: [DONE]\n\n"]
    passed = [out for event in replayed if (out := replay.filter(event)) is not None]
    assert text_of(sent) + text_of(passed) == "".join(PIECES)
    assert passed[-1] == b"data: [DONE]\n\n"
    # The client keeps seeing the id of the stream it started.
    assert all(json.loads(e[6:])["id"] == "chatcmpl-1" for e in passed[:-1])


@given(st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=30), st.data())
def test_replay_with_differently_cut_pieces(pieces: list[str], data) -> None:
    """The new stream may cut the same text into other pieces; the sum still comes out exact."""
    whole = "".join(pieces)
    ledger = StreamLedger()
    sent_events = deliver(ledger, [completion_event(p) for p in pieces[: data.draw(st.integers(0, len(pieces)))]])
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(whole) - 1)), max_size=10)))
    bounds = [0, *cuts, len(whole)]
    new_pieces = [whole[a:b] for a, b in pairwise(bounds) if whole[a:b]]
    replay = Replay(ledger)
    passed = [out for p in new_pieces if (out := replay.filter(completion_event(p, "cmpl-2"))) is not None]
    assert text_of(sent_events) + text_of(passed) == whole


def test_a_different_answer_on_replay_is_refused() -> None:
    ledger = StreamLedger()
    deliver(ledger, [completion_event("The sea"), completion_event(" was calm")])
    replay = Replay(ledger)
    assert replay.filter(completion_event("The sea")) is None
    with pytest.raises(ReplayMismatchError):
        replay.filter(completion_event(" was rough"))


def test_nothing_delivered_yet_passes_everything() -> None:
    replay = Replay(StreamLedger())
    assert replay.filter(completion_event("Hello")) is not None
    assert replay.filter(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_event_splitter_handles_any_chunking() -> None:
    stream = b"".join(completion_event(p) for p in PIECES) + b"data: [DONE]\n\n"
    for size in (1, 2, 7, 64, len(stream)):
        splitter = EventSplitter()
        events = [e for i in range(0, len(stream), size) for e in splitter.feed(stream[i:i + size])]
        assert b"".join(events) == stream and len(events) == len(PIECES) + 1


def test_event_splitter_caps_what_it_holds() -> None:
    with pytest.raises(MalformedMessageError):
        EventSplitter().feed(b"data: " + b"x" * (5 * 1024 * 1024))
