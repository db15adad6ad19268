"""A request parsed once at the edge, and a generation request as the proxy sends it: seed pinned, token ids
asked for, a plain one streamed."""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx
import pytest
from aiohttp import web

from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve.api_request import ApiRequest, pin_seed, prepare
from mesh_sidecar.serve.continuation import CHAT_PATH, COMPLETIONS_PATH
from mesh_sidecar.serve.exchange import ServingHooks
from mesh_sidecar.serve.metrics import Metrics
from mesh_sidecar.serve.proxy import ApiProxy
from mesh_sidecar.serve.receipt import Generation
from mesh_sidecar.serve.recovery import Shape
from tests.helpers.stand_ins import start_stand_in, stream_events

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def chat(body: bytes, path: str = CHAT_PATH) -> ApiRequest:
    return ApiRequest.parse("POST", path, body)


def test_a_plain_request_that_continuation_covers_is_streamed_to_be_assembled():
    prepared = prepare(chat(json.dumps(CHAT).encode()), receipts=False, continues=True)
    sent = json.loads(prepared.body)
    assert prepared.shape is Shape.ASSEMBLED and prepared.assembly is not None and prepared.continuation
    assert sent["stream"] is True and sent["logprobs"] is True and isinstance(sent["seed"], int)
    assert prepared.meant == {**CHAT, "seed": sent["seed"]}  # what the client meant, seed pinned
    assert prepared.tap is not None


def test_a_stream_stays_a_stream_and_a_request_continuation_cannot_carry_is_left_alone():
    stream = prepare(chat(b'{"prompt": "Hi", "stream": true}', COMPLETIONS_PATH), receipts=False, continues=True)
    assert stream.shape is Shape.STREAM and stream.continuation is not None and stream.assembly is None
    grammar = prepare(chat(b'{"prompt": "Hi", "grammar": "root ::= \\"a\\""}', COMPLETIONS_PATH), receipts=False,
                      continues=True)
    assert grammar.shape is Shape.WHOLE and grammar.tap is None and "logprobs" not in json.loads(grammar.body)


def test_receipts_ask_for_token_ids_even_without_continuation():
    prepared = prepare(chat(b'{"prompt": "Hi", "seed": 5}', COMPLETIONS_PATH), receipts=True, continues=False)
    assert prepared.shape is Shape.WHOLE and prepared.continuation is None and prepared.tap is not None
    assert json.loads(prepared.body) == {"prompt": "Hi", "seed": 5, "logprobs": 1, "post_sampling_probs": True}


def test_a_client_asking_for_logprobs_gets_llama_servers_own():
    """Only the logprobs we add are the sampler's (cheap); a client's are llama-server's default."""
    prepared = prepare(chat(b'{"prompt": "Hi", "seed": 5, "logprobs": 2}', COMPLETIONS_PATH), receipts=True,
                       continues=False)
    assert json.loads(prepared.body) == {"prompt": "Hi", "seed": 5, "logprobs": 2}
    assert prepared.tap is not None


def test_a_body_that_is_not_a_json_object_passes_as_it_is():
    for body in (b"not json", b"[1, 2]"):
        prepared = prepare(chat(body, COMPLETIONS_PATH), receipts=True, continues=True)
        assert prepared.body == body and prepared.shape is Shape.WHOLE and prepared.tap is None


def test_a_request_whose_seed_is_given_and_needs_no_token_ids_goes_as_the_client_sent_it():
    body = b'{"prompt":   "Hi", "seed": 5}'
    assert prepare(chat(body, COMPLETIONS_PATH), receipts=False, continues=False).body == body


def test_the_model_a_request_names():
    assert chat(b'{"model": "big"}').model == "big"
    assert chat(b'{"model": 3}').model == chat(b"nope").model == ""


def test_what_the_edge_reads_of_a_request():
    request = ApiRequest.parse("POST", CHAT_PATH, json.dumps({**CHAT, "stream": True}).encode(), CHAT_PATH + "?a=1")
    assert request.generation and request.stream and not request.images and request.conversation is not None
    assert request.parsed == {**CHAT, "stream": True} and request.path_qs == CHAT_PATH + "?a=1"
    for body in (b"", b"not json", b"[1, 2]"):
        odd = chat(body)
        assert odd.parsed is None and not odd.stream and odd.conversation is None and odd.body == body
    assert not ApiRequest.parse("GET", "/v1/models", b"").generation


def test_seed_is_pinned_unless_given() -> None:
    pinned = pin_seed({"prompt": "hi", "stream": True})
    assert isinstance(pinned["seed"], int) and pinned["stream"] is True
    given = {"prompt": "hi", "seed": 5}
    assert pin_seed(given) is given
    assert pin_seed({"prompt": "hi", "seed": -1})["seed"] >= 0


MARKER = "count-my-parses"  # in the client's body only: the stand-in's answer never holds it


@pytest.mark.parametrize("stream", [True, False])
async def test_the_proxy_parses_a_clients_body_once(monkeypatch, stream):
    """Routing, preparation (seed, token ids, continuation, assembly) and the receipt all read one parse."""
    parses: list[str] = []
    loads = json.loads

    def counting_loads(text: Any, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("mesh_sidecar") and MARKER in (text.decode() if isinstance(text, bytes) else text):
            parses.append(caller)
        return loads(text, *args, **kwargs)

    sent: list[bytes] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        sent.append(await request.read())
        return await stream_events(request, [
            b'data: {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": '
            b'{"content": "Hi"}, "finish_reason": null}]}\n\n',
            b'data: {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, '
            b'"finish_reason": "stop"}]}\n\n'], None)

    app = web.Application()
    app.router.add_post(CHAT_PATH, completions)
    runner, url = await start_stand_in(app)
    generations: list[Generation] = []
    proxy = ApiProxy(Metrics(lambda: ()), hooks=ServingHooks(split=lambda: True, on_generation=generations.append))
    port = free_tcp_port()
    await proxy.start(port)
    proxy.serve(url)
    monkeypatch.setattr(json, "loads", counting_loads)
    request = {"messages": [{"role": "user", "content": MARKER}], "stream": stream}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"http://127.0.0.1:{port}{CHAT_PATH}", json=request)
    finally:
        monkeypatch.undo()
        await proxy.close()
        await runner.cleanup()
    assert response.status_code == 200 and "Hi" in response.text
    assert len(sent) == 1 and json.loads(sent[0])["stream"] is True  # continued if need be, so streamed
    assert len(generations) == 1 and generations[0].request["messages"] == request["messages"]
    assert parses == ["mesh_sidecar.serve.api_request"]
