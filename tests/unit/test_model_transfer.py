"""Fetching a model file from a member over real QUIC: sha256-checked and resumable."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os

import pytest

from mesh_sidecar.errors import MalformedMessageError, ModelError, ProtocolVersionError
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
async def pair(tmp_path):
    """A holds a 24 MB model file; B is connected to A."""
    payload = os.urandom(24 * 1024 * 1024)
    source = tmp_path / "model.gguf"
    source.write_bytes(payload)
    sha = hashlib.sha256(payload).hexdigest()
    a = make_mesh(tmp_path, "a", SECRET, model_sha256=sha, model_file=source)
    b = make_mesh(tmp_path, "b", SECRET)
    for m in (a, b):
        await m.start(0)
    tasks = [asyncio.create_task(m.run()) for m in (a, b)]
    await b.join(ticket_of(a, SECRET))
    await wait_for(lambda: len(b.connected_members()) == 1, "connected")
    yield a, b, sha, payload
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for m in (a, b):
        await m.close(graceful=False)


async def test_interrupted_fetch_resumes_and_is_checked(pair, tmp_path, caplog):
    caplog.set_level(logging.INFO, "mesh_sidecar.net.model_transfer")
    a, b, sha, payload = pair
    destination = tmp_path / "fetched" / f"{sha}.gguf"
    partial = destination.with_name(destination.name + PARTIAL_SUFFIX)
    first = asyncio.create_task(b.fetch_model(a.identity.node_id, sha, destination, no_progress))
    await wait_for(lambda: partial.exists() and partial.stat().st_size > 2 * 1024 * 1024, "some bytes arrive")
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    resumed_at = partial.stat().st_size
    assert 0 < resumed_at < len(payload) and not destination.exists()

    seen: list[tuple[str, int, int]] = []
    path = await b.fetch_model(a.identity.node_id, sha, destination, lambda *p: seen.append(p))
    assert path == destination and destination.read_bytes() == payload and not partial.exists()
    assert seen[0][1] == resumed_at and seen[-1][1] == len(payload)  # progress counted from the resume point
    starts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sending")]
    assert starts[0].endswith(f"from byte 0 of {len(payload)}")
    assert starts[-1].endswith(f"from byte {resumed_at} of {len(payload)}")


async def test_a_damaged_partial_file_is_detected_and_discarded(pair, tmp_path):
    a, b, sha, payload = pair
    destination = tmp_path / f"{sha}.gguf"
    partial = destination.with_name(destination.name + PARTIAL_SUFFIX)
    partial.write_bytes(b"\0" * 1000)  # not the file's first bytes
    with pytest.raises(ModelError, match="sha256"):
        await b.fetch_model(a.identity.node_id, sha, destination, no_progress)
    assert not partial.exists() and not destination.exists()
    # The next attempt starts over and succeeds.
    await b.fetch_model(a.identity.node_id, sha, destination, no_progress)
    assert destination.read_bytes() == payload


async def test_a_member_serves_only_the_file_it_announced(pair, tmp_path):
    a, b, sha, _ = pair
    with pytest.raises(ModelError, match="does not hold"):
        await b.fetch_model(a.identity.node_id, "cd" * 32, tmp_path / "other.gguf", no_progress)
    # B announced no file: asking B fails the same way.
    with pytest.raises(ModelError, match="does not hold"):
        await a.fetch_model(b.identity.node_id, sha, tmp_path / "x.gguf", no_progress)
