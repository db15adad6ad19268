"""Per-process log files in a node's home: size-capped, rotated, tailed and followed.

Each process of a node has one current file under ``<home>/logs``: the
sidecar's own ``sidecar.log`` (a ``RotatingFileHandler``, see ``cli.py``) and
one per child (``rpc-server.log``, ``llama-server.log``). A child's stdout and
stderr go to a pipe that :func:`pump_lines` copies, line by line, into a
:class:`CappedLogFile`. Files rotate like ``RotatingFileHandler`` does:
``x.log`` becomes ``x.log.1``, ``x.log.1`` becomes ``x.log.2``, and the oldest
backup is dropped, so a process never holds more than about
``max_bytes * (backups + 1)`` on disk.

What goes in: the children's own output only. llama-server runs at a log
verbosity that reports sizes and timings, never prompt text, and neither the
sidecar nor rpc-server logs prompts or activations.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol, Self

if TYPE_CHECKING:  # `logs` reads these files without an event loop: asyncio only for the node's pump
    import asyncio

log = logging.getLogger(__name__)

CHILD_LOG_MAX_BYTES = 10 * 1024 * 1024
CHILD_LOG_BACKUPS = 2
# One line longer than this is cut, so a runaway line cannot blow the cap.
MAX_LINE_BYTES = 8 * 1024
TRUNCATED_MARK = b" [line truncated]"
LOG_SUFFIX = ".log"
SIDECAR_LOG_NAME = "sidecar.log"
PUMP_READ_BYTES = 64 * 1024
FOLLOW_POLL_S = 0.25
_TAIL_BLOCK = 64 * 1024


def backup_path(path: Path, index: int) -> Path:
    """``x.log.<index>``: the index-th most recent rotated-out file of ``x.log``."""
    return path.with_name(f"{path.name}.{index}")


class CappedLogFile:
    """An append-only log file holding at most ``max_bytes``, with ``backups`` rotated files.

    Writes go straight to the file (no buffering in this process), whole lines
    at a time; a file rotates before a line that would take it past the cap.
    """

    def __init__(self, path: Path, max_bytes: int = CHILD_LOG_MAX_BYTES,
                 backups: int = CHILD_LOG_BACKUPS) -> None:
        if max_bytes <= 0 or backups < 0:
            raise ValueError("max_bytes must be positive and backups not negative")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self._fd).st_size

    @property
    def closed(self) -> bool:
        return self._fd is None

    def rotate(self) -> None:
        """Start a new, empty current file, shifting the backups (the oldest is dropped)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                if backup_path(self.path, i).exists():
                    os.replace(backup_path(self.path, i), backup_path(self.path, i + 1))
            if self.path.exists():
                os.replace(self.path, backup_path(self.path, 1))
        self._open()

    def write_line(self, line: bytes | str) -> None:
        """Append one line (a newline is added if it lacks one), rotating first if it would not fit."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        data = line.encode(errors="replace") if isinstance(line, str) else line
        if not data.endswith(b"\n"):
            data += b"\n"
        if self.size > 0 and self.size + len(data) > self.max_bytes:
            self.rotate()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            self.size += written
            view = view[written:]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LineSink(Protocol):
    """Where :func:`pump_lines` copies lines to: a :class:`CappedLogFile`, or one that also watches them."""

    path: Path  # named in the warning when a write fails

    def write_line(self, line: bytes | str) -> None: ...


def _cut(line: bytes, max_line: int) -> bytes:
    return line[:max_line] + TRUNCATED_MARK if len(line) > max_line else line


async def pump_lines(reader: asyncio.StreamReader, log_file: LineSink,
                     max_line: int = MAX_LINE_BYTES) -> None:
    """Copy ``reader``'s lines into ``log_file`` until end of file.

    Reads as fast as data comes so the writer never blocks on a full pipe:
    lines longer than ``max_line`` are cut (the rest, up to the next newline,
    is dropped), and a failing write (disk full) loses that line, not the pipe.
    A last line without a newline is written at end of file.
    """
    partial = b""
    dropping = False  # inside an over-long line whose head was written already
    write_failed = False

    def write(line: bytes) -> None:
        nonlocal write_failed
        try:
            log_file.write_line(line)
        except (OSError, ValueError) as exc:
            if not write_failed:
                log.warning("cannot write %s: %s; dropping its lines", log_file.path, exc)
            write_failed = True
        else:
            write_failed = False

    while True:
        chunk = await reader.read(PUMP_READ_BYTES)
        if not chunk:
            break
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            if dropping:
                dropping = False
            else:
                write(_cut(partial + chunk[start:end], max_line))
            partial = b""
            start = end + 1
        if not dropping:
            partial += chunk[start:]
            if len(partial) > max_line:
                write(_cut(partial, max_line))
                partial, dropping = b"", True
    if partial and not dropping:
        write(partial)


def log_files(logs_dir: Path) -> list[Path]:
    """The current log file of each process (``sidecar.log`` first), not the rotated backups."""
    try:
        found = [p for p in logs_dir.iterdir() if p.name.endswith(LOG_SUFFIX) and p.is_file()]
    except OSError:
        return []
    return sorted(found, key=lambda p: (p.name != SIDECAR_LOG_NAME, p.name))


def _last_lines(f: BinaryIO, end: int, n: int) -> tuple[list[bytes], bytes, bool]:
    """The last ``n`` complete lines of the open binary file ``f`` before offset ``end``.

    Also the text after the last newline (a line still being written), and
    whether the file holds fewer than ``n`` lines (older ones may be in a backup).
    """
    data = b""
    pos = end
    while pos > 0 and data.count(b"\n") <= n:
        step = min(_TAIL_BLOCK, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
    *lines, trailing = data.split(b"\n")
    if pos > 0:
        lines = lines[1:]  # may have started mid-line
    return (lines[-n:] if n > 0 else []), trailing, pos == 0 and len(lines) < n


def tail(path: Path, n: int, *, backups: bool = True) -> list[str]:
    """The last ``n`` lines of ``path`` (without newlines), reaching into ``path.1``,
    ``path.2``... when the current file has fewer (right after a rotation)."""
    if n <= 0:
        return []
    lines: list[bytes] = []
    candidates = [path] + ([backup_path(path, i) for i in range(1, 100)] if backups else [])
    for candidate in candidates:
        try:
            with open(candidate, "rb") as f:
                got, trailing, short = _last_lines(f, os.fstat(f.fileno()).st_size, n - len(lines))
        except OSError:
            break
        lines = got + ([trailing] if trailing else []) + lines
        if not short or len(lines) >= n:
            break
    return [line.decode(errors="replace") for line in lines[-n:]]


class _Followed:
    """One file being followed: reopened when it is rotated (new inode) or truncated."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f: BinaryIO | None = None
        self.ino: int | None = None
        self.pos = 0
        self.partial = b""

    def open(self, at_end: bool) -> bool:
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - kept open while following
        except OSError:
            return False
        st = os.fstat(f.fileno())
        self.f, self.ino = f, st.st_ino
        self.pos = st.st_size if at_end else 0
        self.partial = b""
        return True

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None

    def _read_new(self) -> list[bytes]:
        assert self.f is not None
        size = os.fstat(self.f.fileno()).st_size
        if size < self.pos:  # truncated in place: read it from the start
            self.pos, self.partial = 0, b""
        if size == self.pos:
            return []
        self.f.seek(self.pos)
        data = self.f.read(size - self.pos)
        self.pos += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return lines

    def poll(self) -> list[bytes]:
        """Lines appended since the last poll, including those written just before a rotation."""
        if self.f is None:
            return self._read_new() if self.open(at_end=False) else []
        # Look at the name first: if it moved on, the old file is complete when read below.
        try:
            current = os.stat(self.path).st_ino
        except OSError:
            current = None  # mid-rotation: reopen when the new file appears
        lines = self._read_new()
        if current != self.ino:
            if self.partial:
                lines.append(self.partial)
            self.close()
            if current is not None and self.open(at_end=False):
                lines += self._read_new()
        return lines


def follow(paths: Sequence[Path], *, lines: int = 0, poll_s: float = FOLLOW_POLL_S,
           stop: Callable[[], bool] | None = None) -> Iterator[tuple[Path, str]]:
    """Yield ``(path, line)`` for lines appended to ``paths``, like ``tail -F``.

    First the last ``lines`` lines already in each file, then new lines as they
    are written (polled every ``poll_s``), across rotations and truncations; a
    file that does not exist yet is picked up when it appears. Runs until
    ``stop()`` returns true (checked between polls) or the caller stops iterating.
    """
    followed = [_Followed(Path(p)) for p in paths]
    try:
        for item in followed:
            if item.open(at_end=True):
                assert item.f is not None
                recent, item.partial, _ = _last_lines(item.f, item.pos, lines)
                for line in recent:
                    yield item.path, line.decode(errors="replace")
        while stop is None or not stop():
            quiet = True
            for item in followed:
                for line in item.poll():
                    quiet = False
                    yield item.path, line.decode(errors="replace")
            if quiet:
                time.sleep(poll_s)
    finally:
        for item in followed:
            item.close()
