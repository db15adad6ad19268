"""A serving node's verdicts on its workers: corrupt layer outputs, or too slow.

Pure. Both are announced in the serving node's gossip (``corrupt_outputs``, ``slow_workers``)
with the member's run id, so the member hears why (exclusion.py) and a restart (a new run id)
clears them. Corrupt output (the output rule's verdict, docs/architecture.md, "The output check")
stays until then: hardware that returned garbage once is not trusted again in that run. Slowness
is often passing (another program took the GPU), so a slow verdict also ends after SLOW_EXCLUSION_S
and the member is tried again.

At most MAX_JUDGED_MEMBERS verdicts are kept, the newest, whatever their kind (gossip's limit).
"""

from __future__ import annotations

from ..wire.gossip import MAX_JUDGED_MEMBERS, CorruptOutput, MemberInfo, SlowWorker
from .exclusion import CORRUPT_OUTPUT, SLOW, SLOW_EXCLUSION_S


class Verdicts:
    """The members a serving node leaves out for what it saw them do."""

    def __init__(self) -> None:
        # Oldest first; a slow verdict carries the loop time it ends at.
        self._found: list[tuple[CorruptOutput | SlowWorker, float | None]] = []

    @property
    def corrupt(self) -> tuple[CorruptOutput, ...]:
        return tuple(v for v, _ in self._found if isinstance(v, CorruptOutput))

    @property
    def slow(self) -> tuple[SlowWorker, ...]:
        return tuple(v for v, _ in self._found if isinstance(v, SlowWorker))

    def corrupt_found(self, verdict: CorruptOutput) -> None:
        self._add(verdict, None)

    def slow_found(self, verdict: SlowWorker, now: float) -> None:
        self._add(verdict, now + SLOW_EXCLUSION_S)

    def _add(self, verdict: CorruptOutput | SlowWorker, ends_at: float | None) -> None:
        kept = [(v, end) for v, end in self._found if v.node_id != verdict.node_id]
        self._found = [*kept, (verdict, ends_at)][-MAX_JUDGED_MEMBERS:]

    def forgive_restarted(self, info: MemberInfo) -> str | None:
        """Drop the verdict on ``info`` if it restarted since; the verdict's reason, or None."""
        for verdict, _ in self._found:
            if verdict.node_id == info.node_id and verdict.run_id != info.run_id:
                self._found = [(v, end) for v, end in self._found if v.node_id != info.node_id]
                return CORRUPT_OUTPUT if isinstance(verdict, CorruptOutput) else SLOW
        return None

    def expire(self, now: float) -> list[bytes]:
        """Drop the slow verdicts that ended by ``now``; the members they named."""
        ended = [v.node_id for v, end in self._found if end is not None and end <= now]
        self._found = [(v, end) for v, end in self._found if end is None or end > now]
        return ended

