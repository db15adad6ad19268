"""Watching this node's llama-server streams for stalls: the asyncio edge of pace.py.

A stream that falls far behind a token's expected time fails over once a worker is found holding
it up (the serving loop replans without it); one with no byte for the stall timeout restarts
llama-server (a member stopped answering without being lost yet). Either way the proxy's read
ends with an UpstreamCutError, which its recovery treats like a dead llama-server. pace.py
judges (pure); this module judges each stream on a timer and counts the prompts in progress,
whose processing explains other streams' pauses.

The judge runs on a timer, every PACE_CHECK_S, not per chunk: a token costs the relay one
``arrived()`` (a clock read), where a read raced against a timeout would cost a task and a timer
per token, CPU that a serving node takes from llama-server's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator

from ..errors import UpstreamCutError
from .pace import Slow, StreamPace, TokenPace

# Most stalls are judged sooner, against a token's expected time (pace.py); this covers prompts and
# a node's first request when its plan's speeds are unknown.
STALL_TIMEOUT_S = 60.0
PACE_CHECK_S = 0.5  # how often a stream with no new byte is judged against its pace (pace.py)


class StallWatch:
    """The streams of one llama-server: their expected token time (``token_pace``) and the prompts in
    progress."""

    def __init__(self, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.token_pace = TokenPace()
        self._stall_timeout_s = stall_timeout_s
        self._prompts_waiting = 0  # upstream requests that have not yet sent their first byte

    @contextlib.contextmanager
    def prompt(self) -> Iterator[None]:
        """A request whose prompt and tokens pass unseen (read whole): while it runs, other streams'
        pauses may be its prompt."""
        self._prompts_waiting += 1
        try:
            yield
        finally:
            self._prompts_waiting -= 1

    @contextlib.asynccontextmanager
    async def watch(self, path: str, *, links_rtt_s: Callable[[], float],
                    planned_token_s: Callable[[], float | None], on_slow: Callable[[Slow], bool],
                    on_stall: Callable[[str], None]) -> AsyncIterator[WatchedStream]:
        """Watch one stream while the block reads it (calling ``arrived()`` for each chunk). When it falls
        far behind a token's expected time and ``on_slow`` finds a worker holding it up, or nothing comes
        for the stall timeout (``on_stall``), the block is cancelled: UpstreamCutError, the request fails
        over."""
        stream = WatchedStream(self, path, links_rtt_s, planned_token_s, on_slow, on_stall)
        self._prompts_waiting += 1
        try:
            async with asyncio.timeout(None) as deadline:
                stream.start(deadline)
                try:
                    yield stream
                finally:
                    stream.stop()
        except TimeoutError as exc:
            if stream.failed is None:
                raise  # not ours: a timeout of the block's own
            raise UpstreamCutError(stream.failed) from exc
        finally:
            if stream.waiting:
                self._prompts_waiting -= 1

    def _first_byte(self) -> None:
        self._prompts_waiting -= 1


class WatchedStream:
    """One stream under watch: its pace (pace.py), judged every PACE_CHECK_S by a timer."""

    def __init__(self, watch: StallWatch, path: str, links_rtt_s: Callable[[], float],
                 planned_token_s: Callable[[], float | None], on_slow: Callable[[Slow], bool],
                 on_stall: Callable[[str], None]) -> None:
        self._watch = watch
        self._path = path
        self._links_rtt_s = links_rtt_s
        self._planned_token_s = planned_token_s
        self._on_slow = on_slow
        self._on_stall = on_stall
        self._pace = StreamPace()
        self._began = time.monotonic()
        self.waiting = True  # for this stream's first byte: its prompt is being processed
        self.failed: str | None = None  # why the watch cut the stream
        self._deadline: asyncio.Timeout | None = None
        self._timer: asyncio.TimerHandle | None = None

    def arrived(self, events: int) -> None:
        """A chunk came, with ``events`` whole events (tokens, give or take the first and the last)."""
        if self.waiting:
            self.waiting = False
            self._watch._first_byte()
        self._pace.arrived(time.monotonic(), events)

    def start(self, deadline: asyncio.Timeout) -> None:
        self._deadline = deadline
        self._timer = asyncio.get_running_loop().call_later(PACE_CHECK_S, self._judge)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _judge(self) -> None:
        now = time.monotonic()
        watch = self._watch
        expected_s = watch.token_pace.expected_s(self._links_rtt_s(), self._planned_token_s())
        if (slow := self._pace.judge(now, expected_s, watch._prompts_waiting > 0)) is not None:
            if self._on_slow(slow):
                return self._cut(f"a worker held the stream up ({slow.describe()})")
            self._pace.excuse(now)
        elif now - self._pace.last_progress(self._began) >= watch._stall_timeout_s:
            self._on_stall(f"No progress on a {self._path} stream for {watch._stall_timeout_s:.0f} s")
            return self._cut("llama-server stalled")
        self._timer = asyncio.get_running_loop().call_later(PACE_CHECK_S, self._judge)

    def _cut(self, why: str) -> None:
        assert self._deadline is not None
        self.failed = why
        self._deadline.reschedule(asyncio.get_running_loop().time())  # cancels the block reading the stream
