"""How long a peer kept the serving node waiting for its rpc-server's replies.

Pure: a tunnel reports the times bytes went to the peer and came back. RPC is strict
request/response, so from the first byte sent after the last reply until the next byte
received, the peer owes an answer (its compute, its link, or a stall). Commands with no
reply (SET_TENSOR, GRAPH_COMPUTE) are always followed, within the token, by one that has
one (GET_TENSOR), so a worker in use answers once per token at least. With the output check
on, the tunnel reports only bytes that leave a reply owed: under --b2b a worker that pushes
its output on (no reply) owes nothing, so it is never blamed for another's slowness, and a
stall of its own is caught by the serving node's stall timer instead.

``owed_s(since, now)`` sums those waits over a window: when tokens stop coming, the worker
that owed for most of the window is the one holding them (serve/pace.py judges the tokens).
"""

from __future__ import annotations

from collections import deque

# Waits older than this are forgotten. A stall is judged over seconds (serve/pace.py: 3 s, or 10
# token times), and a busy tunnel records a few waits per token, so the history stays a few
# thousand entries; a model slower than 6 s a token is judged over less than its window (nobody
# is then blamed, never the wrong worker).
REPLY_WAIT_HISTORY_S = 60.0


class ReplyWaits:
    """The intervals during which a peer owed a reply."""

    def __init__(self) -> None:
        self._done: deque[tuple[float, float]] = deque()  # (began, ended), oldest first
        self._owing_since: float | None = None

    def sent(self, now: float) -> None:
        if self._owing_since is None:
            self._owing_since = now

    def received(self, now: float) -> None:
        if self._owing_since is not None:
            self._done.append((self._owing_since, now))
            self._owing_since = None
        self._forget_before(now - REPLY_WAIT_HISTORY_S)

    def owed(self, began: float, ended: float) -> None:
        """A wait measured elsewhere (the native relay reports each connection's every 100 ms)."""
        self._done.append((began, ended))
        self._forget_before(ended - REPLY_WAIT_HISTORY_S)

    def _forget_before(self, when: float) -> None:
        while self._done and self._done[0][1] < when:
            self._done.popleft()

    def owed_s(self, since: float, now: float) -> float:
        """Seconds within ``[since, now]`` this peer owed a reply (a reply still owed counts up to now)."""
        intervals = list(self._done)
        if self._owing_since is not None:
            intervals.append((self._owing_since, now))
        return sum(max(0.0, min(end, now) - max(began, since)) for began, end in intervals)
