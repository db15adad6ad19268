"""Model files between members: a worker without the serving node's GGUF fetches it over the mesh.

Files are named by their sha256. Members announce their model's identity in gossip
(``MemberInfo.model_sha256``): a single GGUF's sha256, or a split model's manifest's
(llama/model_files.py). A worker asks for exactly that and checks what it got; a
manifest then names each shard by its own sha256, fetched the same way, one after
the other. A fetch resumes where an interrupted one stopped: the bytes so far are
kept in ``<name>.partial`` and the next request starts at its length, so a split
model resumes within the shard it was at, the shards before it kept.

One QUIC stream per fetch, after its StreamKind.MODEL_FILE byte::

    request  version u8 | sha256 (32 bytes) | offset u64      REQUEST.size = 41
    reply    status u8  | file size u64                       REPLY.size = 9
             then, if status is OK, the file from ``offset`` to its end, and FIN

All integers big-endian. The codec below is pure; the coroutines are the
asyncio edges (server side, fetching side, and fetching over a member's connection).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..errors import MalformedMessageError, ModelError, ProtocolVersionError
from ..llama.model import fetched_models_dir, file_sha256, manifest_path
from ..llama.model_files import decode_manifest
from ..progress import ProgressCallback
from ..wire.gguf_header import GGUF_MAGIC
from ..wire.stream_kind import StreamKind
from .connection import PeerConnection
from .streams import MeshStreamReader, MeshStreamWriter

log = logging.getLogger(__name__)

TRANSFER_VERSION = 1
REQUEST = struct.Struct("!B32sQ")
REPLY = struct.Struct("!BQ")
CHUNK_BYTES = 1 << 20
PARTIAL_SUFFIX = ".partial"


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_FILE = 1  # this member does not hold a file with that sha256
    BAD_OFFSET = 2  # past the end of the file
    BAD_VERSION = 3


_STATUS_TEXT = {
    Status.UNKNOWN_FILE: "does not hold that model file",
    Status.BAD_OFFSET: "says the partial download is longer than the file",
    Status.BAD_VERSION: "speaks another model-transfer version: run the same mesh-inference release",
}


def encode_request(sha256: str, offset: int) -> bytes:
    return REQUEST.pack(TRANSFER_VERSION, bytes.fromhex(sha256), offset)


def decode_request(data: bytes) -> tuple[str, int]:
    """(sha256 hex, offset); MalformedMessageError or ProtocolVersionError."""
    if len(data) != REQUEST.size:
        raise MalformedMessageError(f"model request of {len(data)} bytes, not {REQUEST.size}")
    version, digest, offset = REQUEST.unpack(data)
    if version != TRANSFER_VERSION:
        raise ProtocolVersionError(f"model transfer version {version}, this node speaks {TRANSFER_VERSION}")
    return digest.hex(), offset


def encode_reply(status: Status, size: int) -> bytes:
    return REPLY.pack(status, size)


def decode_reply(data: bytes) -> tuple[Status, int]:
    if len(data) != REPLY.size:
        raise MalformedMessageError(f"model reply of {len(data)} bytes, not {REPLY.size}")
    status, size = REPLY.unpack(data)
    try:
        return Status(status), size
    except ValueError:
        raise MalformedMessageError(f"unknown model transfer status {status}") from None


async def serve_model_file(reader: MeshStreamReader, writer: MeshStreamWriter,
                           lookup: Callable[[str], Path | None], peer_name: str) -> None:
    """Answer one fetch: the file ``lookup(sha256)`` names, from the asked offset."""
    try:
        request = await reader.readexactly(REQUEST.size)
        sha256, offset = decode_request(request)
    except ProtocolVersionError:
        writer.write(encode_reply(Status.BAD_VERSION, 0))
        writer.write_eof()
        return
    except (asyncio.IncompleteReadError, MalformedMessageError, ConnectionError) as exc:
        log.warning("model request from %s: %s", peer_name, exc)
        writer.abort()
        return
    path = lookup(sha256)
    if path is None:
        writer.write(encode_reply(Status.UNKNOWN_FILE, 0))
        writer.write_eof()
        return
    size = path.stat().st_size
    if offset > size:
        writer.write(encode_reply(Status.BAD_OFFSET, size))
        writer.write_eof()
        return
    log.info("sending %s to %s from byte %d of %d", path.name, peer_name, offset, size)
    writer.write(encode_reply(Status.OK, size))
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            while chunk := f.read(CHUNK_BYTES):
                writer.write(chunk)
                await writer.drain()  # our water marks: never more than a window in memory
        writer.write_eof()
    except ConnectionError as exc:
        log.info("model transfer to %s stopped: %s", peer_name, exc)


OpenStream = Callable[[], Awaitable[tuple[MeshStreamReader, MeshStreamWriter]]]


async def fetch_model(open_stream: OpenStream, sha256: str, source_name: str, progress: ProgressCallback) -> Path:
    """Fetch the model whose identity is ``sha256`` into the fetched-models directory (resuming a partial
    fetch); its path: the GGUF, or a split model's first shard. ModelError if it fails."""
    single = fetched_models_dir() / f"{sha256}.gguf"
    manifest = manifest_path(sha256)
    if single.exists():
        return single
    if not manifest.exists():
        # What the id names is known once it is here: a GGUF, or a manifest (small).
        fetched = await fetch_model_file(open_stream, sha256, fetched_models_dir() / f"{sha256}.download",
                                         source_name, progress)
        with open(fetched, "rb") as f:
            is_gguf = f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
        if is_gguf:
            fetched.replace(single)
            return single
        try:
            decode_manifest(fetched.read_bytes())
        except ModelError:
            fetched.unlink()
            raise
        manifest.parent.mkdir(parents=True, exist_ok=True)
        fetched.replace(manifest)
    shards = decode_manifest(manifest.read_bytes())
    directory = fetched_models_dir() / sha256
    for number, shard in enumerate(shards, start=1):
        await fetch_model_file(open_stream, shard.sha256, directory / shard.name, source_name, progress,
                               what=f"Fetching the model from {source_name}: {shard.name} ({number}/{len(shards)})")
    return directory / shards[0].name


async def fetch_model_file(open_stream: OpenStream, sha256: str, destination: Path, source_name: str,
                           progress: ProgressCallback, *, what: str | None = None) -> Path:
    """Fetch the file with ``sha256`` into ``destination`` (resuming a partial one); ModelError if it fails.
    ``what``: the progress line's text."""
    if destination.exists():
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + PARTIAL_SUFFIX)
    offset = partial.stat().st_size if partial.exists() else 0
    reader, writer = await open_stream()
    writer.write(encode_request(sha256, offset))
    writer.write_eof()
    try:
        status, size = decode_reply(await reader.readexactly(REPLY.size))
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ModelError(f"{source_name} did not answer the model request ({exc}); it will be asked again.") from exc
    if status is Status.BAD_OFFSET:
        partial.unlink()  # not a prefix of this file: start over next time
    if status is not Status.OK:
        raise ModelError(f"{source_name} {_STATUS_TEXT[status]}.")
    what = what or f"Fetching the model from {source_name}"
    done = offset
    progress(what, done, size)
    try:
        with open(partial, "ab") as f:
            while data := await reader.read(CHUNK_BYTES):
                f.write(data)
                done += len(data)
                progress(what, done, size)
    except ConnectionError as exc:
        raise ModelError(f"The model transfer from {source_name} stopped at {done} of {size} bytes ({exc}); "
                         "the next attempt resumes there.") from exc
    if done != size:
        raise ModelError(f"The model transfer from {source_name} ended at {done} of {size} bytes; "
                         "the next attempt resumes there.")
    actual = await asyncio.to_thread(file_sha256, partial)
    if actual != sha256:
        partial.unlink()
        raise ModelError(f"The model fetched from {source_name} has sha256 {actual}, not {sha256}; "
                         "it was discarded.")
    partial.replace(destination)
    return destination


def file_streams(connection: PeerConnection | None, source_name: str) -> OpenStream:
    """A new MODEL_FILE stream over ``connection`` (None: not connected) at each call."""
    async def open_stream() -> tuple[MeshStreamReader, MeshStreamWriter]:
        if connection is None or connection.closed:
            raise ModelError(f"{source_name} is not connected; the model fetch will be retried.")
        reader, writer = await connection.open_stream()
        writer.write(bytes([StreamKind.MODEL_FILE]))
        return reader, writer

    return open_stream


async def fetch_model_over(connection: PeerConnection | None, sha256: str, source_name: str,
                           progress: ProgressCallback) -> Path:
    """:func:`fetch_model` over ``connection`` (None: not connected), a new MODEL_FILE stream per file."""
    return await fetch_model(file_streams(connection, source_name), sha256, source_name, progress)
