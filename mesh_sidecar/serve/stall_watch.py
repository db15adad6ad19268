"""Watching this node's llama-server streams for stalls: the asyncio edge of pace.py.

A stream that falls far behind a token's expected time fails over once a worker is found holding
it up (the serving loop replans without it); one with no byte for the stall timeout restarts
llama-server (a member stopped answering without being lost yet). Either way the proxy's read
ends with an httpx.ReadTimeout, which its recovery treats like a dead llama-server. pace.py
judges (pure); this module reads the chunks with a deadline and counts the prompts in progress,
whose processing explains other streams' pauses.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx

from .pace import Slow, StreamPace, TokenPace

# Most stalls are judged sooner, against a token's expected time (pace.py); this covers prompts and
# a node's first request.
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

    async def chunks(self, chunks: AsyncIterator[bytes], path: str, *, links_rtt_s: Callable[[], float],
                     on_slow: Callable[[Slow], bool], on_stall: Callable[[str], None]) -> AsyncIterator[bytes]:
        """The chunks, until the stream falls far behind a token's expected time and ``on_slow`` finds a
        worker holding it up, or until nothing comes for the stall timeout (``on_stall``). Either way
        httpx.ReadTimeout: the request fails over."""
        began = judge_at = time.monotonic()
        pace = StreamPace()
        pending: asyncio.Future[bytes] | None = None
        self._prompts_waiting += 1
        waiting = True  # for this stream's first byte: its prompt is being processed
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(chunks))
                done, _ = await asyncio.wait((pending,), timeout=PACE_CHECK_S)
                now = time.monotonic()
                if done:
                    try:
                        chunk = pending.result()
                    except StopAsyncIteration:
                        return
                    pending = None
                    if waiting:
                        waiting = False
                        self._prompts_waiting -= 1
                    pace.arrived(now)
                    yield chunk
                    if now < judge_at:  # judged at most every PACE_CHECK_S: tokens come far faster
                        continue
                judge_at = now + PACE_CHECK_S
                expected_s = self.token_pace.expected_s(links_rtt_s())
                if (slow := pace.judge(now, expected_s, self._prompts_waiting > 0)) is not None:
                    if on_slow(slow):
                        raise httpx.ReadTimeout(f"a worker held the stream up ({slow.describe()})")
                    pace.excuse(now)
                elif now - pace.last_progress(began) >= self._stall_timeout_s:
                    on_stall(f"No progress on a {path} stream for {self._stall_timeout_s:.0f} s")
                    raise httpx.ReadTimeout("llama-server stalled")
        finally:
            if waiting:
                self._prompts_waiting -= 1
            if pending is not None:
                pending.cancel()
                await asyncio.wait((pending,))  # the stream is closed next: its read must have ended
