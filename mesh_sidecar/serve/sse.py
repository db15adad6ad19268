"""Continuing a streamed completion after a failover: no duplicate text, no gap.

The proxy pins a ``seed`` on every generation request (the client's, or one it
picks), so llama-server produces the same tokens when asked again: greedy or
sampled, the output is a function of prompt, seed and parameters. After a
failover the proxy asks again on the new plan and passes the new stream through
``Replay``: text the client already has is checked and dropped, the event that
crosses the boundary is cut to its new part, and from then on events pass with
the ids the client first saw. If the replayed text differs from what was sent
(llama.cpp batching concurrent requests can flip a near-tie), ``ReplayMismatchError``
ends the stream with an error rather than send text that does not belong.

Sans-I/O: bytes in, bytes out. Events are server-sent events, ``data: {json}``
separated by a blank line; chat chunks carry ``choices[i].delta.content``,
completion chunks ``choices[i].text``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import MalformedMessageError, ReplayMismatchError
from ..units import MIB

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
EVENT_SEPARATOR = b"\n\n"
DATA_PREFIX = b"data: "
DONE = b"[DONE]"
MAX_PENDING_EVENT_BYTES = 4 * MIB


class EventSplitter:
    """Splits a byte stream into whole server-sent events (each ending in a blank line)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        events = []
        while (end := self._buffer.find(EVENT_SEPARATOR)) >= 0:
            events.append(bytes(self._buffer[: end + len(EVENT_SEPARATOR)]))
            del self._buffer[: end + len(EVENT_SEPARATOR)]
        if len(self._buffer) > MAX_PENDING_EVENT_BYTES:
            raise MalformedMessageError("server-sent event over the size limit")
        return events


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return DATA_PREFIX + json.dumps(payload).encode() + EVENT_SEPARATOR


def event_payload(event: bytes) -> Any:
    """The JSON of a ``data:`` event, or None for [DONE], comments and non-JSON."""
    line = event.strip()
    if not line.startswith(DATA_PREFIX) or line[len(DATA_PREFIX):] == DONE:
        return None
    try:
        return json.loads(line[len(DATA_PREFIX):])
    except ValueError:
        return None


def _pieces(payload: Any) -> dict[int, str]:
    """Text per choice index in one chunk."""
    pieces: dict[int, str] = {}
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        return pieces
    for choice in payload["choices"]:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(text, str) and text:
            pieces[choice.get("index", 0)] = text
    return pieces


@dataclass
class StreamLedger:
    """What the client has received: text per choice, and the ids it saw."""

    delivered: dict[int, str] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)  # id, created

    def record(self, event: bytes) -> None:
        payload = event_payload(event)
        if payload is None:
            return
        if not self.identity:
            self.identity = {k: payload[k] for k in ("id", "created") if k in payload}
        for index, text in _pieces(payload).items():
            self.delivered[index] = self.delivered.get(index, "") + text


class Replay:
    """Filters a replayed stream against a ledger; records what it lets through."""

    def __init__(self, ledger: StreamLedger) -> None:
        self._ledger = ledger
        self._replayed: dict[int, str] = {}

    def caught_up(self) -> bool:
        return all(len(self._replayed.get(i, "")) >= len(text) for i, text in self._ledger.delivered.items())

    def filter(self, event: bytes) -> bytes | None:
        """The bytes to send the client for ``event`` (None: nothing new in it)."""
        payload = event_payload(event)
        if payload is None:
            # [DONE] and the like: only meaningful once the replay has caught up.
            return event if self.caught_up() else None
        was_caught_up = self.caught_up()
        new_pieces = {}
        for index, text in _pieces(payload).items():
            before = self._replayed.get(index, "")
            self._replayed[index] = before + text
            sent = self._ledger.delivered.get(index, "")
            overlap = sent[len(before): len(before) + len(text)]
            if text[: len(overlap)] != overlap:
                raise ReplayMismatchError(
                    "the model answered differently when asked again after a node was lost"
                )
            if len(text) > len(overlap):
                new_pieces[index] = text[len(overlap):]
        if not was_caught_up and not new_pieces:
            return None  # all of it (text, role header) was delivered before
        rewritten = self._rewrite(payload, new_pieces)
        self._ledger.record(rewritten)
        return rewritten

    def _rewrite(self, payload: dict[str, Any], new_pieces: dict[int, str]) -> bytes:
        payload = {**payload, **self._ledger.identity}
        for choice in payload.get("choices", []):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            delta = choice.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                delta["content"] = new_pieces.get(index, "")
            elif isinstance(choice.get("text"), str):
                choice["text"] = new_pieces.get(index, "")
        return DATA_PREFIX + json.dumps(payload).encode() + EVENT_SEPARATOR
