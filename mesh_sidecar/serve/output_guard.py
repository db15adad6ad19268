"""Whether a worker's layer output is corrupt: NaN or Inf, values no real model produces, or a norm far
outside its own recent range.

Pure: the serving node's tunnels measure every float tensor a worker's rpc-server returns
(wire/rpc_outputs.py) and ask :meth:`OutputGuard.judge`; the serving loop acts on a fault
(supervisor.py: the worker is refused as corrupt_output, llama-server restarts without it).

Theory of operation: a healthy model's layer output has a root mean square that stays
within a narrow band per layer, token after token (it is the residual stream's scale).
Faulty memory or a faulty GPU returns NaN/Inf, zeros, or bit-flipped values whose scale is
off by orders of magnitude. So each (worker, tensor name) keeps the RMS of its last
HISTORY_SAMPLES healthy outputs, and once it has MIN_HISTORY_SAMPLES, an RMS more than
NORM_RATIO above the largest or below the smallest of them is a fault. The bound is wide on
purpose: a false alarm takes a healthy machine out of the mesh, while real garbage is off
by far more. The relative rule needs a history, so beside it absolute bounds (MAX_OUTPUT_RMS,
MAX_OUTPUT_ABS in wire/rpc_outputs.py) judge from the very first reply: a worker returning every
value scaled by 1e30 from the start would otherwise build its own history. A member who returns
plausible finite values is not caught (docs/security.md).

Whose history: one per worker and tensor name, kept across that worker's connections, so a worker
cannot start afresh by dropping its tunnel connection. Only :meth:`OutputGuard.new_session`
clears it, called when llama-server (our own process) starts again; nothing a worker does can.
"""

from __future__ import annotations

from collections import deque

from ..wire.rpc_outputs import (
    HISTORY_SAMPLES,
    MAX_OUTPUT_ABS,
    MAX_OUTPUT_RMS,
    MIN_HISTORY_SAMPLES,
    NORM_RATIO,
    Fault,
    TensorMeasured,
    absolute_outlier_fault,
    non_finite_fault,
    norm_outlier_fault,
)


class OutputGuard:
    """The serving node's judge of its workers' layer outputs."""

    def __init__(self) -> None:
        self._history: dict[tuple[bytes, str], deque[float]] = {}

    def judge(self, worker: bytes, tensor: TensorMeasured) -> Fault | None:
        """A fault in ``tensor`` returned by ``worker``, or None (then it joins the worker's history)."""
        if not tensor.finite:
            return non_finite_fault(tensor)
        rms = tensor.rms
        assert rms is not None  # finite values have one
        if rms > MAX_OUTPUT_RMS or (tensor.max_abs is not None and tensor.max_abs > MAX_OUTPUT_ABS):
            return absolute_outlier_fault(tensor)
        history = self._history.setdefault((worker, tensor.name), deque(maxlen=HISTORY_SAMPLES))
        if len(history) >= MIN_HISTORY_SAMPLES:
            low, high = min(history), max(history)
            if rms > high * NORM_RATIO or rms < low / NORM_RATIO:
                return norm_outlier_fault(tensor, low, high, len(history))
        history.append(rms)
        return None

    def new_session(self) -> None:
        """llama-server starts again: its warm-up's outputs are far from a running session's (a first
        token's), so the histories begin anew. The one thing that clears them (module docstring)."""
        self._history.clear()
