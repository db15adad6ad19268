"""Run receipts: signing, tampering, the proxy's tap (a real node's receipts:
tests/integration/test_receipt.py)."""

from __future__ import annotations

import json

import pytest

from mesh_sidecar.errors import ReceiptError
from mesh_sidecar.identity import generate_identity
from mesh_sidecar.serve.receipt import OutputTap, output_digest, sign, verify


def sample_body(node_id: bytes) -> dict:
    return {"served_by": {"id": node_id.hex(), "name": "c"}, "created": "2026-11-22T00:00:00.000+00:00",
            "output": {"token_ids_sha256": output_digest([1, 2, 3]), "n_tokens": 3},
            "plan": [{"id": "aa", "name": "a", "layers": [0, 15]}], "request": {"path": "/v1/completions",
                                                                             "body": {"prompt": "héllo"}}}


def test_a_signed_receipt_verifies_and_any_changed_byte_fails():
    identity = generate_identity()
    document = sign(sample_body(identity.node_id), identity)
    text = json.dumps(document)
    assert verify(json.loads(text))["plan"][0]["layers"] == [0, 15]
    # Change one byte of the body's text, wherever it is: never verifies.
    body_start = text.index('"body"')
    for position in range(body_start + 8, len(text) - 1, 7):
        changed = text[:position] + chr(ord(text[position]) ^ 1) + text[position + 1:]
        try:
            document_changed = json.loads(changed)
        except ValueError:
            continue  # no longer JSON at all: also refused by `verify` (the CLI reads JSON first)
        if document_changed == document:
            continue
        with pytest.raises(ReceiptError):
            verify(document_changed)


def test_another_node_cannot_sign_for_the_server():
    server, other = generate_identity(), generate_identity()
    document = sign(sample_body(server.node_id), other)
    with pytest.raises(ReceiptError, match="another node"):
        verify(document)
    with pytest.raises(ReceiptError):
        verify({**document, "signer": server.node_id.hex()})


def test_output_digest_depends_on_ids_and_order():
    assert output_digest([1, 2]) != output_digest([2, 1]) != output_digest([1, 2, 0])


def test_tap_collects_ids_and_strips_only_what_it_added():
    chunk = {"choices": [{"delta": {"content": "Hi"}, "logprobs": {"content": [{"id": 7, "token": "Hi"}]}}]}
    final = {"choices": [{"delta": {}}], "timings": {"predicted_n": 1, "draft_n": 4, "draft_n_accepted": 3}}
    tap = OutputTap(strip=True)
    out = tap.event(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    assert b"logprobs" not in out and json.loads(out[6:])["choices"][0]["delta"]["content"] == "Hi"
    tap.event(b"data: " + json.dumps(final).encode() + b"\n\n")
    assert tap.event(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert tap.token_ids == [7] and tap.timings["draft_n_accepted"] == 3
    keep = OutputTap(strip=False)
    whole = json.dumps({"choices": [{"text": "x", "logprobs": {"content": [{"id": 9}]}}]}).encode()
    assert keep.content(whole) == whole and keep.token_ids == [9]
