"""Sizes for people: binary units, shown in GiB, parsed with K/M/G/T meaning KiB/MiB/GiB/TiB.

One meaning everywhere: the plan table, the planner's errors, ``status`` and the
dashboard show GiB, and ``--max-memory`` reads "2G", "2GB" and "2GiB" all as
2 GiB, so a number from our messages can be typed back into that option as it is. A member's devices
in one line (`status`, the dashboard) are sizes for people too, and light to import.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from .errors import UsageError

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB
# Amounts under 1 GiB get two decimals so small models do not all read "0.1".
PRECISE_BELOW_GIB = 1.0

_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_UNIT_BYTES = {"": 1, "K": KIB, "M": MIB, "G": GIB, "T": TIB}


def format_gib(n_bytes: int, *, up: bool = False) -> str:
    """``n_bytes`` in GiB, without the unit; ``up`` rounds up, for amounts that must be enough."""
    gib = n_bytes / GIB
    digits = 2 if gib < PRECISE_BELOW_GIB else 1
    if up:
        scale = 10**digits
        gib = math.ceil(n_bytes * scale / GIB) / scale
    return f"{gib:.{digits}f}"


def parse_size(text: str) -> int:
    """Bytes, or a number with K/M/G/T (binary units; a trailing B or iB is optional)."""
    match = _SIZE.match(text)
    if match is None:
        raise UsageError(f"{text!r} is not a size. Use e.g. 512M, 2G or 1.5GiB (binary units: G means GiB).")
    return int(float(match["number"]) * _UNIT_BYTES[match["unit"].upper()])


def devices_line(devices: Sequence[dict[str, Any]]) -> str:
    """Devices (as mesh/status.py's ``devices_json`` gives them) for people: ``Vulkan0 2.0 of 2.0 GiB free,
    21.0 GiB/s, CPU ...`` (the speed: weight bytes a token passes through per second, when measured)."""
    return ", ".join(f"{d['name']} {format_gib(d['free_bytes'])} of {format_gib(d['total_bytes'])} GiB free"
                     + (f", {d['decode_bytes_per_s'] / GIB:.1f} GiB/s" if d.get("decode_bytes_per_s") else "")
                     for d in devices)
