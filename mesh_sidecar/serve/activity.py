"""What a node did just now, for people: tokens streamed per second, and the lines it said lately.

Both are fed as things happen and read by ``status`` (and so the dashboard):
``TokenRate`` by the proxy, with every server-sent event it relays, and
``RecentEvents`` by the node, with every line it says to its user.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from ..wire.ticket import TICKET_PREFIX
from .sse import DATA_PREFIX, DONE

TOKEN_RATE_WINDOW_S = 2.0
# A rate over a shorter span than this is noise (one token just arrived).
TOKEN_RATE_MIN_SPAN_S = 0.5
RECENT_EVENTS_KEPT = 50
# Tickets admit machines to the mesh: the state endpoint is keyless unless --api-key is set, so
# events never carry one (`mesh-inference ticket` prints it through the token-guarded control endpoint).
_TICKET = re.compile(re.escape(TICKET_PREFIX) + r"[a-z2-7]+")
TICKET_PLACEHOLDER = "<ticket: see mesh-inference ticket>"


class TokenRate:
    """Tokens streamed per second just now (all streams together), and the last request's decode speed.

    llama-server sends one token per server-sent event, so streamed ``data:``
    events are counted over the last TOKEN_RATE_WINDOW_S and divided by the time
    they span (at least TOKEN_RATE_MIN_SPAN_S): a stream shows its speed within
    half a second, and the figure falls to 0 one window after the last token.
    Callers pass ``now`` from ``time.monotonic()``.
    """

    def __init__(self, window_s: float = TOKEN_RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._times: deque[float] = deque()
        self.last_request_tokens_per_second: float | None = None  # as llama-server timed it

    def streamed(self, event: bytes, now: float) -> None:
        """One server-sent event relayed to a client; counted if it is a data event other than [DONE]."""
        line = event.strip()
        if line.startswith(DATA_PREFIX) and line[len(DATA_PREFIX):] != DONE:
            self._times.append(now)
            self._forget(now)

    def finished(self, tokens_per_second: float) -> None:
        """A request ended and llama-server reported its decode speed."""
        self.last_request_tokens_per_second = tokens_per_second

    def per_second(self, now: float) -> float:
        self._forget(now)
        if not self._times:
            return 0.0
        return len(self._times) / max(now - self._times[0], TOKEN_RATE_MIN_SPAN_S)

    def to_json(self, now: float) -> dict[str, float | None]:
        return {"tokens_per_second_now": round(self.per_second(now), 1),
                "last_request_tokens_per_second": self.last_request_tokens_per_second}

    def _forget(self, now: float) -> None:
        while self._times and self._times[0] <= now - self._window_s:
            self._times.popleft()


class RecentEvents:
    """The last RECENT_EVENTS_KEPT lines a node said to its user, with their times, tickets left out."""

    def __init__(self, kept: int = RECENT_EVENTS_KEPT) -> None:
        self._events: deque[tuple[float, str]] = deque(maxlen=kept)

    def add(self, when: float, message: Any) -> None:
        """``message`` as given to the node's ``say``: a string, or a typed message (the plan) as its ``str``."""
        text = str(message)
        self._events.append((when, _TICKET.sub(TICKET_PLACEHOLDER, text)))

    def to_json(self) -> list[dict[str, Any]]:
        """Oldest first; ``time`` in seconds since the epoch."""
        return [{"time": round(when, 3), "message": text} for when, text in self._events]
