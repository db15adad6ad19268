"""The native data relay's build: compiled once per source version with cmake and ninja, cached.

The sources are net/data_plane/native/ (CMakeLists.txt, the C files); the binary lands in the shared cache
under a name that carries the sources' digest, so a changed relay is built again and two versions
never mix. Built by ``mesh-inference setup`` and, when missing, at a node's start. The relay holds the
node's key, so a cached binary is run only if this user owns it and no one else can write it or its
folder (``verify_data_relay``): one of ours that others could write is built again, any other refused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from ...errors import SetupError
from ...home import cache_root
from ...progress import ProgressCallback

BINARY_NAME = "mesh-data-relay"
_SOURCES_PACKAGE = "mesh_sidecar.net.data_plane.native"
_SOURCE_SUFFIXES = (".c", ".h", ".txt")
OPENSSL_PACKAGE = "libssl-dev"


def _sources() -> dict[str, bytes]:
    folder = resources.files(_SOURCES_PACKAGE)
    return {entry.name: entry.read_bytes() for entry in folder.iterdir()
            if entry.is_file() and entry.name.endswith(_SOURCE_SUFFIXES)}


def data_relay_path() -> Path:
    """Where this version of the relay is (or will be) built."""
    digest = hashlib.sha256()
    for name, data in sorted(_sources().items()):
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return cache_root() / "tools" / f"{BINARY_NAME}-{digest.hexdigest()[:12]}"


def _unsafe(path: Path) -> str | None:
    """Why ``path`` may not be trusted to run as us (another user's, or others may write it), or None."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if info.st_uid != os.getuid():
        return f"belongs to user id {info.st_uid}, not to you ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "can be written by other users"
    return None


def verify_data_relay(binary: Path) -> None:
    """SetupError unless ``binary`` and its folder are this user's and no one else's to write: checked
    before each start, since the relay is handed the node's key."""
    for path in (binary.parent, binary):
        if (why := _unsafe(path)) is not None:
            fix = f"rm {path}" if path == binary else f"chmod go-w {path}, as its owner"
            raise SetupError(f"The native data relay is not run: {path} {why} (the relay holds this node's key). "
                             f"Fix it ({fix}) and run mesh-inference setup again.")


def ensure_data_relay(progress: ProgressCallback) -> Path:
    """The relay's binary, built on first use; SetupError saying what is missing if it cannot be."""
    binary = data_relay_path()
    binary.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if binary.parent.stat().st_uid == os.getuid():  # our cache: no one else may write where the relay is
        binary.parent.chmod(stat.S_IMODE(binary.parent.stat().st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    if binary.exists():
        if binary.stat().st_uid == os.getuid() and _unsafe(binary) is not None:
            binary.unlink()  # ours, but others could have written it: built again below
        else:
            verify_data_relay(binary)
            return binary
    missing = [tool for tool in ("cmake", "ninja", "cc") if shutil.which(tool) is None]
    if missing:
        raise SetupError(f"Building the native data relay needs {', '.join(missing)}. On Debian/Ubuntu: "
                         f"sudo apt-get install cmake ninja-build gcc {OPENSSL_PACKAGE}")
    progress("Building the native data relay", 0, 0)
    with tempfile.TemporaryDirectory(prefix="mesh-data-relay-") as work:
        source = Path(work) / "src"
        source.mkdir()
        for name, data in _sources().items():
            (source / name).write_bytes(data)
        build = Path(work) / "build"
        for argv in (["cmake", "-G", "Ninja", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
                     ["ninja", "-C", str(build)]):
            result = subprocess.run(argv, capture_output=True, text=True)
            if result.returncode != 0:
                output = (result.stdout + result.stderr).strip()[-2000:]
                hint = (f" OpenSSL's headers are missing: sudo apt-get install {OPENSSL_PACKAGE}"
                        if "OpenSSL" in output or "openssl/" in output else "")
                raise SetupError(f"Building the native data relay failed.{hint}\n{output}")
        partial = binary.with_name(f"{binary.name}.{os.getpid()}.partial")  # two nodes may build at once
        shutil.copy2(build / BINARY_NAME, partial)
        partial.chmod(0o755)
        partial.replace(binary)
    progress("Building the native data relay", 1, 1)
    verify_data_relay(binary)
    return binary
