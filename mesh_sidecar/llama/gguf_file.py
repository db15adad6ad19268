"""A GGUF file's header, read by mapping the file: only the pages the header spans are read."""

from __future__ import annotations

import mmap
from pathlib import Path

from ..errors import ModelError
from ..wire.gguf_header import GGUFHeader, parse_header


def read_header(path: Path) -> GGUFHeader:
    """``path``'s header; ModelError if it cannot be read as a GGUF."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, \
                memoryview(mapped) as view:
            return parse_header(view, str(path))
    except ValueError as exc:  # mmap of an empty file
        raise ModelError(f"{path} is empty: it is not a GGUF file.") from exc
    except OSError as exc:
        raise ModelError(f"Cannot read {path}: {exc.strerror}.") from exc
