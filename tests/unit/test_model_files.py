"""A model's files: one GGUF, or every shard of a split one; the manifest a split model is known by."""

from __future__ import annotations

import hashlib
import json

import pytest

from mesh_sidecar.environment import CACHE_ENV
from mesh_sidecar.errors import ModelError
from mesh_sidecar.llama.model import (
    check_gguf,
    manifest_path,
    model_sha256,
    model_shards,
    offered_files,
    remember_sha256,
)
from mesh_sidecar.llama.model_files import (
    Shard,
    decode_manifest,
    encode_manifest,
    model_files,
    model_stem,
    read_model_header,
    shard_name,
)
from mesh_sidecar.serve.tiers import model_id
from tests.helpers.split_models import write_split_model

SHA = "ab" * 32


def no_progress(message: str, done: int, total: int) -> None:
    pass


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def test_shard_names_as_gguf_split_writes_them():
    shard = shard_name("/models/Qwen3-30B-A3B-Q4_K_M-00002-of-00003.gguf")
    assert shard is not None and (shard.prefix, shard.number, shard.count) == ("Qwen3-30B-A3B-Q4_K_M", 2, 3)
    assert shard.of(3) == "Qwen3-30B-A3B-Q4_K_M-00003-of-00003.gguf"
    for not_a_shard in ("model.gguf", "m-00004-of-00003.gguf", "m-00000-of-00003.gguf", "m-1-of-3.gguf",
                        "m-00001-of-00003.bin"):
        assert shard_name(not_a_shard) is None, not_a_shard
    assert model_stem("m-00001-of-00003.gguf") == "m" and model_stem("SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
    assert model_id("m-00001-of-00003.gguf") == "m"  # what clients send and /v1/models lists


def test_any_shard_means_the_whole_set_in_order(tmp_path):
    first = write_split_model(tmp_path, "tiny", [1, 1, 1])
    files = model_files(tmp_path / "tiny-00003-of-00003.gguf")
    assert [f.name for f in files] == [f"tiny-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    assert check_gguf(tmp_path / "tiny-00002-of-00003.gguf") == first.resolve()
    header = read_model_header(tmp_path / "tiny-00002-of-00003.gguf")
    assert [t.name for t in header.tensors] == ["blk.0.weight", "blk.1.weight", "blk.2.weight"]


def test_a_missing_shard_is_named(tmp_path):
    write_split_model(tmp_path, "tiny", [1, 1, 1, 1])
    (tmp_path / "tiny-00003-of-00004.gguf").unlink()
    with pytest.raises(ModelError, match=r"tiny-00003-of-00004.gguf is not in .*Download every shard of tiny"):
        model_files(tmp_path / "tiny-00001-of-00004.gguf")


def test_a_shard_of_another_split_is_refused(tmp_path):
    write_split_model(tmp_path / "three", "tiny", [1, 1, 1])
    write_split_model(tmp_path / "two", "tiny", [1, 1])
    # A shard whose header says "2 of 2" under the name of shard 2 of 3.
    (tmp_path / "two" / "tiny-00002-of-00002.gguf").replace(tmp_path / "three" / "tiny-00002-of-00003.gguf")
    with pytest.raises(ModelError, match="says it is shard 2 of 2, but its name says shard 2 of 3"):
        model_files(tmp_path / "three" / "tiny-00001-of-00003.gguf")


def test_a_split_models_identity_is_its_manifests_sha256(tmp_path):
    first = write_split_model(tmp_path, "tiny", [1, 1])
    identity = model_sha256(first, no_progress)
    manifest = manifest_path(identity).read_bytes()
    assert hashlib.sha256(manifest).hexdigest() == identity
    shards = decode_manifest(manifest)
    assert [s.sha256 for s in shards] == [hashlib.sha256(f.read_bytes()).hexdigest() for f in model_files(first)]
    assert model_shards(first, identity) == shards
    assert set(offered_files(first, identity)) == {identity, *(s.sha256 for s in shards)}
    # Another shard, another model.
    write_split_model(tmp_path, "tiny", [1, 1], seed=1)
    assert model_sha256(first, no_progress) != identity
    # A single file is known by its own sha256, as before.
    single = tmp_path / "single.gguf"
    single.write_bytes(b"GGUF" + bytes(100))
    assert model_sha256(single, no_progress) == hashlib.sha256(single.read_bytes()).hexdigest()
    assert model_shards(single, SHA) == () and offered_files(single, SHA) == {SHA: single.resolve()}


def test_manifests_round_trip_and_bad_ones_are_refused():
    shards = (Shard("m-00001-of-00002.gguf", 10, SHA), Shard("m-00002-of-00002.gguf", 20, "cd" * 32))
    assert decode_manifest(encode_manifest(shards)) == shards
    good = json.loads(encode_manifest(shards))
    bad_entries = [
        {"name": "../m-00001-of-00002.gguf", "bytes": 10, "sha256": SHA},  # not a bare file name
        {"name": "m-00002-of-00002.gguf", "bytes": 10, "sha256": SHA},  # shard 2 listed first
        {"name": "m-00001-of-00002.gguf", "bytes": -1, "sha256": SHA},
        {"name": "m-00001-of-00002.gguf", "bytes": 10, "sha256": "xyz"},
        "m-00001-of-00002.gguf",
    ]
    for entry in bad_entries:
        document = {**good, "shards": [entry, good["shards"][1]]}
        with pytest.raises(ModelError, match="bad entry for shard 1"):
            decode_manifest(json.dumps(document).encode())
    with pytest.raises(ModelError, match="version 2"):
        decode_manifest(json.dumps({**good, "version": 2}).encode())
    with pytest.raises(ModelError, match="neither a GGUF nor"):
        decode_manifest(b"\x00garbage")
    with pytest.raises(ModelError, match="no shards"):
        decode_manifest(json.dumps({**good, "shards": []}).encode())


def test_a_split_set_in_the_hubs_cache_is_found_through_its_links(tmp_path):
    """The hub's cache links snapshots/<commit>/<name> to blobs/<sha256>: the shards are found by name,
    beside the first, and the links are kept (following one would lose the name)."""
    made = write_split_model(tmp_path / "made", "tiny", [1, 1])
    blobs, snapshot = tmp_path / "models--u--r" / "blobs", tmp_path / "models--u--r" / "snapshots" / "c0mmit"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for shard in model_files(made):
        blob = blobs / hashlib.sha256(shard.read_bytes()).hexdigest()
        shard.replace(blob)
        (snapshot / shard.name).symlink_to(blob)
    files = model_files(snapshot / "tiny-00001-of-00002.gguf")
    assert files == (snapshot / "tiny-00001-of-00002.gguf", snapshot / "tiny-00002-of-00002.gguf")


def test_a_sha256_remembered_for_a_checked_download_is_not_hashed_again(tmp_path):
    single = tmp_path / "single.gguf"
    single.write_bytes(b"GGUF" + bytes(100))
    remember_sha256(single, SHA)  # as a hub download does, its bytes checked on arrival
    assert model_sha256(single, no_progress) == SHA
    single.write_bytes(b"GGUF" + bytes(101))  # changed since: hashed again
    assert model_sha256(single, no_progress) == hashlib.sha256(single.read_bytes()).hexdigest()
