"""Whether a stream's tokens come far slower than a token takes: a worker holding them up.

Pure, on times the proxy passes in (``time.monotonic()``). :class:`TokenPace` keeps the
expected time of one token, from the decode speed llama-server reported for recent
requests (before the first: the plan's expected token time, PLANNED_SLACK times over), and
never less than the plan's links' round trips (every token crosses each worker once).
:class:`StreamPace` judges one stream from llama-server against it: over a window of at
least STALL_FLOOR_S, and at least SLOW_FACTOR tokens' time, fewer than one token per
SLOW_FACTOR expected token times is slow. That catches both a worker that stops
answering (no token at all) and one that answers every RPC late (a token a second where
one takes 50 ms), within a few seconds instead of the 60 s stall timer.

Prompt processing, of this request or of another one batched with it, holds tokens back
for as long as the prompt is long, so nothing is judged before a stream's first byte nor
while any request waits for its own: stall_watch.STALL_TIMEOUT_S covers those.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

STALL_FLOOR_S = 3.0  # the shortest window a stream is judged over
SLOW_FACTOR = 10.0  # tokens this many times slower than expected are slow
# A slow stream is blamed on the worker that owed replies (net/reply_waits.py) for at least this share
# of the window; when none did (the serving node's own layers, a busy llama-server), nobody is.
SLOW_BLAME_SHARE = 0.5
EXPECTED_WEIGHT = 0.3  # of the newest request, in the moving average of a token's time
# Until a request has finished, a token is expected to take the plan's expected time this many times over:
# that is a calibration's guess (10-35% off, docs/performance.md) on a machine that may be busier now. A
# link that turns bad before the first answer would otherwise hold that answer up unjudged (a token every
# few seconds is no stall).
PLANNED_SLACK = 4.0
# Arrival times kept per stream: more than any window can ask for (a window's threshold is
# STALL_FLOOR_S / (SLOW_FACTOR x a token's time), 300 at 1 ms a token).
MAX_ARRIVALS_KEPT = 1024


@dataclass(frozen=True)
class Slow:
    """A stream judged slow: ``tokens`` arrived over the last ``window_s``, where one takes ``expected_s``."""

    since: float  # when the window began (monotonic)
    window_s: float
    tokens: int
    expected_s: float

    def describe(self) -> str:
        return (f"{self.tokens} token(s) in {self.window_s:.1f} s where one takes about "
                f"{self.expected_s * 1000:.0f} ms")


class TokenPace:
    """The expected time of one token, shared by every stream of one proxy."""

    def __init__(self) -> None:
        self._token_s: float | None = None

    def finished(self, tokens_per_second: float) -> None:
        """A request ended and llama-server reported its decode speed."""
        token_s = 1.0 / tokens_per_second
        self._token_s = token_s if self._token_s is None else (
            EXPECTED_WEIGHT * token_s + (1 - EXPECTED_WEIGHT) * self._token_s)

    def expected_s(self, links_rtt_s: float, planned_token_s: float | None = None) -> float | None:
        """One token's expected time; None before any request has finished when the plan's expected token
        time (``planned_token_s``) is unknown too (nothing to judge by)."""
        if self._token_s is not None:
            return max(self._token_s, links_rtt_s)
        if planned_token_s is not None and planned_token_s > 0:
            return max(planned_token_s * PLANNED_SLACK, links_rtt_s)
        return None


class StreamPace:
    """One stream's progress, judged against the expected token time."""

    def __init__(self) -> None:
        self._arrivals: deque[float] = deque(maxlen=MAX_ARRIVALS_KEPT)
        self._first: float | None = None
        self._last: float | None = None
        self._excused_at: float | None = None

    def arrived(self, now: float, events: int = 1) -> None:
        """A chunk of the stream came with ``events`` whole events (llama-server sends one per token; the
        proxy reads several at once when they come fast, see upstream_http.STREAM_FLUSH_INTERVAL_S)."""
        if self._first is None:
            self._first = now
        self._last = now
        self._arrivals.extend([now] * events)

    def last_progress(self, began: float) -> float:
        """When the stream last moved: its last chunk, or ``began`` before the first."""
        return began if self._last is None else self._last

    def judge(self, now: float, expected_s: float | None, prompts_waiting: bool) -> Slow | None:
        """A :class:`Slow` verdict, or None (too early, nothing to judge by, or keeping pace)."""
        if expected_s is None or self._first is None or prompts_waiting:
            return None
        window_s = max(STALL_FLOOR_S, SLOW_FACTOR * expected_s)
        start = self._first if self._excused_at is None else max(self._first, self._excused_at)
        if now - start < window_s:
            return None
        while self._arrivals and self._arrivals[0] <= now - window_s:
            self._arrivals.popleft()
        tokens = len(self._arrivals)
        if tokens * SLOW_FACTOR * expected_s >= window_s:
            return None
        return Slow(now - window_s, window_s, tokens, expected_s)

    def excuse(self, now: float) -> None:
        """A verdict found no worker to blame: judge only what comes after ``now``."""
        self._excused_at = now
