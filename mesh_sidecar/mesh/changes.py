"""Change notification any number of waiters can watch: a version count, and a wait for the next.

A waiter reads ``version``, looks at what it cares about, and awaits
``wait_after(version)``: a change made in between is not missed (the version is
already past), and no waiter clears anything another one is waiting on.
"""

from __future__ import annotations

import asyncio


class Changes:
    """Counts changes; ``wait_after(version)`` returns once there has been one after ``version``."""

    def __init__(self) -> None:
        self.version = 0
        self._next = asyncio.Event()  # set, and replaced, on each change

    def notify(self) -> None:
        """Something changed: wake every waiter."""
        self.version += 1
        self._next.set()
        self._next = asyncio.Event()

    async def wait_after(self, version: int) -> int:
        """Wait until ``version`` is past; the version then."""
        while self.version <= version:
            await self._next.wait()
        return self.version
