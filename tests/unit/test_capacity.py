"""Reading an rpc-server's device listing, sizes, and the capacity a node offers."""

from __future__ import annotations

import pytest

from mesh_sidecar.errors import UsageError
from mesh_sidecar.llama.capacity import MAX_HELD_ENTRIES, Capacity, Device, held_key, measure, parse_device_listing
from mesh_sidecar.units import GIB, MIB, format_gib, parse_size
from mesh_sidecar.wire.gossip import MemberInfo
from tests.helpers.meshes import PINNED_BUILD

LISTING = """Starting RPC server v7.0.0
  endpoint       : 127.0.0.1:50052
  local cache    : n/a
Devices:
  CPU: AMD EPYC (24105 MiB, 23000 MiB free)
  CUDA0: NVIDIA GeForce RTX 3060 (12036 MiB, 11800 MiB free)
  transport      : TCP
Accepted client connection
"""


def test_device_listing_is_parsed() -> None:
    devices = parse_device_listing(LISTING)
    assert devices == (
        Device("CPU", "AMD EPYC", 24105 * MIB, 23000 * MIB),
        Device("CUDA0", "NVIDIA GeForce RTX 3060", 12036 * MIB, 11800 * MIB),
    )
    assert devices[0].is_cpu and not devices[1].is_cpu


def test_listing_not_printed_yet() -> None:
    assert parse_device_listing("Starting RPC server v7.0.0\n") == ()


@pytest.mark.parametrize("text, expected", [
    ("1024", 1024), ("512M", 512 * MIB), ("2G", 2 * GIB), ("1.5GB", int(1.5 * GIB)),
    ("1.5GiB", int(1.5 * GIB)), ("100 MiB", 100 * MIB), ("3k", 3 * 1024), ("1T", 1024 * GIB),
])
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1G", "1.2.3M", "5X"])
def test_bad_sizes_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize("n_bytes, up, shown", [
    (GIB // 2, False, "0.50"), (int(1.26 * GIB), False, "1.3"), (int(1.21 * GIB), True, "1.3"),
    (GIB // 100 + 1, True, "0.02"), (3 * GIB, True, "3.0"),
])
def test_gib_for_people(n_bytes: int, up: bool, shown: str) -> None:
    """Two decimals under 1 GiB, one above; ``up`` never shows less than is needed."""
    assert format_gib(n_bytes, up=up) == shown
    assert parse_size(shown + "G") >= n_bytes or not up


def test_cap_limits_what_is_offered() -> None:
    cpu = (Device("CPU", "cpu", 64 * 1024 * MIB, 32 * 1024 * MIB),)
    capped = measure(cpu, (), 300 * MIB)
    assert capped.usable_bytes == 300 * MIB and capped.max_memory_bytes == 300 * MIB
    uncapped = measure(cpu, (), None)
    assert uncapped.usable_bytes == uncapped.device_free_bytes > 300 * MIB


def test_gpu_memory_counts_from_the_listing() -> None:
    gpu_only = (Device("CUDA0", "gpu", 12 * 1024 * MIB, 11 * 1024 * MIB),)
    assert measure(gpu_only, (), None).usable_bytes == 11 * 1024 * MIB


def test_gossip_round_trip() -> None:
    capacity = Capacity(5, 6, 7, 8)
    assert Capacity.from_gossip(dict(capacity.to_gossip())) == capacity
    assert Capacity.from_gossip({}).usable_bytes == 0


def test_memory_held_for_other_serving_nodes_is_not_offered_again() -> None:
    a, b = b"\x0a" * 32, b"\x0b" * 32
    offer = Capacity(10 * GIB, 4 * GIB, 10 * GIB, 0, held=((held_key(a), 3 * GIB), (held_key(b), 2 * GIB)))
    back = Capacity.from_gossip(dict(MemberInfo(
        node_id=b"\x01" * 32, name="w", addresses=(), version="0", capacity=offer.to_gossip(),
        serving=False, rpc_ready=True, llama_build=PINNED_BUILD).capacity))
    assert back == offer
    assert back.usable_for(a) == 8 * GIB  # a may reuse what w holds for a, not what it holds for b
    assert back.usable_for(b) == 7 * GIB
    assert back.usable_for(b"\x0c" * 32) == 5 * GIB
    crowded = Capacity(GIB, 0, 0, 0, held=tuple((held_key(bytes([i]) * 32), 1) for i in range(9)))
    assert len(crowded.to_gossip()) == 4 + MAX_HELD_ENTRIES  # gossip's limit of 8 entries holds
