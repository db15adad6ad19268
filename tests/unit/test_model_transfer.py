"""Fetching a model file from a member over real QUIC: sha256-checked and resumable."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os

import pytest

from mesh_sidecar.environment import CACHE_ENV
from mesh_sidecar.errors import MalformedMessageError, ModelError, ProtocolVersionError
from mesh_sidecar.llama.model import fetched_models_dir, model_sha256, offered_files
from mesh_sidecar.llama.model_files import model_files
from mesh_sidecar.net.model_transfer import (
    PARTIAL_SUFFIX,
    REQUEST,
    Status,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from mesh_sidecar.wire import auth
from tests.helpers.meshes import make_mesh, ticket_of, wait_for
from tests.helpers.split_models import write_split_model

SECRET = b"m" * auth.MESH_SECRET_BYTES
SHA = "ab" * 32


def no_progress(message: str, done: int, total: int) -> None:
    pass


def test_codec_round_trips_and_refuses_nonsense():
    assert decode_request(encode_request(SHA, 12345)) == (SHA, 12345)
    assert decode_reply(encode_reply(Status.BAD_OFFSET, 7)) == (Status.BAD_OFFSET, 7)
    with pytest.raises(MalformedMessageError):
        decode_request(encode_request(SHA, 1)[:-1])
    with pytest.raises(ProtocolVersionError):
        decode_request(bytes([9]) + encode_request(SHA, 1)[1:])
    with pytest.raises(MalformedMessageError):
        decode_reply(bytes([200]) + bytes(8))
    assert REQUEST.size == 41


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of this test's own: fetched models land there."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


async def connected(tmp_path, **a_holds):
    """Meshes A (holding what ``a_holds`` says) and B, B joined to A; and their run tasks."""
    a = make_mesh(tmp_path, "a", SECRET, **a_holds)
    b = make_mesh(tmp_path, "b", SECRET)
    for m in (a, b):
        await m.start(0)
    tasks = [asyncio.create_task(m.run()) for m in (a, b)]
    await b.join(ticket_of(a, SECRET))
    await wait_for(lambda: len(b.connected_members()) == 1, "connected")
    return a, b, tasks


async def stop(a, b, tasks) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for m in (a, b):
        await m.close(graceful=False)


@pytest.fixture
async def pair(tmp_path, cache):
    """A holds a 24 MB model file; B is connected to A."""
    payload = b"GGUF" + os.urandom(24 * 1024 * 1024)
    source = tmp_path / "model.gguf"
    source.write_bytes(payload)
    sha = hashlib.sha256(payload).hexdigest()
    a, b, tasks = await connected(tmp_path, model_sha256=sha, model_file=source)
    yield a, b, sha, payload
    await stop(a, b, tasks)


async def test_interrupted_fetch_resumes_and_is_checked(pair, tmp_path, caplog):
    caplog.set_level(logging.INFO, "mesh_sidecar.net.model_transfer")
    a, b, sha, payload = pair
    destination = fetched_models_dir() / f"{sha}.gguf"
    partial = fetched_models_dir() / f"{sha}.download{PARTIAL_SUFFIX}"
    first = asyncio.create_task(b.fetch_model(a.identity.node_id, sha, no_progress))
    await wait_for(lambda: partial.exists() and partial.stat().st_size > 2 * 1024 * 1024, "some bytes arrive")
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    resumed_at = partial.stat().st_size
    assert 0 < resumed_at < len(payload) and not destination.exists()

    seen: list[tuple[str, int, int]] = []
    path = await b.fetch_model(a.identity.node_id, sha, lambda *p: seen.append(p))
    assert path == destination and destination.read_bytes() == payload and not partial.exists()
    assert seen[0][1] == resumed_at and seen[-1][1] == len(payload)  # progress counted from the resume point
    starts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sending")]
    assert starts[0].endswith(f"from byte 0 of {len(payload)}")
    assert starts[-1].endswith(f"from byte {resumed_at} of {len(payload)}")


async def test_a_damaged_partial_file_is_detected_and_discarded(pair, tmp_path):
    a, b, sha, payload = pair
    destination = fetched_models_dir() / f"{sha}.gguf"
    partial = fetched_models_dir() / f"{sha}.download{PARTIAL_SUFFIX}"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\0" * 1000)  # not the file's first bytes
    with pytest.raises(ModelError, match="sha256"):
        await b.fetch_model(a.identity.node_id, sha, no_progress)
    assert not partial.exists() and not destination.exists()
    # The next attempt starts over and succeeds.
    await b.fetch_model(a.identity.node_id, sha, no_progress)
    assert destination.read_bytes() == payload


async def test_a_member_serves_only_the_file_it_announced(pair, tmp_path):
    a, b, sha, _ = pair
    with pytest.raises(ModelError, match="does not hold"):
        await b.fetch_model(a.identity.node_id, "cd" * 32, no_progress)
    # B announced no file: asking B fails the same way.
    with pytest.raises(ModelError, match="does not hold"):
        await a.fetch_model(b.identity.node_id, sha, no_progress)


async def test_a_split_model_is_fetched_shard_by_shard_and_resumes_within_a_shard(tmp_path, cache):
    first = write_split_model(tmp_path / "held", "tiny", [3, 3, 3])
    shards = model_files(first)
    identity = model_sha256(first, no_progress)
    a, b, tasks = await connected(tmp_path, model_sha256=identity, model_file=first)
    try:
        # An earlier fetch got the first shard and 1 MiB of the second (test above: a real interruption).
        fetched = fetched_models_dir() / identity
        fetched.mkdir(parents=True)
        (fetched / shards[0].name).write_bytes(shards[0].read_bytes())
        (fetched / (shards[1].name + PARTIAL_SUFFIX)).write_bytes(shards[1].read_bytes()[:1024 * 1024])
        seen: list[tuple[str, int, int]] = []
        path = await b.fetch_model(a.identity.node_id, identity, lambda *p: seen.append(p))
        assert path == fetched / shards[0].name
        assert [(fetched / s.name).read_bytes() for s in shards] == [s.read_bytes() for s in shards]
        assert not any(what.endswith("(1/3)") for what, _, _ in seen)  # the first shard was kept
        second = [done for what, done, _ in seen if what.endswith(f"{shards[1].name} (2/3)")]
        assert second[0] == 1024 * 1024  # resumed within the second shard
        assert any(what.endswith(f"{shards[2].name} (3/3)") for what, _, _ in seen)
        # What B fetched is the same model: the same identity, and B can offer it in turn.
        assert model_sha256(path, no_progress) == identity
        assert set(offered_files(path, identity)) == set(offered_files(first, identity))
    finally:
        await stop(a, b, tasks)
