"""What a node can give the mesh: memory on its rpc-server's devices, capped by --max-memory.

ggml-rpc-server lists its devices when it starts (we read that from its log,
so we never open a probe connection: it serves one client at a time)::

    Devices:
      CPU: AMD EPYC (24105 MiB, 24105 MiB free)
      CUDA0: NVIDIA GeForce RTX 3060 (12036 MiB, 11800 MiB free)

GPU memory is what the listing said at start. CPU memory is read again at each
refresh: free RAM now, plus what our own rpc-server already holds (the model it
has loaded is freed and loaded anew when the plan changes, so it is ours to give).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

from ..units import MIB

CPU_DEVICE_PREFIX = "CPU"
DEVICES_HEADING = "Devices:"
AVAILABLE_DEVICES_HEADING = "available devices:"
_BACKEND_OF_FAMILY = {"MTL": "metal"}  # ggml's device name prefixes that are not their backend's name
_DEVICE_LINE = re.compile(r"^\s+(?P<name>[^:\s]+): (?P<desc>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$")

# Keys of MemberInfo.capacity in gossip.
USABLE_KEY = "usable_bytes"
FREE_RAM_KEY = "free_ram_bytes"
DEVICE_FREE_KEY = "device_free_bytes"
MAX_MEMORY_KEY = "max_memory_bytes"
# Memory an rpc-server holds for one serving node's llama-server: "held_" + the first hex digits of
# its id. Gossip carries at most 8 capacity entries, 4 of them the ones above.
HELD_KEY_PREFIX = "held_"
HELD_ID_HEX_CHARS = 16
MAX_HELD_ENTRIES = 4


def held_key(node_id: bytes) -> str:
    return HELD_KEY_PREFIX + node_id.hex()[:HELD_ID_HEX_CHARS]


@dataclass(frozen=True)
class Device:
    """One device an rpc-server offers, as its startup listing describes it."""

    name: str
    description: str
    total_bytes: int
    free_bytes: int

    @property
    def is_cpu(self) -> bool:
        return self.name.startswith(CPU_DEVICE_PREFIX)


def parse_device_listing(text: str, heading: str = DEVICES_HEADING) -> tuple[Device, ...]:
    """The devices in an rpc-server's startup output (empty if it has not printed them yet); ``heading``:
    the line above the list (rpc-server lists what it has under AVAILABLE_DEVICES_HEADING when a -d
    name is not one of them)."""
    devices: list[Device] = []
    in_listing = False
    for line in text.splitlines():
        if line.strip() == heading:
            in_listing, devices = True, []
            continue
        if in_listing:
            match = _DEVICE_LINE.match(line)
            if match is None:
                in_listing = False
                continue
            devices.append(Device(match["name"], match["desc"], int(match["total"]) * MIB,
                                  int(match["free"]) * MIB))
    return tuple(devices)


def backend_of(devices: Sequence[Device]) -> str:
    """The compute backend a device listing shows, for people: the first GPU's family (``Vulkan0``:
    vulkan, ``CUDA1``: cuda, ``MTL0``: metal), else cpu."""
    for device in devices:
        if not device.is_cpu:
            family = device.name.rstrip("0123456789")
            return _BACKEND_OF_FAMILY.get(family, family.lower())
    return "cpu"


@dataclass(frozen=True)
class Capacity:
    """A node's offer, as it travels in gossip."""

    usable_bytes: int  # what the planner may fill
    free_ram_bytes: int
    device_free_bytes: int
    max_memory_bytes: int = 0  # 0: no cap given
    # (held_key(serving node), bytes) its rpc-server holds for that node's llama-server. Those bytes
    # are inside usable_bytes (rpc-server's own memory counts as usable, so a replan can reuse it):
    # another serving node must not plan on them (``usable_for``).
    held: tuple[tuple[str, int], ...] = ()

    def to_gossip(self) -> tuple[tuple[str, int], ...]:
        return ((USABLE_KEY, self.usable_bytes), (FREE_RAM_KEY, self.free_ram_bytes),
                (DEVICE_FREE_KEY, self.device_free_bytes), (MAX_MEMORY_KEY, self.max_memory_bytes),
                *self.held[:MAX_HELD_ENTRIES])

    @classmethod
    def from_gossip(cls, pairs: Mapping[str, int]) -> Capacity:
        """From a member's announced pairs; a member that announced none offers nothing."""
        return cls(pairs.get(USABLE_KEY, 0), pairs.get(FREE_RAM_KEY, 0), pairs.get(DEVICE_FREE_KEY, 0),
                   pairs.get(MAX_MEMORY_KEY, 0),
                   tuple(sorted((k, v) for k, v in pairs.items() if k.startswith(HELD_KEY_PREFIX))))

    def usable_for(self, serving_node: bytes) -> int:
        """What ``serving_node`` may plan on: all but what is held for other serving nodes."""
        own = held_key(serving_node)
        return max(0, self.usable_bytes - sum(n for key, n in self.held if key != own))


def measure(devices: tuple[Device, ...], own_pids: Sequence[int], max_memory_bytes: int | None) -> Capacity:
    """This node's capacity now. ``own_pids``: our rpc-server, and llama-server when the model runs in it
    alone: what they hold is ours to give (a replan frees it), so holding a model does not shrink the offer."""
    free_ram = psutil.virtual_memory().available
    held = 0
    for pid in own_pids:
        try:
            held += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    device_free = sum(d.free_bytes for d in devices if not d.is_cpu)
    if any(d.is_cpu for d in devices) or not devices:
        device_free += free_ram + held
    usable = device_free if max_memory_bytes is None else min(device_free, max_memory_bytes)
    return Capacity(usable, free_ram, device_free, max_memory_bytes or 0)
