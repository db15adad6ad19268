"""Every member serves every model in the mesh, with real processes: a node that serves nothing answers
for the models others serve (forwarded over the mesh), lists them, and counts them; a serving node that
dies takes its model out of every list and ends its streams with an error, while the other model goes
on; a replica that dies hands its stream to the other; what the called node must refuse never reaches
a serving node; and the API's default port falls back to a free one.

The two-model mesh (one per module, the tests after the first in file order; the last one kills its
serving node ``a``):

    a   serves SmolLM2-135M alone (it fits)
    b   serves the 8-layer synthetic tier model, split over c [0, 7) and b [7, 8) (its cap, 250M, holds
        one layer and the output head)
    c   a worker (2G) that serves nothing; its API needs a key
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from benchmarks.synthetic_model import TIER_TEST, ensure_synthetic_model
from mesh_sidecar.ports import DEFAULT_API_PORT
from mesh_sidecar.wire.api_forward import ForwardedRequest
from tests.helpers.mesh_api import (
    GREEDY,
    Streamed,
    answer_text,
    ask,
    forward_unadmitted,
    forwarded,
    generation_requests,
    kill_node,
    listed_models,
    samples,
    start_on_the_default_port,
    stranger,
    stream,
    url,
)
from tests.helpers.nodes import LoopbackNodes, cli
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

KEY = "member-key-31"
KEYED = {"Authorization": f"Bearer {KEY}"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SHORT_TOKENS = 16
READY_TIMEOUT_S = 120.0
LOST_WITHIN_S = 10.0  # the mesh marks a silent member lost after about 5 s
STREAM_END_WITHIN_S = 30.0
# A long greedy completion, killed a few tokens in.
LONG = {"prompt": "Write a long story about a lighthouse keeper and a storm.", "max_tokens": 100,
        "ignore_eos": True, **GREEDY}
TOKENS_BEFORE_KILL = 10


def short(model: str, path: str, **request) -> tuple[str, dict]:
    """A short greedy request for ``model``: a completion, or a chat."""
    base = {"prompt": "The three primary colors are"} if path == COMPLETIONS else {
        "messages": [{"role": "user", "content": "Name a fruit and its colour."}]}
    return path, {**base, "model": model, "max_tokens": SHORT_TOKENS, **GREEDY, **request}


def first_piece(streamed: Streamed) -> str:
    """The text of a stream's first event that has any (a chat's first event may carry only its role)."""
    return next(text for i in range(1, len(streamed.events) + 1) if (text := streamed.text(i)))


def once_long(event: threading.Event) -> Callable[[Streamed], None]:
    """A stream's ``on_event`` that sets ``event`` once TOKENS_BEFORE_KILL events came."""

    def on_event(streamed: Streamed) -> None:
        if len(streamed.events) >= TOKENS_BEFORE_KILL:
            event.set()

    return on_event


def names(entries: list[dict]) -> list[str]:
    return [entry["name"] for entry in entries]


def plan_json(node) -> dict:
    result = cli("plan", "--home", str(node.home), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def both_ready(port: int, models: set[str], headers: dict | None = None) -> dict[str, dict] | None:
    listed = listed_models(port, headers)
    return listed if set(listed) == models and all(m["status"] == "ready" for m in listed.values()) else None


# --- the API's default port --------------------------------------------------------------------


def test_the_default_api_port_falls_back_to_a_free_one(tmp_path, binaries):
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", DEFAULT_API_PORT))
        holder.listen()
    except OSError:
        holder.close()
        pytest.skip(f"port {DEFAULT_API_PORT} is in use on this machine: this test holds it itself")
    node = None
    try:
        node = start_on_the_default_port(tmp_path, "d")
        api = node.status()["api"]
        assert api["fallback_from"] == DEFAULT_API_PORT and api["enabled"] is True, api
        assert isinstance(api["port"], int) and api["port"] != DEFAULT_API_PORT, api
        assert api["url"] == f"http://localhost:{api['port']}/v1"
        assert f"Port {DEFAULT_API_PORT} is taken" in node.text() and f"on port {api['port']} instead" in node.text()
        # The API answers there: no model in this one-node mesh, and it says so.
        assert httpx.get(url(api["port"], "/health"), timeout=10).json() == {"status": "ok", "models": []}
        assert listed_models(api["port"]) == {}
        refused = ask(api["port"], *short("", COMPLETIONS))
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", refused.text
        assert "No model is served now" in refused.json()["error"]["message"]
    finally:
        holder.close()
        if node is not None:
            node.stop_with_children()


# --- replicas: two nodes serve one model ------------------------------------------------------


def which(before: dict, after: dict) -> list[str]:
    """The serving nodes whose forwarded count grew between two readings of ``forwarded``, once per request."""
    return sorted(node for key, count in after.items() for node in [key[1]] * int(count - before.get(key, 0)))


def test_replicas_share_a_model_and_a_stream_survives_one_dying(start_node, model_path):
    small = model_path.stem
    r1 = start_node("r1", serve=True, spread=False)
    r2 = start_node("r2", "--join", r1.ticket(), serve=True, spread=False)
    w = start_node("w", "--join", r1.ticket())
    for node in (r1, r2):
        assert names(plan_json(node)["nodes"]) == [node.home.name]  # each alone

    def two_replicas() -> dict[str, dict] | None:
        listed = listed_models(w.api_port)
        entry = listed.get(small, {})
        # Both ready: the model is "ready" as soon as one is, and the other may still be loading.
        both = len(entry.get("replicas", [])) == 2 and all(r["state"] == "ready" for r in entry["replicas"])
        return listed if entry.get("status") == "ready" and both else None

    listed = wait_until(two_replicas, READY_TIMEOUT_S, "w lists both replicas")
    assert list(listed) == [small]  # one entry for the model, however many serve it
    replicas = listed[small]["replicas"]
    assert sorted(r["node"]["name"] for r in replicas) == ["r1", "r2"]
    assert all(r["state"] == "ready" and not r["local"] and names(r["members"]) == [r["node"]["name"]]
               for r in replicas), replicas
    (model,) = w.status()["models"]
    assert model["id"] == small and model["default"] and len(model["replicas"]) == 2

    # Routing: a conversation stays with the replica that answered it; a new one goes to the least busy.
    conversation = short(small, CHAT)
    before = forwarded(w.api_port)
    answer_text(ask(w.api_port, *conversation))
    (first,) = which(before, forwarded(w.api_port))
    busy = threading.Event()
    busy_stream: dict[str, Streamed] = {}

    def keep_busy() -> None:
        body = {**LONG, "prompt": "Tell me about the sea, at length."}
        busy_stream["s"] = stream(w.api_port, COMPLETIONS, body, on_event=lambda s: busy.set())

    # Gossip says each replica's load: wait until it says the first request is over.
    wait_until(lambda: all(r["in_flight"] == 0 for m in w.status()["models"] for r in m["replicas"]), 30,
               "no request in flight at either replica")
    before = forwarded(w.api_port)
    busy_thread = threading.Thread(target=keep_busy)
    busy_thread.start()
    try:
        assert busy.wait(60), "the busy stream began"
        (busy_at,) = which(before, forwarded(w.api_port))
        assert busy_at == first  # both were asked with no request in flight: the same rule picks
        before = forwarded(w.api_port)
        answer_text(ask(w.api_port, *conversation))
        assert which(before, forwarded(w.api_port)) == [first], "the conversation went to another replica"
        before = forwarded(w.api_port)
        answer_text(ask(w.api_port, *short(small, CHAT, messages=[{"role": "user", "content": "Count to five."}])))
        assert which(before, forwarded(w.api_port)) != [first], "a new conversation went to the busy replica"
    finally:
        busy_thread.join(STREAM_END_WITHIN_S * 4)
    assert "s" in busy_stream, "the busy stream did not end"
    assert busy_stream["s"].done and busy_stream["s"].error is None

    # A replica killed under a stream: the stream goes on on the other, from the tokens it delivered.
    reference = stream(r1.api_port, COMPLETIONS, LONG)
    assert reference.done and len(reference.events) > LONG["max_tokens"] // 2
    pids = {node.home.name: (node, node.child_pids()) for node in (r1, r2)}
    enough = threading.Event()
    result: dict[str, Streamed] = {}

    def long_stream() -> None:
        result["s"] = stream(w.api_port, COMPLETIONS, LONG,
                             on_event=once_long(enough))

    before = forwarded(w.api_port)
    asker = threading.Thread(target=long_stream)
    asker.start()
    try:
        assert enough.wait(60), "the long stream began"
        (serving,) = which(before, forwarded(w.api_port))
        (other,) = {"r1", "r2"} - {serving}
        kill_began = time.monotonic()  # kill_node returns once every process is gone: the stream may be over
        kill_node(*pids[serving])
        wait_until(lambda: [r["node"]["name"] for r in listed_models(w.api_port).get(small, {}).get("replicas", [])]
                   == [other], LOST_WITHIN_S, f"{serving} leaves w's list")
    finally:
        asker.join(STREAM_END_WITHIN_S * 4)
    assert "s" in result, "the stream did not end"
    survived = result["s"]
    assert survived.error is None and survived.done, survived.error
    assert survived.finish_reasons() == ["length"]
    # The text delivered before the kill: a failover is now quicker than the slowest tokens may be, so the
    # longest wait no longer marks it (test_failover.py checks the exact seam by token ids).
    seam = next(i for i, at_s in enumerate(survived.at_s) if at_s > kill_began)
    # Alone, the same text up to the failover (after it, another replica's batch: no identity asserted).
    assert reference.text().startswith(survived.text(seam)) and seam >= TOKENS_BEFORE_KILL
    assert len(survived.text()) > len(survived.text(seam))
    after = samples(w.api_port)
    assert after[f"mesh_forward_errors_total{{model={small},node={serving}}}"] == 1
    assert after["mesh_streams_resumed_total{how=continued}"] == 1
    assert which(before, forwarded(w.api_port)) == sorted([serving, other])  # asked once each
    # And w still answers for the model.
    assert answer_text(ask(w.api_port, *short(small, COMPLETIONS))) == answer_text(
        ask(pids[other][0].api_port, *short(small, COMPLETIONS)))


# --- two models: one alone on a, one split over b and c; c serves neither ------------------------


@pytest.fixture(scope="module")
def tier_model():
    return ensure_synthetic_model(TIER_TEST)


@pytest.fixture(scope="module")
def two_models(binaries, model_path, tier_model, tmp_path_factory):
    nodes = LoopbackNodes(tmp_path_factory.mktemp("every-member"))
    try:
        a = nodes.start("a", serve=True, spread=False)
        c = nodes.start("c", "--join", a.ticket(), "--max-memory", "2G", "--api-key", KEY)
        b = nodes.start("b", "--model", str(tier_model), "--max-memory", "250M", "--join", a.ticket(),
                        serve=True, spread=False)
        wait_until(lambda: both_ready(c.api_port, {model_path.stem, tier_model.stem}, KEYED), READY_TIMEOUT_S,
                   "c lists both models, ready")
        yield a, b, c
    finally:
        nodes.stop_all()


def test_a_member_serving_nothing_answers_for_every_model(two_models, model_path, tier_model):
    a, b, c = two_models
    small, tier = model_path.stem, tier_model.stem
    listed = both_ready(c.api_port, {small, tier}, KEYED)
    assert listed is not None
    assert listed[small]["default"] and not listed[tier]["default"]  # a began serving first
    assert [r["node"]["name"] for r in listed[small]["replicas"]] == ["a"]
    assert [r["node"]["name"] for r in listed[tier]["replicas"]] == ["b"]
    assert names(listed[small]["replicas"][0]["members"]) == ["a"]
    assert sorted(names(listed[tier]["replicas"][0]["members"])) == ["b", "c"]
    for node in (a, b):  # every node lists every model, and its own as a tier too
        there = both_ready(node.api_port, {small, tier})
        assert there is not None
        own = small if node is a else tier
        assert there[own]["replicas"][0]["local"] and there[own]["state"] == "in_service"

    serving_port = {small: a.api_port, tier: b.api_port}
    requests = [short(model, path) for model in (small, tier) for path in (COMPLETIONS, CHAT)]
    before = forwarded(c.api_port, KEYED)
    references = []
    for path, body in requests:
        model = body["model"]
        direct = stream(serving_port[model], path, body)
        assert direct.done and direct.text(), direct
        through_c = stream(c.api_port, path, body, KEYED)
        assert through_c.done and through_c.error is None and through_c.finish_reasons() == ["length"]
        assert {e["model"] for e in through_c.events} == {model}
        assert through_c.text() == direct.text(), (model, path)
        plain = ask(c.api_port, path, body, KEYED)
        assert answer_text(plain) == direct.text() and plain.json()["model"] == model, (model, path)
        assert answer_text(ask(serving_port[model], path, body)) == direct.text()
        references.append(direct)

    # Four streams at once over both models.
    streams: dict[int, Streamed] = {}
    threads = [threading.Thread(target=lambda i=i: streams.update({i: stream(
        c.api_port, requests[i][0], {**requests[i][1], "stream_options": {"include_usage": True}}, KEYED)}))
        for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(streams) == list(range(len(requests)))
    for i, (_, body) in enumerate(requests):
        got = streams[i]
        assert got.done and got.error is None and got.finish_reasons() == ["length"], (i, got.error)
        assert {e["model"] for e in got.events} == {body["model"]}
        assert got.events[-1]["usage"]["completion_tokens"] == SHORT_TOKENS
        # Batched with another request, llama.cpp may take another near-tie than alone (it is not batch
        # invariant), so a stream that differs must still begin as the one asked alone.
        alone = references[i]
        assert got.text() == alone.text() or first_piece(got) == first_piece(alone), (i, got.text(), alone.text())

    # c counted each request, by model and serving node; none failed.
    after = samples(c.api_port, KEYED)
    each = 3 * len(requests) // 2  # per model: two streams and a plain request per request, a stream at once
    counted = forwarded(c.api_port, KEYED)
    assert {key: counted[key] - before.get(key, 0) for key in counted} == {(small, "a"): each, (tier, "b"): each}
    assert not any(key.startswith("mesh_forward_errors_total{") for key in after)
    assert after[f"mesh_requests_total{{path={CHAT},status=200}}"] >= 6

    # Plans: b's model split over c and b, c held for b; a alone.
    plan_b = plan_json(b)
    assert [(n["name"], n["layers"]) for n in plan_b["nodes"]] == [("c", [0, 7]), ("b", [7, 8])]
    roles = {role["name"]: role for role in plan_b["assignment"]}
    b_id = b.status()["node"]["id"]
    assert roles["c"]["serves_with"] == b_id and "holds layers" in roles["c"]["why"] and "for b" in roles["c"]["why"]
    assert roles["b"]["serves_with"] == b_id
    plan_a = plan_json(a)
    assert names(plan_a["nodes"]) == ["a"]
    a_role = next(role for role in plan_a["assignment"] if role["name"] == "a")
    assert "alone" in a_role["why"], a_role

    # c's status: both models with their replicas and members, and its own API.
    status = c.status()
    models = {m["id"]: m for m in status["models"]}
    assert set(models) == {small, tier} and models[small]["default"] and not models[tier]["default"]
    assert [(r["node"]["name"], names(r["members"])) for r in models[small]["replicas"]] == [("a", ["a"])]
    assert [(r["node"]["name"], sorted(names(r["members"]))) for r in models[tier]["replicas"]] == [("b", ["b", "c"])]
    assert status["api"] == {"enabled": True, "port": c.api_port, "url": f"http://localhost:{c.api_port}/v1",
                             "requires_key": True, "fallback_from": None}
    assert status["serving"] is None


def test_what_the_called_node_refuses_never_reaches_a_serving_node(two_models, tier_model):
    a, b, c = two_models
    tier = tier_model.stem
    path, body = short(tier, COMPLETIONS)
    served_before = {node.home.name: generation_requests(node.api_port) for node in (a, b)}
    forwarded_before = forwarded(c.api_port, KEYED)

    missing = ask(c.api_port, path, body)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key", missing.text
    wrong = ask(c.api_port, path, body, {"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key", wrong.text
    for bad in (b'{"model": "' + tier.encode() + b'", "prompt": ', b"[1, 2]", b"\xff\xfe"):
        refused = httpx.post(url(c.api_port, path), content=bad, timeout=30,
                             headers={**KEYED, "Content-Type": "application/json"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_json", (bad, refused.text)
    huge = json.dumps({**body, "prompt": "x" * (9 * 1024 * 1024)}).encode()
    too_large = httpx.post(url(c.api_port, path), content=huge, timeout=60,
                           headers={**KEYED, "Content-Type": "application/json"})
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large", too_large.text

    # A stranger that reaches b's UDP port cannot forward a request to it: it is never admitted, and
    # its stream is never served.
    unadmitted_before = b.status()["mesh"]["unadmitted_streams"]
    quic_port = b.status()["mesh"]["quic_port"]
    turned = forward_unadmitted(quic_port, ForwardedRequest(
        "POST", path, (("Content-Type", "application/json"),), json.dumps(body).encode()))
    assert turned.closed_with is not None and "authentication timed out" in turned.closed_with, turned
    assert turned.answered == b""
    assert b.status()["mesh"]["unadmitted_streams"] >= unadmitted_before + 1
    outcome = stranger("wrong-secret", "127.0.0.1", str(quic_port), b.status()["node"]["id"])
    assert outcome.startswith("refused") and "wrong mesh secret" in outcome, outcome

    assert {node.home.name: generation_requests(node.api_port) for node in (a, b)} == served_before
    assert forwarded(c.api_port, KEYED) == forwarded_before
    # The members still serve.
    assert answer_text(ask(c.api_port, path, body, KEYED)) == answer_text(ask(b.api_port, path, body))


def test_a_serving_node_killed_leaves_the_lists_and_ends_its_streams(two_models, model_path, tier_model):
    """Destroys ``a``: the module's last test."""
    a, b, c = two_models
    small, tier = model_path.stem, tier_model.stem
    long = {**LONG, "model": small}
    reference = stream(a.api_port, COMPLETIONS, long)
    assert reference.done and len(reference.events) > LONG["max_tokens"] // 2
    tier_path, tier_body = short(tier, COMPLETIONS, max_tokens=4)
    pids = a.child_pids()
    assert len(pids) == 3  # rpc-server, llama-server and the native data relay

    # Requests for b's model, in a loop the whole time.
    codes: list[int] = []
    stop = threading.Event()

    def ask_tier() -> None:
        while not stop.is_set():
            codes.append(ask(c.api_port, tier_path, tier_body, KEYED, timeout=60).status_code)

    enough = threading.Event()
    result: dict[str, Streamed] = {}
    ended_at: list[float] = []

    def long_stream() -> None:
        result["s"] = stream(c.api_port, COMPLETIONS, long, KEYED,
                             on_event=once_long(enough))
        ended_at.append(time.monotonic())

    # A plain request for a's model sent right after the kill, before the mesh knows a is gone.
    plain: list[httpx.Response] = []
    late = threading.Thread(target=lambda: plain.append(ask(c.api_port, COMPLETIONS, {**long, "max_tokens": 8},
                                                            KEYED)))
    asker, loop = threading.Thread(target=long_stream), threading.Thread(target=ask_tier)
    loop.start()
    asker.start()
    try:
        assert enough.wait(60), "the long stream began"
        kill_node(a, pids)
        killed_at = time.monotonic()
        late.start()
        wait_until(lambda: all(small not in listed_models(node.api_port, KEYED) for node in (b, c)), LOST_WITHIN_S,
                   "a's model leaves b's and c's lists")
        gone_s = time.monotonic() - killed_at
        asker.join(STREAM_END_WITHIN_S)
        assert not asker.is_alive(), "the stream did not end"
        # A couple more requests for b's model after the stream's end.
        answered = len(codes)
        wait_until(lambda: len(codes) >= answered + 2, 60, "two more requests for b's model are answered")
    finally:
        stop.set()
        asker.join(60)
        loop.join(60)
        if late.ident is not None:
            late.join(60)

    ended = result["s"]
    assert ended.status == 200 and not ended.done
    assert ended.error is not None and ended.error["code"] == "model_unavailable", ended.error
    assert TOKENS_BEFORE_KILL <= len(ended.events) < len(reference.events)
    assert reference.text().startswith(ended.text())
    assert codes and set(codes) == {200}, codes
    # The plain request: a 503 saying the model is unavailable (a failed under it), or, had the model already
    # left c's list, a 404 saying it is not found.
    (refused,) = plain
    code = refused.json()["error"]["code"]
    assert (refused.status_code, code) in ((503, "model_unavailable"), (404, "model_not_found")), refused.text
    assert samples(c.api_port, KEYED)[f"mesh_forward_errors_total{{model={small},node=a}}"] >= 1
    print(f"\na's model left b's and c's lists {gone_s:.1f} s after the kill; the stream ended "
          f"{ended_at[0] - killed_at:.1f} s after it; {len(codes)} requests for b's model answered meanwhile; a plain "
          f"request for a's model sent at the kill got {refused.status_code} {code}")

    # The model is gone: named, it is not found (the message names what is served); the default is b's now.
    named = ask(c.api_port, COMPLETIONS, {**tier_body, "model": small}, KEYED)
    assert named.status_code == 404 and named.json()["error"]["code"] == "model_not_found", named.text
    assert repr(tier) in named.json()["error"]["message"]
    for node in (b, c):
        listed = listed_models(node.api_port, KEYED)
        assert list(listed) == [tier] and listed[tier]["default"], listed
    unnamed = ask(c.api_port, COMPLETIONS, {k: v for k, v in tier_body.items() if k != "model"}, KEYED)
    assert unnamed.status_code == 200 and unnamed.json()["model"] == tier, unnamed.text
    assert [m["id"] for m in c.status()["models"]] == [tier]
