"""Zero-byte model loads: the rpc-server weight cache, filled from the node's own GGUF.

llama.cpp's RPC client sends a weight tensor over HASH_THRESHOLD_BYTES as
``SET_TENSOR_HASH`` (its 64-bit FNV-1a hash) first; an rpc-server started with
``-c`` answers from the file named by that hash in ``$LLAMA_CACHE/rpc`` and the
tensor's bytes never cross the network. Otherwise the client sends the bytes
and the server saves them there, so a second load is free anyway.

A node that holds the model file (same sha256 as the serving node's: see
``weights_mismatch``) seeds that cache before its first load, so even the first
load ships only hashes and the small tensors. Each node has its own cache in
its home: one rpc-server writes it, so no reader sees another's half-written
file. rpc-server itself trusts whatever file carries the right name and does
not write atomically, so files it wrote are checked once (``verify``) before
they are used again: a file torn by a crash is removed, not loaded as weights.

Hashing gigabytes byte by byte is too slow in Python; ``native/tensor_cache.c``
does it, built once with the system C compiler (the one llama.cpp needs).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import SetupError
from ..home import cache_root
from ..progress import ProgressCallback
from ..units import MIB
from .gguf_file import read_header
from .model_files import model_files

log = logging.getLogger(__name__)

# llama.cpp ggml-rpc.cpp: weight tensors larger than this go as SET_TENSOR_HASH.
HASH_THRESHOLD_BYTES = 10 * MIB
CACHE_DIR_NAME = "weight-cache"  # in the node's home; rpc-server adds "rpc"
LLAMA_CACHE_ENV = "LLAMA_CACHE"
TOOL_SOURCE = "tensor_cache.c"
TOOL_NAME = "mesh-tensor-cache"
VERIFIED_FILE = "verified.json"  # name -> [size, mtime_ns] of files known good
SEEDED_PREFIX = "seeded-"  # + model sha256: this model's tensors are all in the cache
_HASH_NAME_CHARS = 16


@dataclass(frozen=True)
class WeightCache:
    """One node's rpc-server weight cache."""

    root: Path

    @classmethod
    def in_home(cls, home: Path) -> WeightCache:
        return cls(home / CACHE_DIR_NAME)

    @property
    def tensors(self) -> Path:
        """Where rpc-server reads and writes ``<16 hex digits>`` files."""
        return self.root / "rpc"

    def environment(self) -> dict[str, str]:
        """What rpc-server's environment needs for ``-c`` to use this cache."""
        return {LLAMA_CACHE_ENV: str(self.root)}

    def create(self) -> None:
        self.tensors.mkdir(parents=True, exist_ok=True)

    def tensor_files(self) -> list[Path]:
        return sorted(p for p in self.tensors.iterdir()
                      if len(p.name) == _HASH_NAME_CHARS and all(c in "0123456789abcdef" for c in p.name))


def hashed_tensor_ranges(model: Path) -> list[tuple[Path, int, int]]:
    """(file, offset in it, size) of every tensor the RPC client would send by hash: in every shard of
    a split model."""
    return [(file, t.data_offset, t.n_bytes) for file in model_files(model)
            for t in read_header(file).tensors if t.n_bytes > HASH_THRESHOLD_BYTES]


def ensure_tool(progress: ProgressCallback) -> Path:
    """The compiled helper, built on first use; SetupError if there is no C compiler."""
    source = resources.files("mesh_sidecar.llama.native").joinpath(TOOL_SOURCE).read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    tool = cache_root() / "tools" / f"{TOOL_NAME}-{digest}"
    if tool.exists():
        return tool
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise SetupError("No C compiler (cc) found to build the weight-cache helper. "
                         "On Debian/Ubuntu: sudo apt-get install gcc")
    progress("Building the weight-cache helper", 0, 0)
    tool.parent.mkdir(parents=True, exist_ok=True)
    source_path = tool.with_suffix(".c")
    source_path.write_bytes(source)
    partial = tool.with_name(tool.name + ".partial")
    result = subprocess.run([compiler, "-O2", "-o", str(partial), str(source_path)], capture_output=True, text=True)
    if result.returncode != 0:
        raise SetupError(f"Building the weight-cache helper failed:\n{result.stderr.strip()[-2000:]}")
    partial.replace(tool)
    return tool


def verify(cache: WeightCache, tool: Path, progress: ProgressCallback) -> int:
    """Check every cached tensor file not yet known good; remove bad ones. Returns how many."""
    cache.create()
    verified = _read_json(cache.root / VERIFIED_FILE)
    files = cache.tensor_files()
    unchecked = [p for p in files if verified.get(p.name) != _fingerprint(p)]
    removed = 0
    total = sum(p.stat().st_size for p in unchecked)
    done = 0
    for path in unchecked:
        outcome = _run_tool(tool, "verify", str(cache.tensors), path.name)
        done += path.stat().st_size
        progress("Checking the weight cache", done, total)
        if outcome == [f"ok {path.name}"]:
            verified[path.name] = _fingerprint(path)
        else:
            log.warning("removed torn or altered weight-cache file %s", path.name)
            path.unlink()
            removed += 1
    present = {p.name for p in cache.tensor_files()}
    _write_json(cache.root / VERIFIED_FILE, {k: v for k, v in verified.items() if k in present})
    return removed


def seed(cache: WeightCache, tool: Path, model: Path, sha256: str, progress: ProgressCallback) -> int:
    """Put every by-hash tensor of ``model`` in the cache (once per model); returns bytes written."""
    cache.create()
    stamp = cache.root / f"{SEEDED_PREFIX}{sha256}"
    if stamp.exists():
        return 0
    ranges = hashed_tensor_ranges(model)
    total = sum(size for _, _, size in ranges)
    verified = _read_json(cache.root / VERIFIED_FILE)
    done = 0
    for file, offset, size in ranges:
        (line,) = _run_tool(tool, "seed", str(file), str(cache.tensors), f"{offset}:{size}")
        name = line.split()[0]
        verified[name] = _fingerprint(cache.tensors / name)
        done += size
        progress(f"Seeding the weight cache from {model.name}", done, total)
    _write_json(cache.root / VERIFIED_FILE, verified)
    stamp.write_text(json.dumps({"model": str(model), "tensors": len(ranges), "bytes": total}))
    return total


def _run_tool(tool: Path, *args: str) -> list[str]:
    result = subprocess.run([str(tool), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SetupError(f"The weight-cache helper failed: {result.stderr.strip()[-2000:]}")
    return result.stdout.splitlines()


def _fingerprint(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data))
    partial.replace(path)
