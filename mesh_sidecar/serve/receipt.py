"""Run receipts: one signed JSON per request, that a skeptic can check and re-run.

A receipt says who served a request and how: the plan's nodes and layer
ranges, the model's and draft's sha256, the round trips measured on each edge
during the run, token counts and speeds, the draft acceptance rate, and the
sha256 of the output token ids. The serving node signs the canonical JSON of
the body with its Ed25519 node key (the key its node id is), so any change to
any byte of the body, or a signer swapped in, fails ``verify``. Together with
the request (seed pinned by the proxy) the receipt can be replayed on a mesh
and its output hash compared.

    {"version": 1, "signer": <node id hex>, "signature": <hex>, "body": {...}}

Token ids come from the response's ``logprobs`` (llama-server gives each
token's id there); the proxy asks for them when receipts are on and strips them
from what the client sees unless the client asked.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import httpx

from ..errors import AuthError, ReceiptError
from ..identity import NodeIdentity, verify_signature

RECEIPT_VERSION = 1
SIGNATURE_DOMAIN = b"mesh-inference/1 receipt|"


def canonical(body: dict[str, Any]) -> bytes:
    """The bytes a signature covers: sorted keys, no spaces, ASCII only."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def output_digest(token_ids: list[int]) -> str:
    """sha256 of the output token ids, each as a little-endian u32."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()


def sign(body: dict[str, Any], identity: NodeIdentity) -> dict[str, Any]:
    return {"version": RECEIPT_VERSION, "signer": identity.node_id.hex(),
            "signature": identity.sign(SIGNATURE_DOMAIN + canonical(body)).hex(), "body": body}


def verify(document: Any) -> dict[str, Any]:
    """The receipt's body if its signature holds; ReceiptError saying what is wrong otherwise."""
    if not isinstance(document, dict) or set(document) != {"version", "signer", "signature", "body"}:
        raise ReceiptError("not a receipt: expected the keys version, signer, signature and body")
    if document["version"] != RECEIPT_VERSION:
        raise ReceiptError(f"receipt version {document['version']!r}; this build reads {RECEIPT_VERSION}")
    body = document["body"]
    try:
        signer, signature = bytes.fromhex(document["signer"]), bytes.fromhex(document["signature"])
        verify_signature(signer, signature, SIGNATURE_DOMAIN + canonical(body))
    except (TypeError, ValueError, AuthError) as exc:
        raise ReceiptError(f"the signature does not match the receipt: it was altered or not signed by "
                           f"{str(document.get('signer'))[:16]}... ({exc})") from None
    if not isinstance(body, dict) or body.get("served_by", {}).get("id") != document["signer"]:
        raise ReceiptError("the receipt is signed by another node than the one it says served it")
    return body


# --- reading token ids out of responses ---------------------------------------------------------


def token_ids(choice: dict[str, Any]) -> list[int]:
    """The token ids in one choice's (or stream delta's) ``logprobs``."""
    logprobs = choice.get("logprobs") or {}
    return [entry["id"] for entry in logprobs.get("content") or [] if isinstance(entry.get("id"), int)]


def ask_for_token_ids(request: dict[str, Any], path: str) -> bool:
    """Make ``request`` ask for per-token logprobs; True if we added it (so it must be stripped)."""
    if request.get("logprobs"):
        return False
    if path.endswith("chat/completions"):
        request["logprobs"] = True
        request.setdefault("top_logprobs", 1)  # llama-server's default lists 20 alternatives per token
    else:
        request["logprobs"] = 1
    return True


def without_logprobs(response: dict[str, Any]) -> dict[str, Any]:
    for choice in response.get("choices") or []:
        choice.pop("logprobs", None)
    return response


class OutputTap:
    """Watches one response go by: collects token ids and timings, strips logprobs we added.

    ``content`` takes a whole JSON response, ``event`` one server-sent event;
    both return the bytes to pass on to the client.
    """

    def __init__(self, strip: bool) -> None:
        self._strip = strip
        self.token_ids: list[int] = []
        self.timings: dict[str, Any] = {}
        self.response_id: str | None = None

    def forget(self) -> None:
        """Drop what was seen: the request is being asked again from the start."""
        self.token_ids, self.timings, self.response_id = [], {}, None

    def content(self, data: bytes) -> bytes:
        response = self._take(data)
        if response is None or not self._strip:
            return data
        return json.dumps(without_logprobs(response)).encode()

    def event(self, data: bytes) -> bytes:
        if not data.startswith(b"data: ") or data.startswith(b"data: [DONE]"):
            return data
        response = self._take(data[len(b"data: "):])
        if response is None or not self._strip:
            return data
        return b"data: " + json.dumps(without_logprobs(response)).encode() + b"\n\n"

    def _take(self, data: bytes) -> dict[str, Any] | None:
        try:
            response = json.loads(data)
        except ValueError:
            return None
        if not isinstance(response, dict):
            return None
        for choice in response.get("choices") or []:
            if isinstance(choice, dict):
                self.token_ids += token_ids(choice)
        if isinstance(response.get("timings"), dict):
            self.timings = response["timings"]
        self.response_id = response.get("id", self.response_id)
        return response


REPLAY_TIMEOUT_S = 300.0


def replay(body: dict[str, Any], node_status: dict[str, Any], api_key: str | None) -> str:
    """Send the receipt's request again to the node's API; the sha256 of the output token ids."""
    serving = node_status.get("serving")
    if not serving:
        raise ReceiptError("The node in --home does not serve the API: replay against a serving node.")
    request = dict(body["request"]["body"])
    request["stream"] = False
    ask_for_token_ids(request, body["request"]["path"])
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"http://127.0.0.1:{serving['api']['port']}{body['request']['path']}"
    try:
        response = httpx.post(url, json=request, headers=headers, timeout=REPLAY_TIMEOUT_S)
        response.raise_for_status()
        answer = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise ReceiptError(f"The replay request to {url} failed: {exc}") from exc
    return output_digest([i for choice in answer.get("choices") or [] for i in token_ids(choice)])
