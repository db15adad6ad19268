"""Progress of slow steps as (stage, done, total) callbacks, and the plain reporter of them.

Slow steps (the llama.cpp build, the model fetch, the weight-cache seeding, a
fetch over the mesh) report through a ``ProgressCallback``: ``stage`` says what
is happening, ``done`` of ``total`` how far it got, and ``total`` is 0 while a
stage has no measurable length. Who listens decides the look: on a terminal the
CLI draws one live bar (cli/main.py); elsewhere (CI logs, ``docker build``,
``| tee``, a node's output) ``PlainProgress`` writes plain lines:

    Compiling llama.cpp
    Compiling llama.cpp: 10%
    ...
    Compiling llama.cpp: 100%

A stage's first report gives one line (the stage, with its percentage when it
has a length); after that at most one line per tenth of the way, and always
one when it ends (``done >= total``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .units import MIB

# (stage, done, total): total is 0 while a stage has no measurable length.
ProgressCallback = Callable[[str, int, int], None]

PLAIN_STEPS = 10  # lines per stage with a length: one per tenth


def ignore_progress(stage: str, done: int, total: int) -> None:
    """A ProgressCallback that shows nothing."""


class PlainProgress:
    """A ProgressCallback writing ``stage: 40%`` lines: at a stage's start, per tenth, and at its end.

    ``in_bytes``: the lengths are bytes, shown in MiB after the percentage.
    """

    def __init__(self, write: Callable[[Any], None], *, in_bytes: bool = False) -> None:
        self._write = write
        self._in_bytes = in_bytes
        self._stage: str | None = None
        self._step = -1  # the last tenth written for the current stage
        self._ended = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self._stage:
            self._stage, self._step, self._ended = stage, -1, False
            if total <= 0:
                self._write(stage)
                self._step = 0
                return
        if total <= 0 or self._ended:
            return
        done = min(max(done, 0), total)
        step = done * PLAIN_STEPS // total
        if step > self._step:
            self._step = step
            self._ended = done >= total
            self._write(self._line(stage, done, total))

    def _line(self, stage: str, done: int, total: int) -> str:
        line = f"{stage}: {done * 100 // total}%"
        if self._in_bytes:
            line += f" ({done / MIB:.0f} of {total / MIB:.0f} MiB)"
        return line
