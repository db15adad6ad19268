"""Zero-byte model loads: the rpc-server weight cache, filled only from the node's own GGUF.

llama.cpp's RPC client sends a weight tensor over HASH_THRESHOLD_BYTES as
``SET_TENSOR_HASH`` (its 64-bit FNV-1a hash) first; an rpc-server started with
``-c`` answers from the file named by that hash in ``$LLAMA_CACHE/rpc`` and the
tensor's bytes never cross the network. Otherwise the client sends the bytes.
Upstream's server would then save them under their FNV-1a name for later loads;
ours does not (``llama.cpp-rpc-cache-read-only.patch``, patches/README.md):
FNV-1a is no proof of content, so any member could have planted a tensor of its
choosing under a weight's name. A worker without the model file therefore gets
the weights over the network on every load, and keeps none of them.

A node that holds the model file (same sha256 as the serving node's: see
``weights_mismatch``) seeds that cache before its first load, so every load
ships only hashes and the small tensors. Seeding records each file's SHA-256 in
``verified.json``; ``verify``, before rpc-server starts, removes every file
that seeding did not write or that no longer matches its record. A name that
two different tensors share (FNV-1a collides by chance, or by a model made to)
is left empty for good: neither is served from the cache. Each node has its own
cache in its home.

FNV-1a over gigabytes is too slow in Python; ``native/tensor_cache.c`` takes it
(and the SHA-256) while copying, built once with the system C compiler (the one
llama.cpp needs) against OpenSSL's libcrypto.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import SetupError
from ..home import cache_root
from ..progress import ProgressCallback
from ..units import MIB
from ..wire.gguf_header import TensorInfo
from .model import file_sha256
from .model_files import model_files, read_header

log = logging.getLogger(__name__)

# llama.cpp ggml-rpc.cpp: weight tensors larger than this go as SET_TENSOR_HASH.
HASH_THRESHOLD_BYTES = 10 * MIB
CACHE_DIR_NAME = "weight-cache"  # in the node's home; rpc-server adds "rpc"
LLAMA_CACHE_ENV = "LLAMA_CACHE"
TOOL_SOURCE = "tensor_cache.c"
TOOL_NAME = "mesh-tensor-cache"
OPENSSL_PACKAGE = "libssl-dev"  # the tool's SHA-256 is libcrypto's
VERIFIED_FILE = "verified.json"  # what seeding wrote: _Ledger
SEEDED_PREFIX = "seeded-"  # + model sha256: this model's tensors were seeded, under the names it lists
STAGING_DIR_NAME = "seeding"  # where the tool writes a tensor before it is let into the cache
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
        """Where rpc-server reads ``<16 hex digits>`` files."""
        return self.root / "rpc"

    def environment(self) -> dict[str, str]:
        """What rpc-server's environment needs for ``-c`` to use this cache."""
        return {LLAMA_CACHE_ENV: str(self.root)}

    def create(self) -> None:
        self.tensors.mkdir(parents=True, exist_ok=True)

    def tensor_files(self) -> list[Path]:
        return sorted(p for p in self.tensors.iterdir()
                      if len(p.name) == _HASH_NAME_CHARS and all(c in "0123456789abcdef" for c in p.name))


@dataclass(frozen=True)
class _Seeded:
    """A tensor file as seeding wrote it."""

    size: int
    sha256: str
    mtime_ns: int  # when it was last checked: a file with this size and mtime is not hashed again
    fetched_for: str = ""  # fetched from the hub for this serving node (hex id); "": seeded from our own file

    def unchanged(self, path: Path) -> bool:
        stat = path.stat()
        return (stat.st_size, stat.st_mtime_ns) == (self.size, self.mtime_ns)


@dataclass
class _Ledger:
    """``verified.json``: the files seeding wrote, by name (kept when a file is removed: the name stays that
    tensor's), and the names two different tensors claimed."""

    tensors: dict[str, _Seeded] = field(default_factory=dict)
    contested: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, cache: WeightCache) -> _Ledger:
        """The ledger; an unreadable or older one is empty (its files are then not ours, and are removed)."""
        data = _read_json(cache.root / VERIFIED_FILE)
        contested, tensors = data.get("contested"), data.get("tensors")
        ledger = cls(contested={name for name in (contested if isinstance(contested, list) else ())
                                if isinstance(name, str)})
        for name, entry in (tensors.items() if isinstance(tensors, dict) else ()):
            try:
                ledger.tensors[name] = _Seeded(int(entry["size"]), str(entry["sha256"]), int(entry["mtime_ns"]),
                                               str(entry.get("fetched_for", "")))
            except (KeyError, TypeError, ValueError):
                pass
        return ledger

    def settled(self, cache: WeightCache, name: str) -> bool:
        """Whether seeding has nothing left to do for ``name``: its file is in the cache, or it is contested."""
        return name in self.contested or (name in self.tensors and (cache.tensors / name).is_file())

    def write(self, cache: WeightCache) -> None:
        _write_json(cache.root / VERIFIED_FILE, {"tensors": {name: dataclasses.asdict(entry)
                                                             for name, entry in sorted(self.tensors.items())},
                                                 "contested": sorted(self.contested)})


def hashed_tensors(model: Path) -> list[tuple[Path, TensorInfo]]:
    """Every tensor the RPC client would send by hash, with the file it is in: in every shard of a split
    model, in file order."""
    return [(file, t) for file in model_files(model) for t in read_header(file).tensors
            if t.n_bytes > HASH_THRESHOLD_BYTES]


def hashed_tensor_ranges(model: Path) -> list[tuple[Path, int, int]]:
    """(file, offset in it, size) of each of ``hashed_tensors``."""
    return [(file, t.data_offset, t.n_bytes) for file, t in hashed_tensors(model)]


@dataclass(frozen=True)
class SeededTensor:
    """A by-hash tensor of a model this node seeded: where it lies, and the name and sha256 it was seeded under."""

    file: Path
    tensor: TensorInfo
    cache_name: str  # its FNV-1a: rpc-server's name for it
    sha256: str


def seeded_tensors(cache: WeightCache, model: Path, sha256: str) -> list[SeededTensor]:
    """The by-hash tensors of ``model`` (identity ``sha256``) with what seeding found them to hash to, as
    far as this cache holds them: what a serving node tells workers to expect (serve/layer_share.py)."""
    tensors = hashed_tensors(model)
    names = _seeded_names(cache.root / f"{SEEDED_PREFIX}{sha256}", len(tensors))
    ledger = _Ledger.read(cache)
    return [SeededTensor(file, tensor, name, ledger.tensors[name].sha256)
            for (file, tensor), name in zip(tensors, names, strict=True)
            if name is not None and name in ledger.tensors and name not in ledger.contested]


def holds(cache: WeightCache, cache_name: str, sha256: str) -> bool:
    """Whether the cache serves the tensor ``cache_name`` with these bytes already (seeded or fetched)."""
    seeded = _Ledger.read(cache).tensors.get(cache_name)
    return seeded is not None and seeded.sha256 == sha256 and (cache.tensors / cache_name).is_file()


def admit_fetched(cache: WeightCache, tool: Path, fetched: Path, cache_name: str, sha256: str,
                  fetched_for: str) -> bool:
    """Let the tensor whose bytes are all of ``fetched`` into the cache if they hash to ``cache_name`` and
    ``sha256`` (what serving node ``fetched_for``'s own copy hashes to); whether they did. ``fetched`` is
    removed. Such a tensor serves that node's loads only: ``drop_fetched`` takes it out before another's."""
    staging = cache.root / STAGING_DIR_NAME
    staging.mkdir(parents=True, exist_ok=True)
    try:
        (line,) = _run_tool(tool, "seed", str(fetched), str(staging), f"0:{fetched.stat().st_size}")
    finally:
        fetched.unlink(missing_ok=True)
    name, _, digest = line.split()
    staged = staging / name
    if (name, digest) != (cache_name, sha256):
        staged.unlink(missing_ok=True)
        return False
    ledger = _Ledger.read(cache)
    try:
        _admit(cache, ledger, staged, digest, fetched_for)
    finally:
        ledger.write(cache)
    return name in ledger.tensors


def drop_fetched(cache: WeightCache, keep_for: str = "") -> int:
    """Remove every tensor fetched for a serving node other than ``keep_for`` (all of them by default); how
    many. A member's share names bytes of its choosing, and FNV-1a names can be made to collide: what one
    serving node had fetched must never answer another's load."""
    ledger = _Ledger.read(cache)
    dropped = [name for name, seeded in ledger.tensors.items() if seeded.fetched_for not in ("", keep_for)]
    for name in dropped:
        (cache.tensors / name).unlink(missing_ok=True)
        del ledger.tensors[name]
    if dropped:
        ledger.write(cache)
    return len(dropped)


def ensure_tool(progress: ProgressCallback) -> Path:
    """The compiled helper, built on first use; SetupError if there is no C compiler or no libcrypto."""
    source = resources.files("mesh_sidecar.llama.native").joinpath(TOOL_SOURCE).read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    tool = cache_root() / "tools" / f"{TOOL_NAME}-{digest}"
    if tool.exists():
        return tool
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise SetupError("No C compiler (cc) found to build the weight-cache helper. "
                         f"On Debian/Ubuntu: sudo apt-get install gcc {OPENSSL_PACKAGE}")
    progress("Building the weight-cache helper", 0, 0)
    tool.parent.mkdir(parents=True, exist_ok=True)
    source_path = tool.with_suffix(".c")
    source_path.write_bytes(source)
    partial = tool.with_name(tool.name + ".partial")
    result = subprocess.run([compiler, "-O2", "-o", str(partial), str(source_path), "-lcrypto"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        hint = f" OpenSSL's headers are missing: sudo apt-get install {OPENSSL_PACKAGE}" if "openssl" in result.stderr \
            else ""
        raise SetupError(f"Building the weight-cache helper failed.{hint}\n{result.stderr.strip()[-2000:]}")
    partial.replace(tool)
    return tool


def verify(cache: WeightCache, progress: ProgressCallback) -> int:
    """Remove every tensor file that seeding did not write, or whose SHA-256 is no longer what seeding
    recorded; returns how many. Run before rpc-server starts: it serves whatever file has the right name.

    A file with the size and mtime of its last check is not hashed again: whoever could change its bytes and
    keep both can also rewrite the ledger, so hashing it on every start would buy nothing but minutes."""
    cache.create()
    ledger = _Ledger.read(cache)
    files = cache.tensor_files()
    unknown = [p for p in files if p.name not in ledger.tensors]
    changed = [p for p in files if p.name in ledger.tensors and not ledger.tensors[p.name].unchanged(p)]
    total = sum(p.stat().st_size for p in changed)
    done = 0
    altered = []
    for path in changed:
        seeded, stat = ledger.tensors[path.name], path.stat()
        if stat.st_size == seeded.size and file_sha256(path) == seeded.sha256:
            ledger.tensors[path.name] = dataclasses.replace(seeded, mtime_ns=stat.st_mtime_ns)
        else:
            altered.append(path)
        done += stat.st_size
        progress("Checking the weight cache", done, total)
    for path in unknown:
        log.warning("removed weight-cache file %s: this node did not seed it", path.name)
    for path in altered:
        log.warning("removed weight-cache file %s: its bytes are not those this node seeded", path.name)
    for path in unknown + altered:
        path.unlink()
    ledger.write(cache)
    return len(unknown) + len(altered)


def seed(cache: WeightCache, tool: Path, model: Path, sha256: str, progress: ProgressCallback) -> int:
    """Put every by-hash tensor of ``model`` in the cache: all of them the first time, then only those missing
    (``verify`` removed them, or they were deleted); returns bytes written. ``sha256`` is the model's identity,
    checked by whoever got the file."""
    cache.create()
    ranges = hashed_tensor_ranges(model)
    stamp = cache.root / f"{SEEDED_PREFIX}{sha256}"
    names = _seeded_names(stamp, len(ranges))
    ledger = _Ledger.read(cache)
    todo = [i for i, name in enumerate(names) if name is None or not ledger.settled(cache, name)]
    if not todo:
        return 0
    # The tool writes outside the cache, so that rpc-server never sees a tensor before it is checked here.
    staging = cache.root / STAGING_DIR_NAME
    shutil.rmtree(staging, ignore_errors=True)  # a crash's leftovers: one node seeds its cache at a time
    staging.mkdir()
    total = sum(ranges[i][2] for i in todo)
    done = 0
    try:
        for i in todo:
            file, offset, size = ranges[i]
            (line,) = _run_tool(tool, "seed", str(file), str(staging), f"{offset}:{size}")
            name, _, digest = line.split()
            _admit(cache, ledger, staging / name, digest)
            names[i] = name
            done += size
            progress(f"Seeding the weight cache from {model.name}", done, total)
    finally:
        ledger.write(cache)  # what was admitted stays known, even if a later tensor failed
    staging.rmdir()
    stamp.write_text(json.dumps({"model": str(model), "tensors": names}))
    return total


def _seeded_names(stamp: Path, count: int) -> list[str | None]:
    """The name each by-hash tensor of a model was seeded under, in order; None where not known."""
    names = _read_json(stamp).get("tensors")
    if isinstance(names, list) and len(names) == count and all(isinstance(name, str) for name in names):
        return list(names)
    return [None] * count


def _admit(cache: WeightCache, ledger: _Ledger, staged: Path, sha256: str, fetched_for: str = "") -> None:
    """Move a tensor the tool wrote to ``staged`` into the cache, unless its name is another tensor's."""
    name, target = staged.name, cache.tensors / staged.name
    seeded = ledger.tensors.get(name)
    if name in ledger.contested or (seeded is not None and seeded.sha256 != sha256):
        # Two different tensors with one FNV-1a name: by chance, or a model made to collide with another's
        # weights. rpc-server would serve either for both, so neither is served from the cache, now or later.
        log.warning("weight-cache name %s belongs to two different tensors: neither is cached", name)
        staged.unlink()
        target.unlink(missing_ok=True)
        ledger.tensors.pop(name, None)
        ledger.contested.add(name)
        return
    staged.replace(target)
    stat = target.stat()
    ledger.tensors[name] = _Seeded(stat.st_size, sha256, stat.st_mtime_ns, fetched_for)


def _run_tool(tool: Path, *args: str) -> list[str]:
    result = subprocess.run([str(tool), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SetupError(f"The weight-cache helper failed: {result.stderr.strip()[-2000:]}")
    return result.stdout.splitlines()


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
