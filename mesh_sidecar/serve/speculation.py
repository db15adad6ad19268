"""Speculative decoding on the serving node: a local draft (or n-gram lookup) proposes, the mesh verifies.

Over a real network plain layer-split decoding is latency bound: every token
crosses every link. With speculation llama-server lets a small draft model
(always on the serving node's own CPU: ``--spec-draft-device none``) propose
several tokens and the big model, through the mesh, checks them all in one
traversal. Greedy output is the same as without it: only accepted tokens count.

The draft must share the target's tokenizer: its token ids mean the same words.
``tokenizer_fingerprint`` reads both GGUFs' vocabularies; ``auto`` picks the
smallest compatible GGUF among the models this machine has cached.

How many tokens to draft depends on the link: a traversal costs about one
round trip per link in the plan, a draft token a few milliseconds of local
compute. ``choose`` turns the slowest measured RTT into a draft length (more
tokens on slower links) and, without a draft model, falls back to n-gram
lookup from the prompt and output so far, which costs nothing when it misses.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from ..home import cache_root
from ..llama.model_files import read_header

AUTO = "auto"
TOKENS_KEY = "tokenizer.ggml.tokens"
TOKENIZER_MODEL_KEY = "tokenizer.ggml.model"
# (slowest heartbeat RTT in the plan, ms) -> tokens to draft: a cheap local draft is
# worth more tokens per traversal the more a traversal costs. Heartbeat RTTs include
# each side's event-loop latency (a few ms on a busy machine), hence no finer steps.
DRAFT_LENGTH_BY_RTT_MS = ((5.0, 4), (20.0, 8), (float("inf"), 12))
NGRAM_DRAFT_MAX = 8


@dataclass(frozen=True)
class Speculation:
    """What llama-server is told, and why (shown by `status`)."""

    kind: str  # "none", "draft" or "ngram"
    draft_model: Path | None
    draft_max: int
    reason: str

    def llama_server_args(self) -> list[str]:
        if self.kind == "draft":
            assert self.draft_model is not None
            return ["--spec-draft-model", str(self.draft_model), "--spec-draft-device", "none",
                    "--spec-type", "draft-simple", "--spec-draft-n-max", str(self.draft_max)]
        if self.kind == "ngram":
            return ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(self.draft_max)]
        return []

    def to_json(self) -> dict:
        return {"kind": self.kind, "draft_model": str(self.draft_model) if self.draft_model else None,
                "draft_max": self.draft_max, "reason": self.reason}


def tokenizer_fingerprint(model: Path) -> str:
    """sha256 over a GGUF's tokenizer type and token list; ModelError if it has none."""
    fields = read_header(model).fields
    tokens, kind = fields.get(TOKENS_KEY), fields.get(TOKENIZER_MODEL_KEY)
    if not isinstance(tokens, list) or not isinstance(kind, str):
        raise ModelError(f"{model} has no tokenizer in its GGUF metadata, so it cannot serve as a draft.")
    digest = hashlib.sha256(_utf8(kind))
    for token in tokens:
        part = _utf8(token)
        digest.update(len(part).to_bytes(4, "little") + part)
    return digest.hexdigest()


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")  # the bytes as stored, valid UTF-8 or not


def check_pair(target: Path, draft: Path) -> None:
    """ModelError unless ``draft`` can draft for ``target`` (same tokenizer)."""
    if tokenizer_fingerprint(target) != tokenizer_fingerprint(draft):
        raise ModelError(f"The draft model {draft.name} has another tokenizer than {target.name}: its token ids "
                         "would mean other words. Pick a draft of the same model family (same vocabulary).")


def find_draft(target: Path, search: Path | None = None) -> Path:
    """``auto``: the smallest cached GGUF with the target's tokenizer (the target itself if it is the only one)."""
    wanted = tokenizer_fingerprint(target)
    candidates = []
    for path in sorted((search or cache_root() / "models").rglob("*.gguf")):
        try:
            if path.resolve() != target.resolve() and tokenizer_fingerprint(path) == wanted:
                candidates.append(path)
        except ModelError:
            continue
    smaller = [p for p in candidates if p.stat().st_size < target.stat().st_size]
    if smaller:
        return min(smaller, key=lambda p: p.stat().st_size)
    raise ModelError(f"No cached GGUF smaller than {target.name} shares its tokenizer, so `--draft-model auto` "
                     "has nothing to pick. Pass --draft-model PATH with a small model of the same family.")


def choose(draft_model: Path | None, slowest_rtt_ms: float | None, remote_members: int,
           *, allowed: bool = True) -> Speculation:
    """The speculation for a plan whose slowest link has ``slowest_rtt_ms`` (None: no remote member).

    ``allowed`` False (``--speculation off``): plain decoding whatever the links.
    """
    if not allowed:
        return Speculation("none", None, 0, "turned off (--speculation off)")
    if remote_members == 0 or slowest_rtt_ms is None:
        draft_max = DRAFT_LENGTH_BY_RTT_MS[0][1]
        rtt_text = "all layers local"
    else:
        draft_max = next(n for limit, n in DRAFT_LENGTH_BY_RTT_MS if slowest_rtt_ms < limit)
        rtt_text = f"slowest link {slowest_rtt_ms:.1f} ms"
    if draft_model is not None:
        return Speculation("draft", draft_model, draft_max, f"draft model, {draft_max} tokens ({rtt_text})")
    if remote_members and slowest_rtt_ms is not None and slowest_rtt_ms >= DRAFT_LENGTH_BY_RTT_MS[0][0]:
        # Lookup costs nothing when it misses, and every hit saves a whole traversal.
        return Speculation("ngram", None, NGRAM_DRAFT_MAX, f"n-gram lookup ({rtt_text})")
    return Speculation("none", None, 0, f"no draft model and fast links ({rtt_text})")
