"""hf: models fetched from a hub on 127.0.0.1 (tests/helpers/local_hub.py) into the hub's own cache
layout: never the internet."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import try_to_load_from_cache

from mesh_sidecar.errors import ModelError
from mesh_sidecar.llama import hub_models
from mesh_sidecar.llama.hub_models import parse_model_name, resolve
from mesh_sidecar.progress import ignore_progress
from tests.helpers.local_hub import LocalHub

ROOT = Path(__file__).resolve().parents[2]
MODEL = b"GGUF" + os.urandom(3 << 20)
FILES = {"m-Q4_K_M.gguf": MODEL, "m-Q8_0.gguf": b"GGUF q8", "mmproj-m-f16.gguf": b"GGUF projector",
         "README.md": b"# m\n"}


@pytest.fixture
def hub():
    with LocalHub() as hub:
        hub.add_repo("u/m-GGUF", FILES)
        yield hub


@pytest.fixture(autouse=True)
def no_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def fetch(hub: LocalHub, text: str, cache: Path, **options):
    return resolve(parse_model_name(text), progress=ignore_progress, endpoint=hub.endpoint, cache_dir=cache,
                   **options)


def test_the_quant_and_projector_land_in_the_hubs_cache_checked(hub, tmp_path):
    reports = []
    resolved = resolve(parse_model_name("hf:u/m-GGUF"), progress=lambda *r: reports.append(r),
                       endpoint=hub.endpoint, cache_dir=tmp_path)
    assert resolved.model_path.read_bytes() == MODEL and resolved.projector_path.read_bytes() == b"GGUF projector"
    assert resolved.sha256 == hashlib.sha256(MODEL).hexdigest() and resolved.repo == "u/m-GGUF"
    # huggingface_hub itself finds the files where we put them: one cache, one copy.
    assert try_to_load_from_cache("u/m-GGUF", "m-Q4_K_M.gguf", cache_dir=tmp_path) == str(resolved.model_path)
    assert (tmp_path / "models--u--m-GGUF" / "blobs" / resolved.sha256).is_file()
    assert not hub.file_requests("m-Q8_0.gguf") and not hub.file_requests("README.md")
    stage, done, total = reports[-1]
    assert done == total == len(MODEL) or stage.startswith("Downloading mmproj")
    assert any("MiB/s" in stage and "left" in stage for stage, _, _ in reports)


def test_a_cached_model_needs_no_network(hub, tmp_path):
    first = fetch(hub, "hf:u/m-GGUF:q4_k_m", tmp_path)
    asked = len(hub.requests)
    assert fetch(hub, "hf:u/m-GGUF:Q4_K_M", tmp_path) == first
    assert len(hub.requests) == asked
    hub.stop()
    assert fetch(hub, "hf:u/m-GGUF", tmp_path, offline=True) == first
    assert fetch(hub, "hf:u/m-GGUF", tmp_path) == first


def test_offline_without_the_model_cached_says_so(hub, tmp_path):
    with pytest.raises(ModelError, match="not in the cache"):
        fetch(hub, "hf:u/m-GGUF", tmp_path, offline=True)
    assert not hub.requests


def test_an_unreachable_hub_says_the_download_resumes(hub, tmp_path):
    hub.stop()
    with pytest.raises(ModelError, match=r"Cannot reach .* resumes"):
        fetch(hub, "hf:u/m-GGUF", tmp_path)


def test_a_missing_quant_lists_the_repos(hub, tmp_path):
    with pytest.raises(ModelError, match=r"no Q6_K quant\. It has: Q4_K_M, Q8_0"):
        fetch(hub, "hf:u/m-GGUF:Q6_K", tmp_path)


def test_a_missing_repo_says_to_check_the_name(hub, tmp_path):
    with pytest.raises(ModelError, match="has no model repo u/nothing"):
        fetch(hub, "hf:u/nothing", tmp_path)


def test_a_gated_repo_asks_for_a_token_and_takes_one(hub, tmp_path):
    hub.add_repo("u/gated", {"g-Q4_K_M.gguf": b"GGUF gated"}, gated=True)
    with pytest.raises(ModelError, match=r"gated.*set HF_TOKEN"):
        fetch(hub, "hf:u/gated", tmp_path)
    assert fetch(hub, "hf:u/gated", tmp_path, token="hf_local").model_path.read_bytes() == b"GGUF gated"


def test_a_split_set_is_fetched_whole(hub, tmp_path):
    shards = {f"Q4_K_M/big-Q4_K_M-0000{n}-of-00003.gguf": b"GGUF shard %d" % n for n in (1, 2, 3)}
    hub.add_repo("u/big", {**shards, "big-Q8_0.gguf": b"GGUF"})
    resolved = fetch(hub, "hf:u/big", tmp_path)
    assert resolved.model_path.name == "big-Q4_K_M-00001-of-00003.gguf"
    for path, data in shards.items():
        assert (resolved.model_path.parent / Path(path).name).read_bytes() == data
    assert resolved.projector_path is None


def test_a_corrupt_byte_is_refused_and_nothing_kept(hub, tmp_path):
    hub.corrupt("u/m-GGUF", "m-Q4_K_M.gguf")
    with pytest.raises(ModelError) as caught:
        fetch(hub, "hf:u/m-GGUF", tmp_path, projector=False)
    assert hashlib.sha256(MODEL).hexdigest() in str(caught.value) and "afresh" in str(caught.value)
    blobs = tmp_path / "models--u--m-GGUF" / "blobs"
    assert not list(blobs.iterdir())
    hub.repos["u/m-GGUF"].corrupt.clear()
    assert fetch(hub, "hf:u/m-GGUF", tmp_path).model_path.read_bytes() == MODEL
    assert [r[2] for r in hub.file_requests("m-Q4_K_M.gguf")] == [None, None]  # fetched afresh, not resumed


def test_too_little_space_is_said_before_the_download(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_models.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1 << 20})())
    with pytest.raises(ModelError, match=r"needs 0\.01 GiB more in .*blobs, and 0\.00 GiB is free"):
        fetch(hub, "hf:u/m-GGUF", tmp_path)
    assert not hub.file_requests(".gguf")


def test_a_download_killed_midway_resumes_on_the_next_start(hub, tmp_path):
    """A node killed mid-download (here: a process resolving with HF_ENDPOINT and HF_HOME, as the CLI
    would) leaves its partial blob; the next start asks only for the rest."""
    hub.bytes_per_s = 1 << 20
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = ("from mesh_sidecar.llama.hub_models import parse_model_name, resolve\n"
            "from mesh_sidecar.progress import ignore_progress\n"
            "resolve(parse_model_name('hf:u/m-GGUF'), progress=ignore_progress, projector=False)\n")
    partial = tmp_path / "hub" / "models--u--m-GGUF" / "blobs" / f"{hashlib.sha256(MODEL).hexdigest()}.incomplete"
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 20
        while not (partial.exists() and partial.stat().st_size >= 512 << 10):
            assert child.poll() is None and time.monotonic() < deadline, "the download never got going"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    kept = partial.stat().st_size
    assert 0 < kept < len(MODEL)
    hub.bytes_per_s = None
    resolved = fetch(hub, "hf:u/m-GGUF", tmp_path / "hub", projector=False)
    assert resolved.model_path.read_bytes() == MODEL and not partial.exists()
    assert hub.file_requests("m-Q4_K_M.gguf")[-1][2] == f"bytes={kept}-"


def test_a_quant_added_since_the_listing_was_cached_is_found(hub, tmp_path):
    fetch(hub, "hf:u/m-GGUF", tmp_path)
    hub.add_repo("u/m-GGUF", {**FILES, "m-Q6_K.gguf": b"GGUF q6"})
    assert fetch(hub, "hf:u/m-GGUF:Q6_K", tmp_path).model_path.read_bytes() == b"GGUF q6"
    with pytest.raises(ModelError, match="no Q5_K_M quant"):
        fetch(hub, "hf:u/m-GGUF:Q5_K_M", tmp_path, offline=True)
