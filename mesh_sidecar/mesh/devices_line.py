"""A member's devices in one line for people, from their status JSON (status.py's ``devices_json``):
the CLI's `status` and the dashboard both show it.

Light on purpose: read-only commands import it, not the mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..units import GIB, format_gib


def devices_line(devices: Sequence[dict[str, Any]]) -> str:
    """Devices (as :func:`devices_json` gives them) for people: ``Vulkan0 2.0 of 2.0 GiB free, 21.0 GiB/s, CPU ...``
    (the speed: weight bytes a token passes through per second, when measured)."""
    return ", ".join(f"{d['name']} {format_gib(d['free_bytes'])} of {format_gib(d['total_bytes'])} GiB free"
                     + (f", {d['decode_bytes_per_s'] / GIB:.1f} GiB/s" if d.get("decode_bytes_per_s") else "")
                     for d in devices)
