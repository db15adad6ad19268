"""One failover's phases, as the serving node lives them: for /metrics and the log.

Pure: the supervisor passes its clock. A failover begins when the serving node learns that a member
of its plan is gone or that llama-server died under it; each phase runs until the next begins:

    detect   the first sign of the member's death to its loss (the mesh's figure: a probe confirming
             "port unreachable" or a reset, or a heartbeat's silence; 0 when llama-server's exit came first
             and the loss after it, which ``stop`` then counts)
    stop     llama-server stopped, and the loss of its member known (health.py confirms it a round trip
             or two after llama-server's exit)
    plan     the plan without the member
    load     llama-server started on it and loaded (weights from the workers' caches)
    resume   a stream's continuation: its request sent to the new llama-server to its first new token
             (the prompt and the delivered tokens processed again); observed by the proxy, per stream
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("detect", "stop", "plan", "load", "resume")


@dataclass
class FailoverTimeline:
    """The phases of one failover so far, in seconds."""

    began_s: float  # the clock when it began
    detect_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.phases_s["detect"] = self.detect_s
        self._mark_s = self.began_s

    def lap(self, phase: str, now_s: float) -> float:
        """``phase`` ended at ``now_s``: its length, from the end of the one before."""
        if phase not in PHASES:
            raise ValueError(f"unknown failover phase {phase!r}")
        self.phases_s[phase] = length = max(0.0, now_s - self._mark_s)
        self._mark_s = now_s
        return length

    def describe(self) -> str:
        """For the log: "detect 0.00 s, stop 0.21 s, plan 0.01 s, load 1.32 s (1.54 s in all)"."""
        parts = ", ".join(f"{phase} {self.phases_s[phase]:.2f} s" for phase in PHASES if phase in self.phases_s)
        return f"{parts} ({sum(self.phases_s.values()):.2f} s in all)"
