"""Per-process log files: capped and rotated, fed from a pipe, tailed and followed (real
children: tests/integration/test_logs.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mesh_sidecar.logs import (
    MAX_LINE_BYTES,
    TRUNCATED_MARK,
    CappedLogFile,
    backup_path,
    follow,
    log_files,
    pump_lines,
    tail,
)


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()


def all_lines(path: Path, backups: int) -> list[str]:
    """Every kept line, oldest first: path.N ... path.1, path."""
    kept = [backup_path(path, i) for i in range(backups, 0, -1)] + [path]
    return [line for p in kept if p.exists() for line in lines_of(p)]


def assert_consecutive(lines: list[str], last: int) -> None:
    numbers = [int(line.split()[1]) for line in lines]
    assert numbers == list(range(last - len(numbers) + 1, last + 1))


# --- CappedLogFile


def test_capped_file_rotates_at_the_cap_and_keeps_n_backups(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    cap, backups = 1000, 2
    with CappedLogFile(path, max_bytes=cap, backups=backups) as log:
        for i in range(500):
            log.write_line(f"line {i} " + "." * (i % 40))
            files = [path] + [backup_path(path, k) for k in range(1, 5)]
            sizes = [p.stat().st_size for p in files if p.exists()]
            assert all(size <= cap for size in sizes)
            assert sum(sizes) <= cap * (backups + 1) + 60
    assert backup_path(path, 2).exists() and not backup_path(path, 3).exists()
    assert lines_of(path)[-1].startswith("line 499 ")
    kept = all_lines(path, backups)
    assert_consecutive(kept, 499)
    assert len(kept) > 2 * len(lines_of(path))  # the backups hold older lines


def test_capped_file_without_backups_starts_over(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    with CappedLogFile(path, max_bytes=100, backups=0) as log:
        for i in range(50):
            log.write_line(f"line {i}")
    assert path.stat().st_size <= 100
    assert lines_of(path)[-1] == "line 49"
    assert not backup_path(path, 1).exists()


def test_capped_file_appends_to_an_existing_file_and_counts_it(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_text("a" * 90 + "\n")
    with CappedLogFile(path, max_bytes=100, backups=1) as log:
        assert log.size == 91
        log.write_line(b"short")  # fits: 91 + 6 <= 100
        log.write_line("next one\n")  # would not: rotates first
    assert lines_of(backup_path(path, 1)) == ["a" * 90, "short"]
    assert lines_of(path) == ["next one"]


# --- pump_lines


async def pumped(chunks: list[bytes], tmp_path: Path, **kwargs) -> list[str]:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    reader.feed_eof()
    path = tmp_path / "pump.log"
    with CappedLogFile(path, **kwargs) as log:
        await pump_lines(reader, log)
    return lines_of(path)


async def test_pump_joins_split_lines_and_keeps_a_last_unterminated_one(tmp_path: Path) -> None:
    assert await pumped([b"he", b"llo\nwor", b"ld\n\nta", b"il"], tmp_path) == ["hello", "world", "", "tail"]


async def test_pump_cuts_over_long_lines(tmp_path: Path) -> None:
    huge = b"x" * (MAX_LINE_BYTES * 5)
    lines = await pumped([b"before\n", huge[:1000], huge[1000:], b"\nafter\n", huge], tmp_path)
    cut = "x" * MAX_LINE_BYTES + TRUNCATED_MARK.decode()
    assert lines == ["before", cut, "after", cut]


async def test_one_huge_line_cannot_blow_the_cap(tmp_path: Path) -> None:
    await pumped([b"y" * 10_000_000 + b"\n"] * 3, tmp_path, max_bytes=64 * 1024, backups=1)
    sizes = [p.stat().st_size for p in tmp_path.iterdir()]
    assert sum(sizes) <= 3 * (MAX_LINE_BYTES + len(TRUNCATED_MARK) + 1)


# --- log_files, tail, follow


def test_log_files_lists_one_current_file_per_process(tmp_path: Path) -> None:
    for name in ["rpc-server.log", "rpc-server.log.1", "llama-server.log", "sidecar.log", "sidecar.log.2",
                 "notes.txt"]:
        (tmp_path / name).write_text("x\n")
    assert [p.name for p in log_files(tmp_path)] == ["sidecar.log", "llama-server.log", "rpc-server.log"]
    assert log_files(tmp_path / "missing") == []


def test_tail_reaches_into_backups(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    assert tail(path, 5) == []
    with CappedLogFile(path, max_bytes=100, backups=3) as log:
        for i in range(40):
            log.write_line(f"line {i}")
        assert tail(path, 3) == ["line 37", "line 38", "line 39"]
        log.rotate()
        log.write_line("line 40")
    assert tail(path, 3) == ["line 38", "line 39", "line 40"]
    assert tail(path, 3, backups=False) == ["line 40"]
    assert tail(path, 0) == []
    assert_consecutive(tail(path, 1000), 40)


def test_tail_of_a_big_file_without_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_text("".join(f"{'y' * 999}{i}\n" for i in range(300)) + "partial")
    assert tail(path, 2) == ["y" * 999 + "299", "partial"]


def take(it, n: int) -> list[str]:
    """The next n lines from a follow() generator."""
    got = []
    for _ in range(n):
        item = next(it, None)
        assert item is not None, f"follow gave up after {got}"
        got.append(item[1])
    return got


def test_follow_sees_appended_lines_and_survives_rotation(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    other = tmp_path / "later.log"
    log = CappedLogFile(path, max_bytes=60, backups=1)
    for i in range(3):
        log.write_line(f"old {i}")
    give_up = time.monotonic() + 30  # a missed line fails the test instead of hanging it
    it = follow([path, other], lines=2, poll_s=0.01, stop=lambda: time.monotonic() > give_up)
    try:
        assert take(it, 2) == ["old 1", "old 2"]
        log.write_line("new 0")
        log.write_line("new 1")
        assert take(it, 2) == ["new 0", "new 1"]
        # Lines before and after a rotation, all seen between two polls.
        for i in range(2, 8):
            log.write_line(f"new {i}")
        assert backup_path(path, 1).exists()
        assert take(it, 6) == [f"new {i}" for i in range(2, 8)]
        log.rotate()  # a rotation with nothing after it, then more lines
        log.write_line("new 8")
        assert take(it, 1) == ["new 8"]
        # A file that did not exist when following began.
        other.write_text("hello\n")
        assert next(it) == (other, "hello")
        # Truncated in place (copytruncate style; noticed as the file got shorter): read from the start.
        log.close()
        path.write_text("ok\n")
        assert take(it, 1) == ["ok"]
        # A line written in two parts is yielded once, whole.
        with open(path, "a") as f:
            f.write("half")
            f.flush()
            time.sleep(0.05)
            f.write(" and half\n")
        assert take(it, 1) == ["half and half"]
    finally:
        it.close()
        log.close()


def test_follow_stops_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_text("a\nb\n")
    polls = iter(range(3))
    got = list(follow([path], lines=5, poll_s=0.01, stop=lambda: next(polls, None) is None))
    assert got == [(path, "a"), (path, "b")]
