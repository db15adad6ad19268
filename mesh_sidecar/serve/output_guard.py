"""Whether a worker's layer output is corrupt: NaN or Inf, or a norm far outside its own recent range.

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
by far more. A member who returns plausible finite values is not caught (docs/security.md).
"""

from __future__ import annotations

from collections import deque

from ..wire.rpc_outputs import NON_FINITE, NORM_OUTLIER, Fault, TensorMeasured

HISTORY_SAMPLES = 64  # healthy RMS values kept per worker and tensor name
MIN_HISTORY_SAMPLES = 8  # norms are judged only with at least this many
NORM_RATIO = 64.0  # an RMS this far outside the recent range (either way) is a fault


class OutputGuard:
    """The serving node's judge of its workers' layer outputs."""

    def __init__(self) -> None:
        self._history: dict[tuple[bytes, str], deque[float]] = {}

    def judge(self, worker: bytes, tensor: TensorMeasured) -> Fault | None:
        """A fault in ``tensor`` returned by ``worker``, or None (then it joins the worker's history)."""
        if not tensor.finite:
            return Fault(NON_FINITE, f"NaN or Inf among the {tensor.values} values of {tensor.name}")
        rms = tensor.rms
        assert rms is not None  # finite values have one
        history = self._history.setdefault((worker, tensor.name), deque(maxlen=HISTORY_SAMPLES))
        if len(history) >= MIN_HISTORY_SAMPLES:
            low, high = min(history), max(history)
            if rms > high * NORM_RATIO or rms < low / NORM_RATIO:
                return Fault(NORM_OUTLIER, f"{tensor.name} has RMS {rms:.3g}, over {NORM_RATIO:g}x outside "
                                           f"its last {len(history)} ({low:.3g} to {high:.3g})")
        history.append(rms)
        return None
