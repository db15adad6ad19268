"""One API request as the proxy reads it at the edge, parsed once, and the body it sends upstream.

The aiohttp handler reads the client's body and makes an ``ApiRequest`` of it: the body is
parsed here and nowhere else, and what routing, recovery and receipts ask of it (its model,
whether it streams, its images, its conversation) is read off the parsed object. Bytes a
request did not change (a non-generation request, a body that is not a JSON object) go
upstream as the client sent them.

A generation request (``/v1/completions``, ``/v1/chat/completions``) is sent as ``prepare``
makes it, serialised once: the seed pinned, so llama-server produces the same tokens when
asked again (sse.py's ``Replay``); per-token ids asked for when a receipt or a continuation
needs them (the tap strips them again unless the client asked); and a plain request that
continuation covers sent as a stream, to be assembled into the one answer the client asked
for (continuation.py). Pure: the client's bytes in, what to send and what reads the answer out.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Any

from .catalog import conversation_key
from .continuation import Assembly, Continuation, streamed, uncovered
from .receipt import OutputTap, ask_for_token_ids
from .recovery import Shape
from .sse import GENERATION_PATHS

IMAGE_PART = "image_url"  # a chat message's content part holding an image (a data URL, or a URL)
SEED_BITS = 31
POST = "POST"


@dataclass(frozen=True)
class ApiRequest:
    """A client's request, its body parsed once: what the proxy routes, prepares and forwards."""

    method: str
    path: str
    path_qs: str  # the path with its query, as llama-server gets it
    body: bytes  # as the client sent it: forwarded unchanged when nothing in it changes
    parsed: dict[str, Any] | None  # the body, when it is one JSON object (None: it is not)
    model: str  # the ``model`` it names ("" for none, or a body we cannot read)
    stream: bool  # it asks for a stream (``"stream": true``)
    images: bool  # a chat request holding an image part (OpenAI's ``image_url`` content parts)

    @classmethod
    def parse(cls, method: str, path: str, body: bytes, path_qs: str | None = None) -> ApiRequest:
        """The request for ``body`` sent with ``method`` to ``path``; any body is accepted."""
        try:
            document = json.loads(body)
        except ValueError:
            document = None
        parsed = document if isinstance(document, dict) else None
        model = parsed.get("model") if parsed is not None else None
        return cls(method, path, path if path_qs is None else path_qs, body, parsed,
                   model if isinstance(model, str) else "", parsed is not None and parsed.get("stream") is True,
                   _holds_images(parsed))

    @functools.cached_property
    def conversation(self) -> str | None:
        """What stays the same over its conversation's requests (catalog.conversation_key): hashed only for a
        model with several replicas, where it keeps the conversation with one."""
        return conversation_key(self.path, self.parsed)

    @property
    def generation(self) -> bool:
        """Whether it asks llama-server to generate (it must be a JSON object: else refused at once)."""
        return self.method == POST and self.path in GENERATION_PATHS


def _holds_images(request: dict[str, Any] | None) -> bool:
    messages = request.get("messages") if request is not None else None
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") == IMAGE_PART
        for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"])


def pin_seed(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` with a ``seed``: itself when the client gave one, else a copy with one picked."""
    if isinstance(request.get("seed"), int) and request["seed"] >= 0:
        return request
    return {**request, "seed": random.getrandbits(SEED_BITS)}


@dataclass(frozen=True)
class PreparedRequest:
    """A request as llama-server gets it, and what reads its answer."""

    body: bytes
    shape: Shape
    meant: dict[str, Any] | None = None  # the request as the client meant it, seed pinned (for the receipt)
    tap: OutputTap | None = None  # token ids and timings; None: none asked for
    continuation: Continuation | None = None  # None: a stream begun is replayed after a failover
    assembly: Assembly | None = None  # a plain answer made from llama-server's stream


def forwarded_as_is(request: ApiRequest) -> PreparedRequest:
    """A request that is not a generation: its body goes upstream unchanged, its answer read whole."""
    return PreparedRequest(request.body, Shape.WHOLE)


def prepare(request: ApiRequest, *, receipts: bool, continues: bool) -> PreparedRequest:
    """The generation request to send for the client's ``request``.

    ``receipts``: the answer's token ids are wanted for a receipt; ``continues``: a stream is
    continued after a failover where continuation covers it (else replayed). A body that is not
    a JSON object passes with its seed unpinned: llama-server will answer it.
    """
    shape = Shape.STREAM if request.stream else Shape.WHOLE
    if request.parsed is None:
        return PreparedRequest(request.body, shape)
    meant = pin_seed(request.parsed)
    covered = continues and uncovered(request.path, meant) is None
    if not (receipts or covered):
        # Neither a receipt nor a continuation needs token ids: the client's bytes when it gave a seed.
        return PreparedRequest(request.body if meant is request.parsed else _serialised(meant), shape)
    sent = dict(meant)  # asking for token ids changes only its top-level keys
    tap = OutputTap(strip=ask_for_token_ids(sent, request.path))
    continuation = assembly = None
    if covered:
        if shape is Shape.WHOLE:
            sent, shape, assembly = streamed(request.path, sent), Shape.ASSEMBLED, Assembly(request.path)
        continuation = Continuation(request.path, sent)
    return PreparedRequest(_serialised(sent), shape, meant, tap, continuation, assembly)


def _serialised(request: dict[str, Any]) -> bytes:
    return json.dumps(request).encode()
