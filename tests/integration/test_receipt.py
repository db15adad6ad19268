"""A real node's receipts: they verify, replay to the same text, and a tampered one is refused."""

from __future__ import annotations

import json

import httpx
import pytest

from mesh_sidecar.serve.receipt import CONTINUE_AT_HEADER
from tests.helpers.llama import GREEDY, N_PREDICT, PROMPT
from tests.helpers.nodes import cli


@pytest.mark.slow
def test_a_real_nodes_receipts_verify_and_replay(start_node, tmp_path, reference_text):
    receipts = tmp_path / "receipts"
    node = start_node("c", "--receipt", str(receipts), serve=True)
    response = httpx.post(f"http://127.0.0.1:{node.serve_port}/v1/completions", timeout=120,
                          json={"prompt": PROMPT, "max_tokens": N_PREDICT, **GREEDY})
    response.raise_for_status()
    assert response.json()["choices"][0]["text"] == reference_text
    assert response.json()["choices"][0].get("logprobs") is None  # asked for by us, not shown to the client
    (path,) = receipts.glob("*.json")
    body = json.loads(path.read_text())["body"]
    assert body["output"]["n_tokens"] == N_PREDICT and body["model"]["sha256"]
    assert [n["name"] for n in body["plan"]] == ["c"] and body["request"]["body"]["prompt"] == PROMPT

    ok = cli("verify", str(path), "--replay", "--home", str(node.home))
    assert ok.returncode == 0, ok.stderr
    assert "Signature OK" in ok.stdout and "Replay OK" in ok.stdout

    text = path.read_text()
    tampered = tmp_path / "tampered.json"
    tampered.write_text(text.replace(f'"n_tokens": {N_PREDICT}', f'"n_tokens": {N_PREDICT + 1}'))
    refused = cli("verify", str(tampered))
    assert refused.returncode == 1 and "signature does not match" in refused.stderr


@pytest.mark.slow
def test_a_continued_answers_receipt_says_where_and_its_replay_continues_there(start_node, tmp_path):
    """The proxy continues at the points a receipt names (as after a failover): the receipt records them,
    and ``verify --replay`` reproduces the answer exactly, a stream's and a plain one's."""
    receipts = tmp_path / "receipts"
    node = start_node("c", "--receipt", str(receipts), serve=True)
    url = f"http://127.0.0.1:{node.serve_port}/v1/completions"
    request = {"prompt": PROMPT, "max_tokens": N_PREDICT, **GREEDY}
    refused = httpx.post(url, json=request, headers={CONTINUE_AT_HEADER: "twelve"}, timeout=120)
    assert refused.status_code == 400 and CONTINUE_AT_HEADER in refused.json()["error"]["message"]
    with httpx.stream("POST", url, json={**request, "stream": True}, headers={CONTINUE_AT_HEADER: "12,30"},
                      timeout=120) as streamed:
        assert streamed.status_code == 200
        events = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert sum(bool(json.loads(e[len("data: "):])["choices"][0].get("text")) for e in events) == N_PREDICT
    # The stream, first on a fresh node, read its prompt afresh; its continuations do too, whichever slot
    # they land in. The plain request sets cache_prompt off, as docs/cli.md says for answers to replay:
    # it would otherwise read its prompt from the slot the stream left (computed in another batch).
    plain = httpx.post(url, json={**request, "cache_prompt": False}, headers={CONTINUE_AT_HEADER: "20"}, timeout=120)
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == N_PREDICT
    answered = sorted(receipts.glob("*.json"))
    assert sorted(json.loads(path.read_text())["body"].get("continued_at", []) for path in answered) == [[12, 30], [20]]
    for path in answered:
        ok = cli("verify", str(path), "--replay", "--home", str(node.home))
        assert ok.returncode == 0 and "Replay OK" in ok.stdout, ok.stdout + ok.stderr
    # The replays were continued at the same points: their own receipts say so.
    replayed = sorted(set(receipts.glob("*.json")) - set(answered))
    assert sorted(json.loads(path.read_text())["body"].get("continued_at", []) for path in replayed) == [[12, 30], [20]]
