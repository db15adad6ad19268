"""The files of one model: a single GGUF, or the shards of a split one.

Models past ~50 GB are published split by llama.cpp's ``gguf-split`` into
``NAME-00001-of-0000N.gguf`` ... ``NAME-0000N-of-0000N.gguf``. Every shard's header
carries ``split.no`` (0-based) and ``split.count``, and ``split.tensors.count``
(all shards' tensors together); the metadata is in the first shard, the tensors
are spread over all of them. llama-server is given the first shard and opens the
others by name. So wherever a user names a model, any shard means the whole set:
:func:`model_files` finds every shard and checks it, and the rest of the node
works with the first shard's path, reading the set through this module
(:func:`read_model_header`) or model.py (the identity, :func:`~.model.model_sha256`).

The identity of a split model is its manifest's sha256: a small canonical JSON
document naming every shard with its size and sha256, in order. That one id goes
in gossip and receipts where a single file's sha256 goes, and commits to every
shard: a member fetching the model (net/model_transfer.py) asks for the manifest
by it, checks that it hashes to it, then fetches each shard by its own sha256.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from ..errors import ModelError
from ..wire.gguf_header import GGUF_MAGIC, GGUFHeader, parse_header


def read_header(path: Path) -> GGUFHeader:
    """``path``'s header, read by mapping the file (only the pages the header spans are read); ModelError if
    it cannot be read as a GGUF."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, \
                memoryview(mapped) as view:
            return parse_header(view, str(path))
    except ValueError as exc:  # mmap of an empty file
        raise ModelError(f"{path} is empty: it is not a GGUF file.") from exc
    except OSError as exc:
        raise ModelError(f"Cannot read {path}: {exc.strerror}.") from exc


SPLIT_NO_KEY = "split.no"
SPLIT_COUNT_KEY = "split.count"
SPLIT_TENSORS_KEY = "split.tensors.count"
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")
SHARD_NAME_FORMAT = "{prefix}-{number:05d}-of-{count:05d}.gguf"  # llama.cpp's llama_split_path
MANIFEST_FORMAT = "mesh-inference split model"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 * 1024  # a manifest names at most a few hundred shards
MAX_SHARDS = 99999  # five digits in the name
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ShardName:
    """What a shard's file name says: ``{prefix}-{number:05d}-of-{count:05d}.gguf``, numbered from 1."""

    prefix: str
    number: int
    count: int

    def of(self, number: int) -> str:
        """The file name of shard ``number`` of the same set."""
        return SHARD_NAME_FORMAT.format(prefix=self.prefix, number=number, count=self.count)


def shard_name(file_name: str) -> ShardName | None:
    """The shard a file name names, or None for a file that is not named as a shard."""
    match = _SHARD_NAME.match(PurePath(file_name).name)
    if match is None:
        return None
    number, count = int(match.group("number")), int(match.group("count"))
    if not 1 <= number <= count:
        return None
    return ShardName(match.group("prefix"), number, count)


def model_stem(file_name: str) -> str:
    """A model's name without ``.gguf``, and without the shard suffix for a split model."""
    shard = shard_name(file_name)
    return shard.prefix if shard is not None else PurePath(file_name).stem


def check_gguf_file(path: Path) -> Path:
    """``path`` made absolute, if it is a readable GGUF file; ModelError saying what is wrong.

    Links are kept, not followed: the hub's cache links ``snapshots/<commit>/<name>`` to
    ``blobs/<sha256>``, and a split set's shards are found by the name, beside the first.
    """
    path = path.expanduser()
    if not path.exists():
        raise ModelError(f"Model file {path} does not exist. Check the path given to --model.")
    if not path.is_file():
        raise ModelError(f"Model path {path} is not a file. Give --model the path of a .gguf file.")
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelError(f"Cannot read model file {path}: {exc.strerror}.") from exc
    if magic != GGUF_MAGIC:
        raise ModelError(
            f"{path} is not a GGUF model (it does not start with 'GGUF'). llama.cpp needs a "
            ".gguf file; convert the model with llama.cpp's convert_hf_to_gguf.py or download a GGUF."
        )
    return Path(os.path.abspath(path))


def model_files(path: Path) -> tuple[Path, ...]:
    """The files llama.cpp loads for the model ``path`` names, the first shard first (resolved).

    A single GGUF is itself. Any shard of a split model means every shard: all must be present
    beside it, and each header must agree with its name (``split.no``, ``split.count``);
    ModelError names what is missing or wrong.
    """
    first = check_gguf_file(path)
    shard = shard_name(first.name)
    if shard is None:
        return (first,)
    names = [shard.of(number) for number in range(1, shard.count + 1)]
    missing = [name for name in names if not (first.parent / name).is_file()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelError(
            f"{first.name} is shard {shard.number} of a model split into {shard.count} files, but "
            f"{shown} {'is' if len(missing) == 1 else 'are'} not in {first.parent}. Download every "
            f"shard of {shard.prefix} into the same directory (llama.cpp loads them all).")
    files = tuple(check_gguf_file(first.parent / name) for name in names)
    for number, file in enumerate(files, start=1):
        fields = read_header(file).fields
        said = fields.get(SPLIT_NO_KEY), fields.get(SPLIT_COUNT_KEY)
        if said != (number - 1, shard.count):
            raise ModelError(
                f"{file.name} says it is shard {_shown_shard(said)}, but its name says shard {number} of "
                f"{shard.count}: the files of {shard.prefix} do not belong together (a shard from "
                "another download or another split?). Download the set again, all from one source.")
    return files


def _shown_shard(said: tuple[Any, Any]) -> str:
    number, count = said
    if not isinstance(number, int) or not isinstance(count, int):
        return "of no split (it has no split.no/split.count keys)"
    return f"{number + 1} of {count}"


def read_model_header(path: Path) -> GGUFHeader:
    """The model's header: a single file's, or a split model's first shard's metadata with every
    shard's tensors (each tensor's ``data_offset`` is within its own shard)."""
    files = model_files(path)
    first = read_header(files[0])
    if len(files) == 1:
        return first
    tensors = [*first.tensors]
    for file in files[1:]:
        tensors += read_header(file).tensors
    expected = first.fields.get(SPLIT_TENSORS_KEY)
    if isinstance(expected, int) and expected != len(tensors):
        raise ModelError(f"The shards of {files[0].name} hold {len(tensors)} tensors, but it says "
                         f"{SPLIT_TENSORS_KEY} = {expected}: a shard is truncated or from another split.")
    return GGUFHeader(first.version, first.fields, tuple(tensors))


# --- the manifest: a split model's identity --------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """One file of a split model, as its manifest lists it."""

    name: str
    size_bytes: int
    sha256: str


def encode_manifest(shards: tuple[Shard, ...]) -> bytes:
    """The canonical manifest of a split model (its sha256 is the model's identity)."""
    document = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                "shards": [{"name": s.name, "bytes": s.size_bytes, "sha256": s.sha256} for s in shards]}
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def decode_manifest(data: bytes) -> tuple[Shard, ...]:
    """The shards a manifest lists; ModelError if it is not one this version writes."""
    try:
        document = json.loads(data) if len(data) <= MAX_MANIFEST_BYTES else None
    except ValueError:
        document = None
    if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
        raise ModelError("The model file received is neither a GGUF nor a split model's manifest.")
    if document.get("version") != MANIFEST_VERSION:
        raise ModelError(f"The split model's manifest is version {document.get('version')!r}; this node reads "
                         f"version {MANIFEST_VERSION}: run the same mesh-inference release on every node.")
    entries = document.get("shards")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_SHARDS:
        raise ModelError("The split model's manifest lists no shards.")
    shards = []
    for number, entry in enumerate(entries, start=1):
        shard = _manifest_entry(entry, number, len(entries))
        if shard is None:
            raise ModelError(f"The split model's manifest has a bad entry for shard {number}: {entry!r}.")
        shards.append(shard)
    return tuple(shards)


def _manifest_entry(entry: Any, number: int, count: int) -> Shard | None:
    """Shard ``number`` of ``count`` as a manifest entry gives it, or None when it is not a valid one
    (a bare file name of that shard, a size, a sha256 in hex)."""
    if not isinstance(entry, dict):
        return None
    name, size, sha256 = entry.get("name"), entry.get("bytes"), entry.get("sha256")
    if not isinstance(name, str) or PurePath(name).name != name:
        return None
    named = shard_name(name)
    if named is None or (named.number, named.count) != (number, count):
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return None
    if not isinstance(sha256, str) or not _SHA256_HEX.fullmatch(sha256):
        return None
    return Shard(name, size, sha256)
