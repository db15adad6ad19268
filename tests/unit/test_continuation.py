"""Continuing a stream from its delivered token ids: events in, requests and events out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mesh_sidecar.serve.continuation import CHAT_PATH, COMPLETIONS_PATH, Assembly, Continuation, streamed, uncovered

IDENTITY = {"id": "chatcmpl-first", "created": 100, "model": "SmolLM2"}
PIECES = [("Light", 101), ("houses", 102), (" guide", 103), (" ships", 104), (".", 105)]


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def payloads(events: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(e[len(b"data: "):]) for e in events if e.startswith(b"data: {")]


def logprobs(token_id: int) -> dict[str, Any]:
    return {"content": [{"id": token_id, "token": "?", "logprob": -0.1, "top_logprobs": []}]}


def chat_event(text: str | None, token_id: int | None = None, *, role: bool = False,
               finish: str | None = None, **extra: Any) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": None} if role else {}
    if text is not None:
        delta["content"] = text
    choice: dict[str, Any] = {"finish_reason": finish, "index": 0, "delta": delta}
    if token_id is not None:
        choice["logprobs"] = logprobs(token_id)
    return sse({"choices": [choice], **IDENTITY, "object": "chat.completion.chunk", **extra})


def completion_event(text: str, token_id: int | None = None, *, finish: str | None = None,
                     id_: str = "cmpl-first", **extra: Any) -> bytes:
    choice = {"text": text, "index": 0, "logprobs": logprobs(token_id) if token_id is not None else None,
              "finish_reason": finish}
    return sse({"choices": [choice], "created": 100, "model": "SmolLM2", "object": "text_completion",
                "id": id_, **extra})


def delivered(continuation: Continuation, events: list[bytes]) -> None:
    for event in events:
        continuation.record(event)


CHAT = {"messages": [{"role": "user", "content": "Tell me about lighthouses."}], "stream": True, "seed": 7,
        "temperature": 0, "max_tokens": 40, "logprobs": True, "top_logprobs": 1,
        "stream_options": {"include_usage": True}}
COMPLETION = {"prompt": "Lighthouses", "stream": True, "seed": 7, "max_tokens": 40, "logprobs": 1, "stop": ["\n\n"]}


def test_a_chat_continues_from_its_rendered_prompt_and_delivered_ids():
    continuation = Continuation(CHAT_PATH, dict(CHAT))
    delivered(continuation, [chat_event(None, role=True)] + [chat_event(t, i) for t, i in PIECES[:3]])
    assert continuation.resumable() and continuation.text == "Lighthouses guide"
    assert continuation.template_request() == CHAT  # rendered exactly as the chat endpoint renders it
    assert continuation.detokenize_request() == {"tokens": [101, 102, 103]}
    assert continuation.spells_delivered({"content": "Lighthouses guide"})
    assert not continuation.spells_delivered({"content": "Lighthouses guid"})
    request = continuation.request("<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n")
    assert request["prompt"] == ["<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n", 101, 102, 103]
    assert request["n_predict"] == 37 and request["n_probs"] == 1 and request["stream"] is True
    assert request["seed"] == 7 and request["temperature"] == 0
    assert not {"messages", "max_tokens", "logprobs", "top_logprobs", "stream_options"} & set(request)


def test_chat_continuation_events_look_like_the_chat_stream_the_client_started():
    continuation = Continuation(CHAT_PATH, dict(CHAT))
    delivered(continuation, [chat_event(None, role=True)] + [chat_event(t, i) for t, i in PIECES[:3]])
    continuation.request("prompt")
    usage = {"completion_tokens": 2, "prompt_tokens": 33, "total_tokens": 35,
             "prompt_tokens_details": {"cached_tokens": 32}}
    out = [e for event in [completion_event(" ships", 104, id_="chatcmpl-new"), completion_event(".", 105),
                           completion_event("", finish="stop", usage=usage, timings={"predicted_per_second": 9.0}),
                           b"data: [DONE]\n\n"]
           for e in continuation.reshape(event)]
    chunks = payloads(out)
    assert out[-1] == b"data: [DONE]\n\n"
    assert all({k: c[k] for k in IDENTITY} == IDENTITY and c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [{"content": " ships"}, {"content": "."}, {}]
    assert chunks[0]["choices"][0]["logprobs"]["content"][0]["id"] == 104  # kept for the ledger; the tap strips it
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    # Usage, asked for with stream_options, in its own chunk and counted as one generation of 5 tokens.
    assert chunks[3]["choices"] == [] and chunks[3]["usage"] == {
        "completion_tokens": 5, "prompt_tokens": 30, "total_tokens": 35, "prompt_tokens_details": {"cached_tokens": 30}}
    assert chunks[3]["timings"] == {"predicted_per_second": 9.0}


def test_chat_usage_is_left_out_unless_asked():
    continuation = Continuation(CHAT_PATH, {**CHAT, "stream_options": None})
    delivered(continuation, [chat_event("Light", 101)])
    continuation.request("prompt")
    chunks = payloads(continuation.reshape(completion_event("", finish="length", usage={
        "completion_tokens": 1, "prompt_tokens": 10, "total_tokens": 11})))
    assert len(chunks) == 1 and "usage" not in chunks[0] and chunks[0]["choices"][0]["finish_reason"] == "length"


def test_a_completion_continues_from_its_own_prompt_and_keeps_its_ids():
    continuation = Continuation(COMPLETIONS_PATH, {**COMPLETION, "cache_prompt": True})
    delivered(continuation, [completion_event(t, i) for t, i in PIECES[1:4]])
    request = continuation.request()
    assert request["prompt"] == ["Lighthouses", 102, 103, 104] and request["stop"] == ["\n\n"]
    assert request["n_predict"] == 37 and request["n_probs"] == 1 and request["cache_prompt"] is False
    [event] = continuation.reshape(completion_event(".", 105, id_="chatcmpl-new"))
    assert payloads([event])[0]["id"] == "cmpl-first" and payloads([event])[0]["choices"][0]["text"] == "."


@pytest.mark.parametrize("prompt, parts", [
    ("text", ["text"]), ([1, 2, 3], [1, 2, 3]), (["text"], ["text"]), (["text", 5, " more"], ["text", 5, " more"]),
])
def test_every_single_prompt_shape_is_continued_as_one_prompt(prompt, parts):
    continuation = Continuation(COMPLETIONS_PATH, {**COMPLETION, "prompt": prompt})
    delivered(continuation, [completion_event("x", 9)])
    assert continuation.request()["prompt"] == [*parts, 9]


def test_text_held_back_is_generated_again_not_skipped():
    """A possible stop string's text comes later, with the next token: ids without text are not resumed from."""
    continuation = Continuation(COMPLETIONS_PATH, dict(COMPLETION))
    delivered(continuation, [completion_event("Light", 101), completion_event("", 106)])
    assert continuation.resume_ids == [101] and continuation.text == "Light"
    delivered(continuation, [completion_event("\nhouses", 102)])  # the held "\n" and the next token
    assert continuation.resume_ids == [101, 106, 102] and continuation.text == "Light\nhouses"


def test_without_budget_the_continuation_has_none_either():
    continuation = Continuation(COMPLETIONS_PATH, {k: v for k, v in COMPLETION.items() if k != "max_tokens"})
    delivered(continuation, [completion_event("x", 9)])
    assert "n_predict" not in continuation.request()


@pytest.mark.parametrize("path, request_, why", [
    (COMPLETIONS_PATH, {**COMPLETION, "n": 2}, "'n'"),
    (COMPLETIONS_PATH, {**COMPLETION, "grammar": "root ::= [a-z]+"}, "'grammar'"),
    (CHAT_PATH, {**CHAT, "response_format": {"type": "json_object"}}, "'response_format'"),
    (CHAT_PATH, {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "'tools'"),
    (CHAT_PATH, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "not all text"),
    (COMPLETIONS_PATH, {**COMPLETION, "prompt": ["one", "two"]}, "one text"),
    ("/completion", COMPLETION, "not a generation endpoint"),
])
def test_what_continuation_does_not_cover_is_named(path, request_, why):
    assert why in uncovered(path, request_)
    continuation = Continuation(path, request_)
    delivered(continuation, [completion_event("x", 9)])
    assert not continuation.resumable()


def test_harmless_settings_are_covered():
    assert uncovered(CHAT_PATH, {**CHAT, "n": 1, "tools": [], "response_format": {"type": "text"}}) is None


@pytest.mark.parametrize("events", [
    [],  # nothing delivered: retried whole
    [completion_event("", 9)],  # only held-back text
    [completion_event("x")],  # no token ids (llama-server was not asked for them)
])
def test_nothing_to_resume_from(events):
    continuation = Continuation(COMPLETIONS_PATH, dict(COMPLETION))
    delivered(continuation, events)
    assert not continuation.resumable()


def test_answers_outside_continuation_are_replayed():
    reasoning = Continuation(CHAT_PATH, dict(CHAT))
    reasoning.record(sse({"choices": [{"index": 0, "delta": {"reasoning_content": "hm", "content": "a"},
                                        "logprobs": logprobs(9)}]}))
    assert not reasoning.resumable() and "reasoning" in reasoning.why_not
    spent = Continuation(COMPLETIONS_PATH, {**COMPLETION, "max_tokens": 2})
    delivered(spent, [completion_event("a", 1), completion_event("b", 2)])
    assert not spent.resumable()  # the budget is spent: only the final chunk was missing


def test_a_second_failover_continues_from_everything_delivered():
    continuation = Continuation(COMPLETIONS_PATH, dict(COMPLETION))
    delivered(continuation, [completion_event("Light", 101)])
    continuation.request()
    delivered(continuation, continuation.reshape(completion_event("houses", 102, id_="other")))
    assert continuation.request()["prompt"] == ["Lighthouses", 101, 102]
    [final] = continuation.reshape(completion_event("", finish="stop", usage={
        "completion_tokens": 3, "prompt_tokens": 5, "total_tokens": 8}))
    assert payloads([final])[0]["usage"] == {"completion_tokens": 5, "prompt_tokens": 3, "total_tokens": 8}


def test_errors_and_done_pass_unchanged():
    continuation = Continuation(CHAT_PATH, dict(CHAT))
    error = sse({"error": {"message": "boom", "type": "server_error", "code": 500}})
    assert continuation.reshape(error) == [error]
    assert continuation.reshape(b"data: [DONE]\n\n") == [b"data: [DONE]\n\n"]


def test_a_plain_request_streams_to_be_continued_and_is_assembled_whole():
    plain = {k: v for k, v in CHAT.items() if k not in ("stream", "stream_options", "logprobs", "top_logprobs")}
    asked = streamed(CHAT_PATH, plain)
    assert asked["stream"] is True and asked["stream_options"] == {"include_usage": True}
    assert "stream_options" not in streamed(COMPLETIONS_PATH, COMPLETION)
    continuation = Continuation(CHAT_PATH, asked)
    assembly = Assembly(CHAT_PATH)
    before = [chat_event(None, role=True), chat_event("Light"), chat_event("houses")]  # logprobs stripped
    for event in before:
        assembly.add(event)
    continuation.request("prompt")
    usage = {"completion_tokens": 1, "prompt_tokens": 12, "total_tokens": 13}
    for event in [completion_event(" guide"), completion_event("", finish="length", usage=usage)]:
        for out in continuation.reshape(event):
            assembly.add(out)
    assert assembly.response() == {
        "choices": [{"finish_reason": "length", "index": 0,
                     "message": {"role": "assistant", "content": "Lighthouses guide"}}],
        **IDENTITY, "object": "chat.completion", "usage": usage}


def test_an_assembled_completion_keeps_the_logprobs_the_client_asked_for():
    assembly = Assembly(COMPLETIONS_PATH)
    for event in [completion_event("Light", 101), completion_event("houses", 102),
                  completion_event("", finish="stop", usage={"completion_tokens": 2})]:
        assembly.add(event)
    response = assembly.response()
    assert response["object"] == "text_completion" and response["id"] == "cmpl-first"
    [choice] = response["choices"]
    assert choice["text"] == "Lighthouses" and choice["finish_reason"] == "stop"
    assert [p["id"] for p in choice["logprobs"]["content"]] == [101, 102]
    assert Assembly(COMPLETIONS_PATH).response()["choices"][0]["logprobs"] is None


def test_an_error_event_is_what_an_assembly_answers():
    assembly = Assembly(COMPLETIONS_PATH)
    assembly.add(completion_event("a"))
    assembly.add(sse({"error": {"message": "boom", "type": "server_error", "code": 500}}))
    assert assembly.error == {"error": {"message": "boom", "type": "server_error", "code": 500}}


def test_an_assembled_chat_keeps_reasoning_apart_from_the_content():
    assembly = Assembly(CHAT_PATH)
    assembly.add(sse({"choices": [{"index": 0, "delta": {"reasoning_content": "Think."}}], **IDENTITY}))
    assembly.add(chat_event("Answer."))
    assert assembly.response()["choices"][0]["message"] == {
        "role": "assistant", "content": "Answer.", "reasoning_content": "Think."}
