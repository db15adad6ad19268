"""One request's recovery machine, without sockets: every row of its table, then every path
through it (hypothesis) against a simulated llama-server whose answer is known token by token."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_sidecar.errors import MeshError
from mesh_sidecar.serve.continuation import CHAT_PATH, COMPLETIONS_PATH, CONTINUE_PATH, Assembly, Continuation
from mesh_sidecar.serve.recovery import (
    MAX_FAILOVERS_PER_REQUEST,
    Ask,
    Broken,
    Cut,
    Failed,
    GiveUp,
    Prepare,
    Prepared,
    PrepareFailed,
    Refused,
    RequestRecovery,
    Shape,
    Step,
    Unavailable,
    UpstreamReady,
    WaitForUpstream,
)

N_TOKENS = 8
BUDGET = 12  # more than N_TOKENS: the answer ends with "stop"
RENDERED = "<|user|>Tell me about lighthouses.<|assistant|>"
REQUESTS = {
    COMPLETIONS_PATH: {"prompt": "Lighthouses", "stream": True, "seed": 7, "max_tokens": BUDGET, "logprobs": 1},
    CHAT_PATH: {"messages": [{"role": "user", "content": "Tell me about lighthouses."}], "stream": True,
                "seed": 7, "max_tokens": BUDGET, "logprobs": True, "top_logprobs": 1},
}


def answer(model: str) -> list[tuple[str, int]]:
    """The model's greedy answer: (text, id) per token."""
    base = 100 if model == "a" else 500
    return [(f"{model}{i} ", base + i) for i in range(N_TOKENS)]


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def token_event(path: str, text: str, token_id: int) -> bytes:
    logprobs = {"content": [{"id": token_id, "token": text, "logprob": -0.1, "top_logprobs": []}]}
    if path == CHAT_PATH:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}
    return sse({"id": "x", "created": 1, "model": "m", "choices": [choice]})


def final_event(path: str) -> bytes:
    choice: dict[str, Any] = ({"index": 0, "delta": {}, "finish_reason": "stop"} if path == CHAT_PATH
                              else {"index": 0, "text": "", "finish_reason": "stop"})
    return sse({"id": "x", "created": 1, "model": "m", "choices": [choice]})


def client_text(events: list[bytes]) -> str:
    text = ""
    for event in events:
        payload = json.loads(event[len(b"data: "):]) if event.startswith(b"data: {") else {}
        for choice in payload.get("choices", []):
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            text += piece or ""
    return text


def machine(path: str = COMPLETIONS_PATH, shape: Shape = Shape.STREAM, *, covered: bool = True,
            continue_at: tuple[int, ...] = ()) -> RequestRecovery:
    body = json.dumps(REQUESTS[path]).encode()
    continuation = Continuation(path, dict(REQUESTS[path])) if covered else None
    return RequestRecovery(path, body, shape, "a", continuation, continue_at)


def deliver(recovery: RequestRecovery, path: str, model: str, start: int, count: int) -> list[bytes]:
    """llama-server's events for tokens [start, start + count) of ``model``'s answer, through the machine."""
    out = []
    for text, token_id in answer(model)[start:start + count]:
        out += recovery.relay(token_event(CONTINUE_PATH if recovery.continuing else path, text, token_id))
    return out


def failed_after(recovery: RequestRecovery, path: str, tokens: int, *, began: bool = True) -> None:
    """The request asked, ``tokens`` of model a's answer relayed (a stream begun, unless not ``began``),
    then its llama-server failed."""
    recovery.start()
    if began:
        recovery.began()
    deliver(recovery, path, "a", 0, tokens)
    recovery.handle(Failed("ReadError()"))


# --- the table, row by row --------------------------------------------------------------------


def test_a_request_is_asked_as_it_came():
    recovery = machine()
    ask = recovery.start()
    assert ask == Ask(COMPLETIONS_PATH, json.dumps(REQUESTS[COMPLETIONS_PATH]).encode(), Step.ASKED)


def test_a_failure_waits_for_the_next_llama_server_until_the_failovers_are_spent():
    recovery = machine()
    recovery.start()
    for _ in range(MAX_FAILOVERS_PER_REQUEST):
        assert recovery.handle(Failed("ReadError()")) == WaitForUpstream()
        assert recovery.handle(UpstreamReady("a")).step is Step.RETRIED
    assert recovery.handle(Failed("ReadError()")) == GiveUp(502, "llama-server failed again (ReadError())",
                                                            "upstream_failed")


def test_a_lost_connection_to_a_live_llama_server_goes_on_there_without_waiting():
    """Only the connection broke (llama-server answers its health check): no newer llama-server is coming, so
    the request is asked again, continued or replayed on the same one at once; it still counts as a failover."""
    recovery = machine()
    recovery.start()
    assert recovery.handle(Failed("ServerDisconnectedError()", upstream_alive=True)).step is Step.RETRIED
    recovery = machine()
    recovery.start()
    recovery.began()
    deliver(recovery, COMPLETIONS_PATH, "a", 0, 3)
    prepare = recovery.handle(Failed("ReadError()", upstream_alive=True))
    assert isinstance(prepare, Prepare) and prepare.detokenize == {"tokens": [100, 101, 102]}
    assert recovery.handle(Failed("ReadError()", upstream_alive=True)) == prepare
    assert isinstance(recovery.handle(Failed("ReadError()", upstream_alive=True)), GiveUp)


def test_no_llama_server_in_time_gives_up_with_its_reason():
    recovery = machine()
    recovery.start()
    recovery.handle(Failed("ReadError()"))
    assert recovery.handle(Unavailable("Needs 2.1 GiB more", "insufficient_capacity")) == GiveUp(
        503, "Needs 2.1 GiB more", "insufficient_capacity")


def test_nothing_delivered_is_retried_whole_even_on_another_model():
    for model in ("a", "b"):
        recovery = machine()
        recovery.start()
        recovery.handle(Failed("ReadError()"))
        assert recovery.handle(UpstreamReady(model)).step is Step.RETRIED


def test_a_stream_with_text_does_not_cross_a_model_switch():
    recovery = machine()
    failed_after(recovery, COMPLETIONS_PATH, 3)
    decision = recovery.handle(UpstreamReady("b"))
    assert isinstance(decision, GiveUp) and decision.code == "model_switched" and decision.status == 503


def test_a_plain_answer_being_assembled_is_asked_again_whole_on_the_new_model():
    recovery = machine(shape=Shape.ASSEMBLED)
    failed_after(recovery, COMPLETIONS_PATH, 3, began=False)
    assert recovery.handle(UpstreamReady("b")).step is Step.SWITCHED
    assert not recovery.delivered
    assert deliver(recovery, COMPLETIONS_PATH, "b", 0, 2)  # no replay filter: all of it is new


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH])
def test_a_stream_begun_is_continued_from_the_tokens_delivered(path):
    recovery = machine(path)
    failed_after(recovery, path, 3)
    prepare = recovery.handle(UpstreamReady("a"))
    assert prepare == Prepare(REQUESTS[path] if path == CHAT_PATH else None, {"tokens": [100, 101, 102]})
    ask = recovery.handle(Prepared(RENDERED if path == CHAT_PATH else None, {"content": "a0 a1 a2 "}))
    assert isinstance(ask, Ask) and ask.step is Step.CONTINUED and ask.target == CONTINUE_PATH
    assert ask.resume_tokens == 3 and json.loads(ask.body)["prompt"][-3:] == [100, 101, 102]
    assert recovery.continued_at == [3]


@pytest.mark.parametrize("event, why", [
    (Prepared(None, {"content": "a0 a1 a2"}), "do not spell"),
    (PrepareFailed("ConnectError()"), "cannot prepare"),
])
def test_a_continuation_that_cannot_be_prepared_is_a_replay(event, why):
    recovery = machine()
    failed_after(recovery, COMPLETIONS_PATH, 3)
    recovery.handle(UpstreamReady("a"))
    ask = recovery.handle(event)
    assert ask.step is Step.REPLAYED and why in ask.why and ask.body == recovery.start().body
    assert recovery.continued_at == []


def test_a_chat_continuation_needs_its_rendered_prompt():
    recovery = machine(CHAT_PATH)
    failed_after(recovery, CHAT_PATH, 2)
    recovery.handle(UpstreamReady("a"))
    assert recovery.handle(Prepared(None, {"content": "a0 a1 "})).step is Step.REPLAYED


def test_a_refused_continuation_is_replayed_and_never_continued_again():
    recovery = machine()
    failed_after(recovery, COMPLETIONS_PATH, 3)
    recovery.handle(UpstreamReady("a"))
    recovery.handle(Prepared(None, {"content": "a0 a1 a2 "}))
    ask = recovery.handle(Refused(400, "bad prompt"))
    assert ask.step is Step.REPLAYED and "400" in ask.why and recovery.continued_at == []
    assert deliver(recovery, COMPLETIONS_PATH, "a", 0, 3) == []  # what the client has is dropped
    deliver(recovery, COMPLETIONS_PATH, "a", 3, 1)
    recovery.handle(Failed("ReadError()"))
    assert recovery.handle(UpstreamReady("a")).why == "it was replayed before"


def test_a_request_continuation_does_not_cover_is_replayed():
    recovery = machine(covered=False)
    failed_after(recovery, COMPLETIONS_PATH, 3)
    ask = recovery.handle(UpstreamReady("a"))
    assert ask.step is Step.REPLAYED and ask.why == "continuation does not cover the request"


def test_a_stream_begun_without_text_is_replayed_not_retried():
    recovery = machine()
    recovery.start()
    recovery.began()  # its headers went out: a new response cannot be sent
    recovery.handle(Failed("ReadError()"))
    assert recovery.handle(UpstreamReady("a")).step is Step.REPLAYED


def test_a_broken_answer_gives_up():
    recovery = machine()
    recovery.start()
    assert recovery.handle(Broken("the model answered differently")) == GiveUp(
        502, "the model answered differently", "upstream_failed")


def test_a_replay_that_differs_raises_for_the_proxy_to_feed_broken():
    recovery = machine(covered=False)
    failed_after(recovery, COMPLETIONS_PATH, 2)
    recovery.handle(UpstreamReady("a"))
    with pytest.raises(MeshError):
        recovery.relay(token_event(COMPLETIONS_PATH, "other ", 900))


def test_a_planned_resume_point_continues_there_on_the_same_llama_server():
    recovery = machine(continue_at=(3,))
    recovery.start()
    recovery.began()
    deliver(recovery, COMPLETIONS_PATH, "a", 0, 2)
    assert not recovery.cut_due()
    deliver(recovery, COMPLETIONS_PATH, "a", 2, 1)
    assert recovery.cut_due()
    assert recovery.handle(Cut()) == Prepare(None, {"tokens": [100, 101, 102]})
    ask = recovery.handle(Prepared(None, {"content": "a0 a1 a2 "}))
    assert ask.step is Step.CONTINUED and ask.resume_tokens == 3 and recovery.continued_at == [3]
    deliver(recovery, COMPLETIONS_PATH, "a", 3, 3)
    assert not recovery.cut_due()  # the point is spent


def test_a_planned_point_the_answer_passes_over_is_dropped():
    recovery = machine(continue_at=(2, 5))
    recovery.start()
    recovery.relay(token_event(COMPLETIONS_PATH, "", 100))  # held back: no text, no resume point
    recovery.relay(token_event(COMPLETIONS_PATH, "", 101))
    recovery.relay(token_event(COMPLETIONS_PATH, "a0a1a2 ", 102))  # three tokens resumable at once
    assert not recovery.cut_due()
    deliver(recovery, COMPLETIONS_PATH, "a", 3, 2)
    assert recovery.cut_due()


# --- every path: a simulated llama-server, failures wherever hypothesis puts them --------------


@dataclass
class Client:
    """What the client holds, as the proxy would give it."""

    shape: Shape
    path: str
    events: list[bytes] = field(default_factory=list)
    assembly: Assembly | None = None
    whole: str | None = None  # a WHOLE answer

    def text(self) -> str:
        if self.whole is not None:
            return self.whole
        if self.assembly is not None:
            response = self.assembly.response()["choices"][0]
            return response["message"]["content"] if self.path == CHAT_PATH else response["text"]
        return client_text(self.events)


def run(data: st.DataObject, path: str, shape: Shape, covered: bool) -> tuple[RequestRecovery, Client,
                                                                               GiveUp | None, str, list[Any]]:
    """Drive one request to its end; returns the machine, the client, the give-up (None: answered),
    the model that answered last and every decision made (a refused continuation's ask left out)."""
    recovery = machine(path, shape, covered=covered)
    client = Client(shape, path, assembly=Assembly(path) if shape is Shape.ASSEMBLED else None)
    model = "a"
    decisions: list[Any] = []
    decision: Any = recovery.start()
    for _ in range(40):
        decisions.append(decision)
        if isinstance(decision, GiveUp):
            return recovery, client, decision, model, decisions
        if isinstance(decision, WaitForUpstream):
            outcome = data.draw(st.sampled_from(["a", "b", "unavailable"]), label="next llama-server")
            if outcome == "unavailable":
                decision = recovery.handle(Unavailable("No llama-server", "model_loading"))
            else:
                model = outcome
                decision = recovery.handle(UpstreamReady(model))
            continue
        if isinstance(decision, Prepare):
            spelled = "".join(text for text, _ in answer(model)[:len(decision.detokenize["tokens"])])
            outcome = data.draw(st.sampled_from(["ok", "misspelled", "failed"]), label="prepare")
            if outcome == "failed":
                decision = recovery.handle(PrepareFailed("ConnectError()"))
            else:
                decision = recovery.handle(Prepared(RENDERED if decision.template is not None else None,
                                                    {"content": spelled + ("?" if outcome == "misspelled" else "")}))
            continue
        assert isinstance(decision, Ask)
        if decision.step is Step.SWITCHED:
            client.assembly = Assembly(path)
        if decision.step is Step.CONTINUED and data.draw(st.booleans(), label="continuation refused"):
            decisions.pop()
            decision = recovery.handle(Refused(400, "no"))
            continue
        start = 0
        if decision.step is Step.CONTINUED:
            prompt = json.loads(decision.body)["prompt"]
            ids = [p for p in prompt if isinstance(p, int)]
            assert ids == [token_id for _, token_id in answer(model)[:len(ids)]], "continued from other tokens"
            start = len(ids)
        fails_after = data.draw(st.one_of(st.none(), st.integers(0, N_TOKENS)), label="fails after")
        if shape is Shape.WHOLE:
            if fails_after is None:
                client.whole = "".join(text for text, _ in answer(model))
                return recovery, client, None, model, decisions
            decision = recovery.handle(Failed("ReadError()"))
            continue
        if shape is Shape.STREAM:
            recovery.began()
        event_path = CONTINUE_PATH if decision.step is Step.CONTINUED else path
        tokens = answer(model)[start:] if fails_after is None else answer(model)[start:start + fails_after]
        for text, token_id in tokens:
            for out in recovery.relay(token_event(event_path, text, token_id)):
                if client.assembly is not None:
                    client.assembly.add(out)
                else:
                    client.events.append(out)
        if fails_after is None:
            for out in recovery.relay(final_event(event_path)):
                (client.assembly.add if client.assembly is not None else client.events.append)(out)
            return recovery, client, None, model, decisions
        decision = recovery.handle(Failed("ReadError()"))
    raise AssertionError("the machine did not end")


@settings(max_examples=400, deadline=None)
@given(data=st.data(), path=st.sampled_from([COMPLETIONS_PATH, CHAT_PATH]),
       shape=st.sampled_from(list(Shape)), covered=st.booleans())
def test_every_path_gives_the_client_exactly_one_models_answer_or_an_error(data, path, shape, covered):
    recovery, client, gave_up, model, decisions = run(data, path, shape, covered)
    asks = [d for d in decisions if isinstance(d, Ask)]
    failures = sum(isinstance(d, WaitForUpstream) for d in decisions)
    text = client.text()
    # Never a duplicate or a gap: what the client has is a prefix of one model's answer.
    full = {m: "".join(t for t, _ in answer(m)) for m in "ab"}
    assert any(full[m].startswith(text) for m in "ab"), text
    if gave_up is None:
        assert text == full[model], "an answer that ended must be whole"
    else:
        assert gave_up.code in ("upstream_failed", "model_loading", "model_switched")
        if gave_up.code == "upstream_failed":
            assert failures == MAX_FAILOVERS_PER_REQUEST  # the next failure was one too many
        if gave_up.code == "model_switched":
            assert shape is Shape.STREAM and text  # only text already sent stops a switch
    # Never continued once replayed; only what can be continued is.
    steps = [ask.step for ask in asks]
    if Step.REPLAYED in steps:
        assert Step.CONTINUED not in steps[steps.index(Step.REPLAYED):]
    if Step.CONTINUED in steps:
        assert covered and shape is not Shape.WHOLE
    if shape is Shape.WHOLE:
        assert set(steps) <= {Step.ASKED, Step.RETRIED}
    # The receipt's record: the tokens each continuation went on from, in order.
    assert recovery.continued_at == [ask.resume_tokens for ask in asks if ask.step is Step.CONTINUED]
    assert recovery.continued_at == sorted(recovery.continued_at)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), path=st.sampled_from([COMPLETIONS_PATH, CHAT_PATH]),
       shape=st.sampled_from([Shape.STREAM, Shape.ASSEMBLED]))
def test_a_receipts_resume_points_reproduce_its_continuations(data, path, shape):
    """What a failover did, a replay with its ``continued_at`` does on an undisturbed mesh."""
    points = sorted(set(data.draw(st.lists(st.integers(1, N_TOKENS - 1), max_size=3), label="continued at")))
    recovery = machine(path, shape, continue_at=tuple(points))
    ask: Any = recovery.start()
    start, text = 0, ""
    while True:
        assert isinstance(ask, Ask)
        event_path = CONTINUE_PATH if ask.step is Step.CONTINUED else path
        cut = False
        for token_text, token_id in answer("a")[start:]:
            text += client_text(recovery.relay(token_event(event_path, token_text, token_id)))
            if recovery.cut_due():
                cut = True
                break
        if not cut:
            break
        prepare = recovery.handle(Cut())
        assert isinstance(prepare, Prepare)
        start = len(prepare.detokenize["tokens"])
        ask = recovery.handle(Prepared(RENDERED if prepare.template is not None else None,
                                       {"content": "".join(t for t, _ in answer("a")[:start])}))
    assert recovery.continued_at == points
    assert text == "".join(t for t, _ in answer("a"))
