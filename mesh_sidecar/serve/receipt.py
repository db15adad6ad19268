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

An answer continued after a failover (recovery.py) says where: ``continued_at``,
the tokens delivered at each continuation. The text after that point is the
continuation's, which need not be an undisturbed run's (llama.cpp's arithmetic
differs for tokens read as one batch), so a replay asks the proxy to continue at
the same points (the CONTINUE_AT_HEADER), and an honest node's output is
reproduced exactly.

Pure: the replay's request is made here and sent by the CLI.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from ..errors import AuthError, ReceiptError
from ..identity import NodeIdentity, verify_signature
from ..llama.model_files import Shard
from ..mesh.status import rtt_ms
from .tiers import model_id

if TYPE_CHECKING:
    from ..mesh.status import PeerView
    from .planner import Plan

RECEIPT_VERSION = 1
SIGNATURE_DOMAIN = b"mesh-inference/1 receipt|"
# The proxy continues the answer at these token counts, as after a failover (comma-separated);
# it stops at the proxy. Only a replay of a receipt sends it.
CONTINUE_AT_HEADER = "Mesh-Continue-At"
MAX_CONTINUE_POINTS = 16


def parse_continue_at(value: str | None) -> tuple[int, ...]:
    """The token counts of a CONTINUE_AT_HEADER (none for no header); ValueError saying what is wrong."""
    if value is None or not value.strip():
        return ()
    try:
        points = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"{CONTINUE_AT_HEADER} must be token counts separated by commas, not {value[:40]!r}") from None
    if len(points) > MAX_CONTINUE_POINTS or any(point <= 0 for point in points):
        raise ValueError(f"{CONTINUE_AT_HEADER} takes at most {MAX_CONTINUE_POINTS} positive token counts")
    return points


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
    """Make ``request`` ask for per-token logprobs; True if we added it (so it must be stripped).

    Ours are the sampler's own probabilities (``post_sampling_probs``): the same ids, read from the
    few candidates sampling left, where the default has llama-server compute a softmax over the whole
    vocabulary for every token (about 3% of a 135M model's token on a CPU core; a GPU's token is
    shorter, so more of it)."""
    if request.get("logprobs"):
        return False
    if path.endswith("chat/completions"):
        request["logprobs"] = True
        request.setdefault("top_logprobs", 1)  # llama-server's default lists 20 alternatives per token
    else:
        request["logprobs"] = 1
    request["post_sampling_probs"] = True
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

    def keep(self, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` ids: the answer is continued from there."""
        del self.token_ids[n_tokens:]

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


@dataclass(frozen=True)
class Generation:
    """One finished generation request, for its receipt: the request as sent (seed pinned) and what came back."""

    path: str
    request: dict[str, Any]
    output: OutputTap
    model: str  # the id of the model that answered
    continued_at: tuple[int, ...] = ()  # the tokens delivered at each continuation after a failover


@dataclass(frozen=True)
class ReplayRequest:
    """A receipt's request as a replay sends it to a serving node's API."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


def replay_request(body: dict[str, Any], api_key: str | None) -> ReplayRequest:
    """The receipt's request again, unstreamed, asking for token ids, continued where the answer was."""
    request = dict(body["request"]["body"])
    request["stream"] = False
    # The prompt computed afresh, as one batch: a prefix cached from another request (one continued
    # from more tokens, say) was computed in another batch, and llama.cpp is not batch-invariant.
    request["cache_prompt"] = False
    ask_for_token_ids(request, body["request"]["path"])
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if continued_at := body.get("continued_at"):
        headers[CONTINUE_AT_HEADER] = ",".join(str(point) for point in continued_at)
    return ReplayRequest(body["request"]["path"], request, headers)


def replayed_digest(answer: Any) -> str:
    """The output digest of a replay's answer (ReceiptError when it is not one)."""
    if not isinstance(answer, dict):
        raise ReceiptError("The replay's answer is not a JSON object.")
    return output_digest([i for choice in answer.get("choices") or [] for i in token_ids(choice)])


def signed_receipt(identity: NodeIdentity, node_name: str, *, path: str, request: dict[str, Any],
                   output: OutputTap, answered_by: str, tiers: Sequence[tuple[PurePath, str]], in_service: PurePath,
                   plan: Plan, draft: tuple[PurePath, str | None] | None, speculation: dict[str, Any] | None,
                   peer_views: Sequence[PeerView], now: float, continued_at: Sequence[int] = (),
                   shards: Mapping[str, Sequence[Shard]] = {},
                   projectors: Mapping[str, tuple[PurePath, str]] = {}) -> tuple[str, str]:
    """One finished generation request's receipt (``--receipt DIR``), signed: its file name and its JSON text.

    ``answered_by``: the id of the model that answered, one of ``tiers`` ((path, sha256) of every --model;
    ``in_service`` when none has that id); ``draft``: the draft model's (path, sha256); ``peer_views``: the mesh's,
    for the round trips to the plan's other members; ``now``: seconds since the epoch; ``continued_at``: the
    tokens delivered at each continuation after a failover (recovery.py), where a replay continues too;
    ``shards``: a split model's shards by its identity (the model's ``sha256`` is then its manifest's);
    ``projectors``: a model's --mmproj projector (path, sha256) by the model's identity.
    """
    timings = output.timings
    plan_ids = {n.node_id for n in plan.nodes}
    drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
    model, sha256 = next(((model, sha256) for model, sha256 in tiers if model_id(model.name) == answered_by),
                         next((model, sha256) for model, sha256 in tiers if model == in_service))
    created = datetime.fromtimestamp(now, UTC)
    body: dict[str, Any] = {
        "id": output.response_id,
        "created": created.isoformat(timespec="milliseconds"),
        "request": {"path": path, "body": request},
        "served_by": {"id": identity.node_id.hex(), "name": node_name},
        "plan": [{"id": n.node_id.hex(), "name": n.name, "layers": [n.start, n.end]} for n in plan.nodes],
        "model": {"name": model.name, "id": model_id(model.name), "sha256": sha256},
        "draft": {"name": draft[0].name, "sha256": draft[1]} if draft is not None else None,
        "speculation": speculation,
        # Heartbeat round trips to the plan's other members, as measured while this ran.
        "edges_rtt_ms": {view.name: {"last": rtt_ms(view.rtt_last_s), "p50": rtt_ms(view.rtt_p50_s),
                                     "p95": rtt_ms(view.rtt_p95_s)}
                         for view in peer_views if view.node_id in plan_ids},
        "tokens": {"prompt": timings.get("prompt_n"), "completion": timings.get("predicted_n")},
        "tok_s": {"prompt": timings.get("prompt_per_second"), "decode": timings.get("predicted_per_second")},
        "draft_acceptance": ({"drafted": drafted, "accepted": accepted, "rate": accepted / drafted}
                             if drafted else None),
        "output": {"token_ids_sha256": output_digest(output.token_ids), "n_tokens": len(output.token_ids)},
    }
    if shards.get(sha256):  # a split model: every shard's sha256 beside the manifest's
        body["model"]["shards"] = [{"name": s.name, "sha256": s.sha256} for s in shards[sha256]]
    if projectors.get(sha256):  # it takes images: the projector is part of what answered
        projector, projector_sha256 = projectors[sha256]
        body["model"]["projector"] = {"name": projector.name, "sha256": projector_sha256}
    if continued_at:  # only then: the receipts of undisturbed answers keep their shape
        body["continued_at"] = list(continued_at)
    name = f"{created.strftime('%Y%m%d-%H%M%S')}-{output.response_id or 'request'}.json"
    return name, json.dumps(sign(body, identity), indent=2)
