"""Polling with a deadline, for tests and benchmarks that watch real processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.2) -> T:
    """The first truthy value of ``condition()``; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(poll_s)
    raise TimeoutError(f"not within {timeout_s:.0f} s: {what}")


async def wait_until_async(condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.05) -> T:
    """``wait_until`` inside an event loop: polls without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := condition():
            return result
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"not within {timeout_s:.0f} s: {what}")
