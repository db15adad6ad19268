"""Per-process log files of real children: ChildProcess's pump, rotation and last words, and what a real node logs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from mesh_sidecar.errors import ChildExitedError
from mesh_sidecar.llama.launch import ChildProcess
from mesh_sidecar.logs import backup_path, log_files
from tests.helpers.waiting import wait_until_async
from tests.unit.test_logs import all_lines, assert_consecutive, lines_of

# --- ChildProcess with a real child


def python_child(code: str) -> list[str]:
    return [sys.executable, "-u", "-c", code]


PRINT_LINES = "import sys\nfor i in range({n}): print(f'line {{i}} ' + 'z' * 40)\nsys.exit({code})"


async def test_child_output_is_rotated_with_the_latest_lines_current(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "child.log"
    child = ChildProcess("printer", python_child(PRINT_LINES.format(n=3000, code=0)), path,
                         max_log_bytes=16 * 1024, log_backups=2)
    await child.start()
    assert await asyncio.wait_for(child.wait(), 30) == 0
    assert child._pump is not None and child._pump.done()
    assert backup_path(path, 2).exists() and not backup_path(path, 3).exists()
    assert all(p.stat().st_size <= 16 * 1024 for p in path.parent.iterdir())
    assert lines_of(path)[-1].startswith("line 2999 ")
    assert_consecutive(all_lines(path, 2), 2999)
    last = child.last_log_lines(3).splitlines()
    assert [line.split()[1] for line in last] == ["2997", "2998", "2999"]


SIGPIPE_MASK = 1 << (13 - 1)  # /proc/PID/status' SigIgn: bit n-1 for signal n


async def test_a_child_survives_writing_to_a_closed_socket(tmp_path: Path) -> None:
    """rpc-server replying to a llama-server killed at a failover gets EPIPE, not SIGPIPE's death."""
    path = tmp_path / "child.log"
    # Not Python, which ignores SIGPIPE in itself: the shell's disposition is the one exec passed on.
    child = ChildProcess("shell", ["/bin/sh", "-c", "grep SigIgn /proc/$$/status"], path)
    await child.start()
    assert await child.wait() == 0
    ignored = int(lines_of(path)[-1].split()[1], 16)
    assert ignored & SIGPIPE_MASK, f"SIGPIPE is not ignored: SigIgn {ignored:x}"


async def test_header_line_and_argv(tmp_path: Path) -> None:
    path = tmp_path / "child.log"
    child = ChildProcess("hello", python_child("print('hi')"), path)
    await child.start()
    await child.wait()
    header, body = lines_of(path)
    assert header.startswith("--- ") and header.endswith(f"starting: {' '.join(child.argv)}")
    assert body == "hi"


async def test_stderr_goes_to_the_same_log(tmp_path: Path) -> None:
    path = tmp_path / "child.log"
    child = ChildProcess("both", python_child(
        "import sys; print('out', flush=True); print('err', file=sys.stderr, flush=True); print('out2')"), path)
    await child.start()
    await child.wait()
    assert lines_of(path)[-3:] == ["out", "err", "out2"]


async def test_exited_error_has_the_last_lines(tmp_path: Path) -> None:
    path = tmp_path / "child.log"
    child = ChildProcess("failing", python_child(PRINT_LINES.format(n=500, code=3)), path,
                         max_log_bytes=4096)
    await child.start()
    assert await child.wait() == 3
    message = str(child.exited_error())
    assert "failing exited with code 3" in message
    last = message.split(":\n", 1)[1].splitlines()
    assert len(last) == 15
    assert_consecutive(last, 499)


async def test_wait_ready_raises_with_the_dying_childs_last_words(tmp_path: Path) -> None:
    child = ChildProcess("dying", python_child("print('cannot bind: address in use'); raise SystemExit(1)"),
                         tmp_path / "child.log")
    await child.start()

    async def never() -> bool:
        return False

    with pytest.raises(ChildExitedError, match="cannot bind: address in use"):
        await child.wait_ready(never, 30)


async def test_wait_ready_returns_with_the_startup_output_logged(tmp_path: Path) -> None:
    # Like rpc-server: it prints its devices, then listens; the node reads the
    # listing back from the log as soon as the child is ready.
    flag = tmp_path / "ready"
    code = ("import pathlib, sys, time\n"
            "for i in range(2000): sys.stdout.write(f'device {i}\\n')\n"
            "sys.stdout.flush()\n"
            f"pathlib.Path({str(flag)!r}).touch()\n"
            "time.sleep(60)\n")
    for _ in range(5):
        flag.unlink(missing_ok=True)
        child = ChildProcess("rpcish", python_child(code), tmp_path / "child.log")
        await child.start()
        try:
            async def ready() -> bool:
                return flag.exists()

            await child.wait_ready(ready, 30)
            assert child.last_log_lines(1) == "device 1999"
        finally:
            await child.stop()
        assert child._pump is not None and child._pump.done()


async def test_a_chatty_child_is_never_blocked_by_its_pipe(tmp_path: Path) -> None:
    # 20 MB through a 64 KiB pipe: finishes only if the sidecar keeps reading.
    code = "import sys\nfor i in range(200_000): sys.stdout.write('%099d\\n' % i)\n"
    child = ChildProcess("chatty", python_child(code), tmp_path / "child.log", max_log_bytes=1 << 20)
    await child.start()
    assert await asyncio.wait_for(child.wait(), 60) == 0
    assert lines_of(tmp_path / "child.log")[-1] == f"{199_999:099d}"


async def test_stop_finishes_the_log_and_leaves_no_task(tmp_path: Path) -> None:
    code = "import time\ni = 0\nwhile True:\n    print('tick', i, flush=True); i += 1; time.sleep(0.01)\n"
    path = tmp_path / "child.log"
    before = asyncio.all_tasks()
    child = ChildProcess("ticker", python_child(code), path, max_log_bytes=2048, log_backups=1)
    await child.start()
    await wait_until_async(lambda: backup_path(path, 1).exists(), 30, "the ticker's log rotates once")
    await child.stop()
    assert not child.running
    assert asyncio.all_tasks() == before
    kept = all_lines(path, 1)
    assert len(kept) > 10 and not backup_path(path, 2).exists()
    assert_consecutive([line for line in kept if line.startswith("tick")], int(kept[-1].split()[1]))
    await child.stop()  # again: nothing to do


async def test_wait_cancelled_does_not_lose_the_pump(tmp_path: Path) -> None:
    child = ChildProcess("slow", python_child("import time\nprint('a', flush=True)\ntime.sleep(0.5)\nprint('b')"),
                         tmp_path / "child.log")
    await child.start()
    waiter = asyncio.ensure_future(child.wait())
    await wait_until_async(lambda: (tmp_path / "child.log").exists() and "a" in lines_of(tmp_path / "child.log"),
                           30, "the child's first line is logged")
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert await child.wait() == 0
    assert lines_of(tmp_path / "child.log")[-2:] == ["a", "b"]


# --- what a real node logs


@pytest.mark.slow
def test_a_node_logs_one_file_per_process_and_never_the_prompt(start_node) -> None:
    import httpx

    from tests.helpers.llama import GREEDY

    node = start_node("private", serve=True)
    secret = "zebra-quantum-7731 tells the lighthouse"
    response = httpx.post(f"http://127.0.0.1:{node.serve_port}/v1/completions", timeout=120,
                          json={"prompt": secret, "max_tokens": 8, **GREEDY})
    response.raise_for_status()
    answer = response.json()["choices"][0]["text"]
    assert node.stop() == 0
    logs = node.home / "logs"
    assert [p.name for p in log_files(logs)] == ["sidecar.log", "llama-server.log", "rpc-server.log"]
    for path in logs.iterdir():
        text = path.read_text(errors="replace")
        assert "zebra-quantum" not in text, path
        if answer.strip():
            assert answer.strip() not in text, path
    assert "Devices:" in (logs / "rpc-server.log").read_text()
