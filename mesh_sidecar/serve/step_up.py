"""When a serving node steps up to a bigger model tier: hysteresis, so a member that comes and goes
does not move the model back and forth (tiers.py chooses the tier; this says when it may switch).

Light on purpose: the CLI's help shows these defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

STEP_UP_AFTER_S = 20.0
STEP_UP_INTERVAL_S = 60.0


@dataclass(frozen=True)
class StepUpRules:
    """Hysteresis for switching to a bigger tier (``--step-up-after``, ``--step-up-interval``)."""

    after_s: float = STEP_UP_AFTER_S  # a bigger tier must have fitted this long without a break
    interval_s: float = STEP_UP_INTERVAL_S  # and the last switch be this long ago


@dataclass(frozen=True)
class StepUpGate:
    """When a bigger tier that fits now may replace the one in service: a value over times, each change a new one.

    The serving loop keeps the latest; ``ready_at`` asks without changing anything.
    """

    rules: StepUpRules = StepUpRules()
    fits_since: float | None = None  # a bigger tier has fitted since then without a break
    last_switch: float | None = None

    def ready_at(self, now: float) -> float:
        """When a bigger tier that fits at ``now`` (and since ``fits_since``) may be switched to."""
        ready_at = (now if self.fits_since is None else self.fits_since) + self.rules.after_s
        if self.last_switch is not None:
            ready_at = max(ready_at, self.last_switch + self.rules.interval_s)
        return ready_at

    def bigger_fits(self, now: float) -> StepUpGate:
        """A bigger tier fits at ``now``: its wait starts unless it runs already."""
        return self if self.fits_since is not None else dataclasses.replace(self, fits_since=now)

    def bigger_gone(self) -> StepUpGate:
        """No bigger tier fits (a member left): the wait starts again next time."""
        return dataclasses.replace(self, fits_since=None)

    def switched(self, now: float) -> StepUpGate:
        """A switch happened, either way."""
        return dataclasses.replace(self, fits_since=None, last_switch=now)
