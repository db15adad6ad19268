"""A generation request on its way to llama-server, and what a receipt hears of its answer.

The proxy sends a generation request (``/v1/completions``, ``/v1/chat/completions``) as
``prepare`` makes it: the seed pinned (replay.py); per-token ids asked for when a receipt or a
continuation needs them (the tap strips them again unless the client asked); and a plain
request that continuation covers sent as a stream, to be assembled into the one answer the
client asked for (continuation.py). Pure: the client's bytes in, what to send and what reads
the answer out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .continuation import Assembly, Continuation, streamed, uncovered
from .receipt import OutputTap, ask_for_token_ids
from .recovery import Shape
from .sse import pin_seed

IMAGE_PART = "image_url"  # a chat message's content part holding an image (a data URL, or a URL)


@dataclass(frozen=True)
class Generation:
    """One finished generation request, for receipts: the request as sent (seed pinned) and what came back."""

    path: str
    request: dict[str, Any]
    output: OutputTap
    model: str  # the id of the model that answered
    continued_at: tuple[int, ...] = ()  # the tokens delivered at each continuation after a failover


@dataclass(frozen=True)
class PreparedRequest:
    """A generation request as llama-server gets it, and what reads its answer."""

    body: bytes
    shape: Shape
    meant: dict[str, Any] | None = None  # the request as the client meant it, seed pinned (for the receipt)
    tap: OutputTap | None = None  # token ids and timings; None: none asked for
    continuation: Continuation | None = None  # None: a stream begun is replayed after a failover
    assembly: Assembly | None = None  # a plain answer made from llama-server's stream


def is_json_object(body: bytes) -> bool:
    """Whether a request body is one JSON object (a generation request must be: else refused at once)."""
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


def has_images(body: bytes) -> bool:
    """Whether a chat request holds an image part (OpenAI's ``image_url`` content parts)."""
    try:
        request = json.loads(body)
    except ValueError:
        return False
    messages = request.get("messages") if isinstance(request, dict) else None
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") == IMAGE_PART
        for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"])


def requested_model(body: bytes) -> str:
    """The ``model`` a generation request names ("" for none, or a body we cannot read)."""
    try:
        request = json.loads(body)
    except ValueError:
        return ""
    model = request.get("model") if isinstance(request, dict) else None
    return model if isinstance(model, str) else ""


def prepare(path: str, body: bytes, *, receipts: bool, continues: bool) -> PreparedRequest:
    """The request to send for the client's ``body`` on ``path``.

    ``receipts``: the answer's token ids are wanted for a receipt; ``continues``: a stream is
    continued after a failover where continuation covers it (else replayed). A body that is not
    a JSON object passes with its seed unpinned: llama-server will answer it.
    """
    body, streaming = pin_seed(body)
    shape = Shape.STREAM if streaming else Shape.WHOLE
    try:
        request = json.loads(body)
    except ValueError:
        return PreparedRequest(body, shape)
    if not isinstance(request, dict) or not (receipts or continues):
        return PreparedRequest(body, shape)
    meant = json.loads(body)
    tap = OutputTap(strip=ask_for_token_ids(request, path))
    continuation = assembly = None
    if continues and uncovered(path, request) is None:
        if not streaming:
            request, shape, assembly = streamed(path, request), Shape.ASSEMBLED, Assembly(path)
        continuation = Continuation(path, request)
    elif not receipts:
        return PreparedRequest(body, shape)  # neither a receipt nor a continuation needs token ids
    return PreparedRequest(json.dumps(request).encode(), shape, meant, tap, continuation, assembly)
