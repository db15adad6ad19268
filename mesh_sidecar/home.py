"""Where a node keeps its state, and where the shared caches live.

A node's home (``--home`` / ``MESH_HOME``) holds its identity, logs and the
control file that ``mesh-inference status`` reads; several nodes on one machine
use distinct homes. Caches (the llama.cpp build, the default model) are shared
by every node of a user and live under ``MESH_CACHE`` or ``~/.cache``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import environment

DEFAULT_HOME = Path("~/.local/share/mesh-inference")
DEFAULT_CACHE = Path("~/.cache/mesh-inference")
CONTROL_FILE_NAME = "control.json"


def write_private_file(path: Path, data: bytes | str) -> None:
    """Write ``path`` readable by this user only (0600 from creation), replacing it atomically.

    The bytes go to ``<path>.partial`` first, so a reader never sees half a file.
    """
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    partial.replace(path)


def cache_root() -> Path:
    """The shared cache directory (llama.cpp builds, models)."""
    return (environment.cache_dir() or DEFAULT_CACHE).expanduser()


@dataclass(frozen=True)
class NodeHome:
    """The state directory of one node."""

    root: Path

    @classmethod
    def resolve(cls, home: Path | None) -> NodeHome:
        """``--home`` if given, else ``MESH_HOME``, else the per-user default."""
        chosen = home or environment.home_dir() or DEFAULT_HOME
        return cls(chosen.expanduser().resolve())

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def control_file(self) -> Path:
        """JSON with the pid and the 127.0.0.1 port of the running node's control endpoint."""
        return self.root / CONTROL_FILE_NAME

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.logs.mkdir(exist_ok=True)
