"""Which tensors the weight cache hashes, and what ``verify`` lets stay in it (the helper that seeds it:
tests/integration/test_weight_cache.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from mesh_sidecar.llama import weight_cache
from mesh_sidecar.llama.weight_cache import HASH_THRESHOLD_BYTES, WeightCache, _Ledger, _Seeded, hashed_tensor_ranges


def no_progress(message: str, done: int, total: int) -> None:
    pass


def test_hashed_tensors_of_the_default_model(model_path):
    ranges = hashed_tensor_ranges(model_path)
    # SmolLM2-135M: only the token embeddings (49152 x 576, Q4_1) pass llama.cpp's 10 MiB threshold.
    ((file, offset, size),) = ranges
    assert file == model_path.resolve() and size > HASH_THRESHOLD_BYTES
    with open(model_path, "rb") as f:
        f.seek(offset)
        assert len(f.read(size)) == size


def seeded(cache: WeightCache, name: str, data: bytes) -> Path:
    """A file as seeding leaves it: in the cache, with its SHA-256 in the ledger."""
    path = cache.tensors / name
    path.write_bytes(data)
    ledger = _Ledger.read(cache)
    ledger.tensors[name] = _Seeded(len(data), hashlib.sha256(data).hexdigest(), path.stat().st_mtime_ns)
    ledger.write(cache)
    return path


def touch_later(path: Path) -> None:
    """A new mtime, as a write leaves (a coarse clock could leave the old one)."""
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))


def test_verify_removes_what_seeding_did_not_write_as_it_is(tmp_path, monkeypatch):
    cache = WeightCache(tmp_path)
    cache.create()
    good = seeded(cache, "00000000000000aa", b"weights" * 100)
    # Same name and size as seeded, other bytes (what a member could plant, FNV-1a being no proof of content).
    replaced = seeded(cache, "00000000000000bb", b"weights" * 100)
    replaced.write_bytes(b"poisons" * 100)
    touch_later(replaced)
    unrecorded = cache.tensors / "00000000000000cc"
    unrecorded.write_bytes(b"saved by a server from the network")
    assert weight_cache.verify(cache, no_progress) == 2
    assert good.exists() and not replaced.exists() and not unrecorded.exists()
    assert set(_Ledger.read(cache).tensors) == {good.name, replaced.name}  # the name is still that tensor's
    # A file as it was when last checked is not read again.
    monkeypatch.setattr(weight_cache, "file_sha256", lambda path: pytest.fail(f"{path} hashed again"))
    assert weight_cache.verify(cache, no_progress) == 0 and good.exists()


def test_verify_keeps_a_touched_file_whose_bytes_are_still_seedings(tmp_path):
    cache = WeightCache(tmp_path)
    cache.create()
    path = seeded(cache, "00000000000000aa", b"weights")
    touch_later(path)
    assert weight_cache.verify(cache, no_progress) == 0
    assert _Ledger.read(cache).tensors[path.name].mtime_ns == path.stat().st_mtime_ns


def test_a_ledger_from_before_sha256_records_nothing(tmp_path):
    cache = WeightCache(tmp_path)
    cache.create()
    old = cache.tensors / "00000000000000aa"
    old.write_bytes(b"weights")
    (cache.root / weight_cache.VERIFIED_FILE).write_text(json.dumps({old.name: [7, old.stat().st_mtime_ns]}))
    assert weight_cache.verify(cache, no_progress) == 1 and not old.exists()


NAME = "00000000000000aa"


def admit(cache: WeightCache, data: bytes) -> None:
    """What seeding does with a tensor the tool wrote under NAME."""
    staged = cache.root / "staging" / NAME
    staged.parent.mkdir(exist_ok=True)
    staged.write_bytes(data)
    ledger = _Ledger.read(cache)
    weight_cache._admit(cache, ledger, staged, hashlib.sha256(data).hexdigest())
    ledger.write(cache)
    assert not staged.exists()


def test_a_name_two_tensors_claim_is_served_for_neither(tmp_path):
    cache = WeightCache(tmp_path)
    cache.create()
    admit(cache, b"model A's tensor")
    assert (cache.tensors / NAME).read_bytes() == b"model A's tensor"
    admit(cache, b"model A's tensor")  # the same bytes again: no conflict
    assert (cache.tensors / NAME).exists()
    admit(cache, b"model B's, same FNV-1a")
    assert not (cache.tensors / NAME).exists()
    admit(cache, b"model A's tensor")  # for good: seeding A again does not bring it back
    assert not (cache.tensors / NAME).exists()
    ledger = _Ledger.read(cache)
    assert ledger.contested == {NAME} and NAME not in ledger.tensors and ledger.settled(cache, NAME)


def test_a_removed_files_name_stays_its_tensors(tmp_path):
    cache = WeightCache(tmp_path)
    cache.create()
    admit(cache, b"model A's tensor")
    altered = cache.tensors / NAME
    altered.write_bytes(b"model A's tensoR")  # altered: verify removes it
    touch_later(altered)
    assert weight_cache.verify(cache, no_progress) == 1
    admit(cache, b"model B's, same FNV-1a")  # so B's cannot take the free name for A's loads
    assert not (cache.tensors / NAME).exists() and NAME in _Ledger.read(cache).contested
