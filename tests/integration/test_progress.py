"""Progress from a real child process: its lines reach the on_line hook as it logs them."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mesh_sidecar.llama.launch import ChildProcess


def test_a_child_process_shows_its_lines_as_it_logs_them(tmp_path: Path) -> None:
    seen: list[bytes] = []

    async def run() -> None:
        child = ChildProcess("printf", ["printf", "one\\ntwo\\n"], tmp_path / "printf.log", on_line=seen.append)
        await child.start()
        assert await child.wait() == 0

    asyncio.run(run())
    assert seen == [b"one", b"two"]
    assert (tmp_path / "printf.log").read_text().splitlines()[1:] == ["one", "two"]
