"""How long the mesh waits and how often it looks, as one frozen value: production's by default.

Each constant stays with the module that uses it; ``MeshTimings`` gathers them so that a
``Mesh`` is given all of them at once (tests give shorter ones).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..net.transport import DIAL_TIMEOUT_S
from .dialer import JOIN_PATIENCE_S, JOIN_RETRY_S
from .health import DEGRADED_AFTER_S, HEARTBEAT_INTERVAL_S, LOST_AFTER_S
from .peers import RETIRE_IDLE_S, RETIRE_POLL_S


@dataclass(frozen=True)
class MeshTimings:
    """The mesh's timings (the constants' meanings are in docs/architecture.md, Timeouts)."""

    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    degraded_after_s: float = DEGRADED_AFTER_S
    lost_after_s: float = LOST_AFTER_S
    dial_timeout_s: float = DIAL_TIMEOUT_S
    join_retry_s: float = JOIN_RETRY_S
    join_patience_s: float = JOIN_PATIENCE_S
    retire_idle_s: float = RETIRE_IDLE_S
    retire_poll_s: float = RETIRE_POLL_S
