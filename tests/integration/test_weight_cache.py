"""The weight-cache helper (compiled on first use, run as a process) and seeding; zero-byte loads with real
processes are in test_zero_byte_load."""

from __future__ import annotations

import json

import pytest

from mesh_sidecar.llama import weight_cache
from mesh_sidecar.llama.weight_cache import WeightCache, hashed_tensor_ranges


def no_progress(message: str, done: int, total: int) -> None:
    pass


@pytest.fixture(scope="module")
def tool():
    return weight_cache.ensure_tool(no_progress)


def fnv1a_64(data: bytes) -> int:
    """The reference, byte by byte (only for small inputs)."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def test_seed_names_files_by_llama_cpp_fnv1a_and_verify_catches_torn_ones(tool, tmp_path):
    model = tmp_path / "blob.bin"
    payload = bytes(range(256)) * 700 + b"tail"
    model.write_bytes(b"HEAD" + payload + b"more")
    cache = WeightCache(tmp_path / "cache")
    cache.create()
    (line,) = weight_cache._run_tool(tool, "seed", str(model), str(cache.tensors), f"4:{len(payload)}")
    name, size = line.split()
    assert int(name, 16) == fnv1a_64(payload) and int(size) == len(payload)
    assert (cache.tensors / name).read_bytes() == payload
    assert fnv1a_64(b"a") == 0xAF63DC4C8601EC8C  # the published FNV-1a 64 test vector
    assert not list(cache.tensors.glob(".seeding*"))
    # A file cut short by a crash, and one altered, are removed; a good one stays.
    good = cache.tensors / name
    torn = cache.tensors / f"{fnv1a_64(b'x' * 1000):016x}"
    torn.write_bytes(b"x" * 600)
    altered = cache.tensors / f"{fnv1a_64(b'abc'):016x}"
    altered.write_bytes(b"abd")
    assert weight_cache.verify(cache, tool, no_progress) == 2
    assert good.exists() and not torn.exists() and not altered.exists()
    verified = json.loads((cache.root / weight_cache.VERIFIED_FILE).read_text())
    assert list(verified) == [name]
    # Known-good files are not re-read.
    assert weight_cache.verify(cache, tool, no_progress) == 0


def test_seed_once_per_model(tool, model_path, tmp_path):
    cache = WeightCache(tmp_path / "cache")
    sha = "ab" * 32
    written = weight_cache.seed(cache, tool, model_path, sha, no_progress)
    assert written == sum(size for _, _, size in hashed_tensor_ranges(model_path))
    assert len(cache.tensor_files()) == 1
    assert weight_cache.seed(cache, tool, model_path, sha, no_progress) == 0
    assert weight_cache.verify(cache, tool, no_progress) == 0  # seeded files count as checked
