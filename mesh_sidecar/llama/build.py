"""The pinned llama.cpp: find a user's build, or fetch and build ours once.

Our pin is the ``vendor/llama.cpp`` tree inside the ``llama-cpp-python`` sdist on
PyPI (RPC protocol 7.0.0), checked by its sha256 and kept in ``<cache>/sources``:
members offer it over the mesh to a member that cannot reach PyPI
(``offered_source``; mesh/source_fetch.py fetches it). ``ensure_binaries`` builds the
two targets we run, ``ggml-rpc-server`` and ``llama-server``, into
``<cache>/llama.cpp-<pin>-.../bin`` and is instant once that directory is complete.

Every build applies ``llama/patches/llama.cpp-rpc-cache-read-only.patch``: rpc-server's
weight cache (``-c``) is only read, never written from the network (patches/README.md;
llama/weight_cache.py seeds it). Two builds of the pin (``BuildVariant``): ``stock``, with that
patch alone, and ``b2b`` (``--b2b``), with ``llama/patches/llama.cpp-b2b.patch`` too, so
workers push activations to each other.

Each is built for one compute backend (``llama/backends.py``: cpu, vulkan, cuda, metal;
``BuildVariant.on``). A build's directory is keyed by every patch it applies, by hash, so a
changed patch is a new build: ``llama.cpp-0.3.36-cache-ro-<hash>`` for cpu, a GPU backend's
adds its name and the hash of the source fix it needs, if any
(``llama.cpp-0.3.36-cache-ro-<hash>-vulkan-<hash>``), then b2b's. Its toolkit is checked
before cmake runs.

Build choices, and why:
- ``GGML_RPC=ON``: the RPC backend is the whole point.
- ``GGML_NATIVE=ON`` with AMX switched off: native code is fast on the machine
  that built it, but some CPUs (and VMs) report AMX without the kernel granting
  it, and AMX kernels then die with SIGILL. Turning AMX off at compile time makes
  that impossible instead of relying on a launch flag.
- static linking: the two binaries can be copied into ``bin/`` and run alone.
- no OpenSSL, no web UI download: the build must work without internet access
  beyond PyPI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .. import environment
from ..errors import BinariesMissingError, BuildError, SourceUnavailableError
from ..home import cache_root
from ..progress import ProgressCallback
from .backends import CPU, Backend, check_toolkit
from .model import file_sha256

LLAMA_CPP_PYTHON_PIN = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_PIN}.tar.gz"
# The sdist as PyPI serves it: what a download, or a fetch from a member, must hash to.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SOURCES_DIR_NAME = "sources"
SDIST_VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_PIN}/vendor/llama.cpp/"
RPC_SERVER_BINARY = "ggml-rpc-server"
LLAMA_SERVER_BINARY = "llama-server"
BUILD_TARGETS = (RPC_SERVER_BINARY, LLAMA_SERVER_BINARY)
# llama.cpp's own splitter of GGUF files into shards (and merger): built on demand, in the same tree.
GGUF_SPLIT_BINARY = "llama-gguf-split"
BUILD_STAMP_NAME = "BUILD_INFO.json"
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}",
)
BUILD_LOG_TAIL_LINES = 25
_NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
COMPILE_STAGE = "Compiling llama.cpp"
UNPACK_REPORT_EVERY = 500  # source files

# The patches ship inside the package (package data), so an installed wheel can build.
PATCHES_DIR = Path(__file__).resolve().parent / "patches"
B2B_PATCH_NAME = "llama.cpp-b2b.patch"
READ_ONLY_CACHE_PATCH = PATCHES_DIR / "llama.cpp-rpc-cache-read-only.patch"  # in every build
PATCH_KEY_HEX_CHARS = 12


@dataclass(frozen=True)
class BuildVariant:
    """One build of the pinned source: as published, or with one of our patches applied; for one backend."""

    name: str
    patch: Path | None = None
    backend: Backend = CPU

    def on(self, backend: Backend) -> BuildVariant:
        """This variant built for ``backend``."""
        return dataclasses.replace(self, backend=backend)

    @property
    def backend_patch(self) -> Path | None:
        """The fix the pinned source needs to build for this backend, if any."""
        return None if self.backend.patch_name is None else PATCHES_DIR / self.backend.patch_name

    def patches(self) -> tuple[Path, ...]:
        """Every patch applied to the pinned source for this build, in order."""
        return tuple(patch for patch in (READ_ONLY_CACHE_PATCH, self.backend_patch, self.patch) if patch is not None)

    def cmake_options(self) -> tuple[str, ...]:
        return CMAKE_OPTIONS + self.backend.cmake_options

    def key(self) -> str:
        """The build directory's name: the pin and the read-only cache patch's hash; a GPU backend's name (and
        its fix's hash); a patch's name and hash."""
        key = f"llama.cpp-{LLAMA_CPP_PYTHON_PIN}-cache-ro-{_patch_digest(READ_ONLY_CACHE_PATCH)}"
        if self.backend != CPU:
            key += f"-{self.backend.name}"
            if self.backend_patch is not None:
                key += f"-{_patch_digest(self.backend_patch)}"
        if self.patch is not None:
            key += f"-{self.name}-{_patch_digest(self.patch)}"
        return key


def _patch_digest(patch: Path) -> str:
    if not patch.is_file():
        raise BinariesMissingError(
            f"This build needs {patch}, which ships inside the mesh-inference package: reinstall it, "
            "or pass --llama-bin.")
    return hashlib.sha256(patch.read_bytes()).hexdigest()[:PATCH_KEY_HEX_CHARS]


STOCK = BuildVariant("stock")
B2B = BuildVariant("b2b", PATCHES_DIR / B2B_PATCH_NAME)


@dataclass(frozen=True)
class LlamaBinaries:
    """Paths of the two llama.cpp programs a node runs."""

    rpc_server: Path
    llama_server: Path

    @property
    def directory(self) -> Path:
        return self.rpc_server.parent


def pinned_build_dir(variant: BuildVariant = STOCK) -> Path:
    """Cache directory of a build of our pin, keyed by the pin (and backend, and patch)."""
    return cache_root() / variant.key()


def binaries_in(directory: Path) -> LlamaBinaries:
    """The binaries in ``directory``; BinariesMissingError naming what is absent."""
    found = {name: directory / name for name in BUILD_TARGETS}
    missing = [name for name, path in found.items() if not (path.is_file() and os.access(path, os.X_OK))]
    if missing:
        raise BinariesMissingError(
            f"{directory} has no executable {' or '.join(missing)}. Point --llama-bin "
            f"(or {environment.LLAMA_BIN_ENV}) at a llama.cpp build's bin/ directory built with "
            f"-DGGML_RPC=ON, or leave it unset to use the pinned build (`mesh-inference setup`)."
        )
    return LlamaBinaries(found[RPC_SERVER_BINARY], found[LLAMA_SERVER_BINARY])


def ensure_binaries(llama_bin: Path | None, progress: ProgressCallback,
                    variant: BuildVariant = STOCK) -> LlamaBinaries:
    """A user's build if named (flag or env), else the pinned build, built if needed."""
    chosen = llama_bin or environment.llama_bin_dir()
    if chosen is not None:
        return binaries_in(chosen.expanduser())
    return binaries_in(_pinned_bin_dir(variant, progress))


def ensure_gguf_split(progress: ProgressCallback) -> Path:
    """llama.cpp's ``llama-gguf-split`` from the pinned source, built once (seconds, in the pinned build's
    tree, after the build itself if need be) beside its other binaries."""
    bin_dir = _pinned_bin_dir(STOCK, progress)
    tool = bin_dir / GGUF_SPLIT_BINARY
    if tool.is_file():
        return tool
    root = bin_dir.parent
    with _build_lock(root), open(root / "build.log", "a") as log:
        if not tool.is_file():
            progress(COMPILE_STAGE, 0, 0)
            _run_logged(["ninja", "-C", str(root / "build"), GGUF_SPLIT_BINARY], log, root / "build.log",
                        on_line=ninja_reporter(progress))
            shutil.copy2(root / "build" / "bin" / GGUF_SPLIT_BINARY, tool)
    return tool


def _pinned_bin_dir(variant: BuildVariant, progress: ProgressCallback) -> Path:
    """The ``bin`` directory of the pinned build ``variant``, built first if it is not complete."""
    root = pinned_build_dir(variant)
    bin_dir = root / "bin"
    if not (bin_dir / BUILD_STAMP_NAME).exists():
        with _build_lock(root):
            if not (bin_dir / BUILD_STAMP_NAME).exists():
                _build(root, progress, variant)
    return bin_dir


@contextlib.contextmanager
def _build_lock(root: Path) -> Iterator[None]:
    """Several nodes started at once on one machine must not build twice in one tree."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build(root: Path, progress: ProgressCallback, variant: BuildVariant) -> None:
    check_toolkit(variant.backend)
    source = root / "src"
    if not (source / "CMakeLists.txt").exists():
        _fetch_source(source, progress, variant)
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise BuildError(
                f"`{tool}` is not installed; it is needed to build llama.cpp. "
                "On Debian/Ubuntu: sudo apt-get install cmake ninja-build g++"
            )
    build = root / "build"
    log_path = root / "build.log"
    with open(log_path, "w") as log:
        progress("Configuring llama.cpp", 0, 0)
        _run_logged(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *variant.cmake_options()],
                    log, log_path)
        progress(COMPILE_STAGE, 0, 0)
        _run_logged(
            ["ninja", "-C", str(build), *BUILD_TARGETS], log, log_path,
            on_line=ninja_reporter(progress),
        )
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in BUILD_TARGETS:
        shutil.copy2(build / "bin" / name, bin_dir / name)
    # Written last: its presence means the directory is complete.
    (bin_dir / BUILD_STAMP_NAME).write_text(
        json.dumps({"llama_cpp_python": LLAMA_CPP_PYTHON_PIN, "variant": variant.name,
                    "backend": variant.backend.name, "patches": [patch.name for patch in variant.patches()],
                    "cmake_options": variant.cmake_options()}, indent=2)
    )


def ninja_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from a ninja status line (``[12/345] Building CXX object ...``), else None."""
    match = _NINJA_PROGRESS.match(line)
    if match is None or int(match.group(2)) == 0:
        return None
    return int(match.group(1)), int(match.group(2))


def ninja_reporter(progress: ProgressCallback) -> Callable[[str], None]:
    """A build's output lines to ``progress``, as (done, total) from ninja's status lines. A sub-build's own
    (the Vulkan shader generator's ``[2/2]``, in the middle of ``[48/534]``) would read as the end: only
    lines with the largest total seen so far count."""
    largest_total = 0

    def report(line: str) -> None:
        nonlocal largest_total
        if (step := ninja_progress(line)) is not None and step[1] >= largest_total:
            largest_total = step[1]
            progress(COMPILE_STAGE, *step)

    return report


def _run_logged(
    command: list[str], log, log_path: Path, on_line: Callable[[str], None] | None = None
) -> None:
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        if on_line:
            on_line(line)
    if proc.wait() != 0:
        log.flush()
        tail = log_path.read_text(errors="replace").splitlines()[-BUILD_LOG_TAIL_LINES:]
        raise BuildError(
            f"`{command[0]}` failed (exit {proc.returncode}) while building llama.cpp.\n"
            + "\n".join(tail)
            + f"\nFull log: {log_path}. Fix the cause above and run `mesh-inference setup` again."
        )


def _fetch_source(source: Path, progress: ProgressCallback, variant: BuildVariant) -> None:
    """The pinned source in ``source``, patched for ``variant``; complete or absent, never half-made."""
    staging = source.with_name("src.partial")
    shutil.rmtree(staging, ignore_errors=True)
    _unpack_source(staging, progress)  # every build's tree is patched: none is the pristine source to copy
    # The sdist's tree carries a `.git` file pointing at a repository that is not there; git apply
    # would follow it and refuse to run.
    gitlink = staging / ".git"
    if gitlink.is_file():
        gitlink.unlink()
    if shutil.which("git") is None:  # every build applies at least the read-only cache patch
        raise BuildError("`git` is not installed; it is needed to patch llama.cpp before building it. "
                         "On Debian/Ubuntu: sudo apt-get install git")
    for patch in variant.patches():
        progress(f"Applying {patch.name}", 0, 0)
        result = subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)], cwd=staging,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"{patch.name} does not apply to llama.cpp from llama-cpp-python=="
                             f"{LLAMA_CPP_PYTHON_PIN}:\n{result.stderr.strip()[-2000:]}\n"
                             "Rebase it onto the pinned source (patches/README.md; for the b2b patch: "
                             "scripts/rebase_b2b_patch.sh).")
    staging.rename(source)


def source_archive_path() -> Path:
    """Where the pinned source's sdist is kept once downloaded or fetched (complete and checked, or absent)."""
    return cache_root() / SOURCES_DIR_NAME / SDIST_NAME


def offered_source(sha256: str) -> Path | None:
    """The kept sdist, when ``sha256`` names it: what a member offers one that cannot download it."""
    path = source_archive_path()
    return path if sha256 == SDIST_SHA256 and path.is_file() else None


def place_source_archive(candidate: Path) -> Path:
    """Keep ``candidate`` as the pinned sdist once it hashes to SDIST_SHA256 (BuildError, and it is removed,
    if it does not); its new path."""
    actual = file_sha256(candidate)
    if actual != SDIST_SHA256:
        candidate.unlink()
        raise BuildError(f"The llama.cpp source archive has sha256 {actual}, not the pinned {SDIST_SHA256}; it was "
                         "discarded. Whoever served it does not serve llama-cpp-python=="
                         f"{LLAMA_CPP_PYTHON_PIN} as published.")
    path = source_archive_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate.replace(path)
    return path


def ensure_source_archive(progress: ProgressCallback) -> Path:
    """The pinned sdist: kept, else downloaded from PyPI and checked (SourceUnavailableError if it cannot be)."""
    path = source_archive_path()
    if path.is_file():
        return path
    progress(f"Downloading llama-cpp-python=={LLAMA_CPP_PYTHON_PIN} source from PyPI", 0, 0)
    with tempfile.TemporaryDirectory(prefix="mesh-llama-src-") as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON_PIN}", "-d", tmp],
            capture_output=True, text=True,
        )
        sdist = Path(tmp) / SDIST_NAME
        if result.returncode != 0 or not sdist.exists():
            raise SourceUnavailableError(
                f"Could not download the llama.cpp source (llama-cpp-python=={LLAMA_CPP_PYTHON_PIN}) "
                f"from PyPI:\n{result.stderr.strip()[-2000:]}\nFix the network or pip's index settings; or "
                "join a mesh whose members built it (--join TICKET): the source is then taken from the member "
                "the ticket names, checked by its sha256, and built here; or pass --llama-bin with your own "
                "llama.cpp build."
            )
        progress("Checking the llama.cpp source's sha256", 0, 0)
        staged = path.with_name(path.name + ".download")
        staged.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(sdist, staged)
    return place_source_archive(staged)


def _unpack_source(staging: Path, progress: ProgressCallback) -> None:
    archive = ensure_source_archive(progress)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(SDIST_VENDOR_PREFIX)]
        for i, member in enumerate(members):
            member.name = member.name[len(SDIST_VENDOR_PREFIX):]
            if member.name:
                tar.extract(member, staging, filter="data")
            if i % UNPACK_REPORT_EVERY == 0 or i + 1 == len(members):
                progress("Unpacking llama.cpp source", i + 1, len(members))
