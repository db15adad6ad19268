"""A generation request as the proxy sends it: seed pinned, token ids asked for, a plain one streamed."""

from __future__ import annotations

import json

from mesh_sidecar.serve.continuation import CHAT_PATH, COMPLETIONS_PATH
from mesh_sidecar.serve.generation import prepare, requested_model
from mesh_sidecar.serve.recovery import Shape

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def test_a_plain_request_that_continuation_covers_is_streamed_to_be_assembled():
    prepared = prepare(CHAT_PATH, json.dumps(CHAT).encode(), receipts=False, continues=True)
    sent = json.loads(prepared.body)
    assert prepared.shape is Shape.ASSEMBLED and prepared.assembly is not None and prepared.continuation
    assert sent["stream"] is True and sent["logprobs"] is True and isinstance(sent["seed"], int)
    assert prepared.meant == {**CHAT, "seed": sent["seed"]}  # what the client meant, seed pinned
    assert prepared.tap is not None


def test_a_stream_stays_a_stream_and_a_request_continuation_cannot_carry_is_left_alone():
    stream = prepare(COMPLETIONS_PATH, b'{"prompt": "Hi", "stream": true}', receipts=False, continues=True)
    assert stream.shape is Shape.STREAM and stream.continuation is not None and stream.assembly is None
    grammar = prepare(COMPLETIONS_PATH, b'{"prompt": "Hi", "grammar": "root ::= \\"a\\""}', receipts=False,
                      continues=True)
    assert grammar.shape is Shape.WHOLE and grammar.tap is None and "logprobs" not in json.loads(grammar.body)


def test_receipts_ask_for_token_ids_even_without_continuation():
    prepared = prepare(COMPLETIONS_PATH, b'{"prompt": "Hi", "seed": 5}', receipts=True, continues=False)
    assert prepared.shape is Shape.WHOLE and prepared.continuation is None and prepared.tap is not None
    assert json.loads(prepared.body) == {"prompt": "Hi", "seed": 5, "logprobs": 1, "post_sampling_probs": True}


def test_a_client_asking_for_logprobs_gets_llama_servers_own():
    """Only the logprobs we add are the sampler's (cheap); a client's are llama-server's default."""
    prepared = prepare(COMPLETIONS_PATH, b'{"prompt": "Hi", "seed": 5, "logprobs": 2}', receipts=True,
                       continues=False)
    assert json.loads(prepared.body) == {"prompt": "Hi", "seed": 5, "logprobs": 2}
    assert prepared.tap is not None


def test_a_body_that_is_not_a_json_object_passes_as_it_is():
    for body in (b"not json", b"[1, 2]"):
        prepared = prepare(COMPLETIONS_PATH, body, receipts=True, continues=True)
        assert prepared.body == body and prepared.shape is Shape.WHOLE and prepared.tap is None


def test_the_model_a_request_names():
    assert requested_model(b'{"model": "big"}') == "big"
    assert requested_model(b'{"model": 3}') == requested_model(b"nope") == ""
