"""docs/architecture.md says which modules do I/O: its module table's last column is checked here
against what each module imports and calls.

A module the table marks ``none`` (or ``via`` another module) must show no I/O of its own: no I/O
module imported (``mmap`` counts: it reads files), no clock read, no built-in ``open``, no file
method called on a path. A module with anything else in that column must show some.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mesh_sidecar"
DOC = ROOT / "docs" / "architecture.md"
# Importing one of these is doing I/O: sockets, processes, files, clocks, threads, HTTP, QUIC, mDNS, native libraries.
IO_MODULES = frozenset({"asyncio", "socket", "ssl", "select", "selectors", "subprocess", "threading", "mmap",
                        "shutil", "tempfile", "time", "urllib", "psutil", "httpx", "aiohttp", "aioquic", "qh3",
                        "zeroconf", "fcntl", "signal", "ctypes"})
# Methods of pathlib.Path (and file objects) that touch the file system.
FILE_METHODS = frozenset({"read_text", "write_text", "read_bytes", "write_bytes", "mkdir", "unlink", "iterdir",
                          "glob", "rglob", "touch", "chmod", "rmdir", "is_file", "is_dir", "exists", "stat"})
# What the os module offers that is I/O (os.path's string functions are not).
OS_CALLS = frozenset({"open", "replace", "rename", "remove", "unlink", "fsync", "kill", "getpid", "environ",
                      "getenv", "listdir", "scandir", "stat", "chmod", "makedirs", "read", "write", "close",
                      "getuid", "urandom"})
NO_IO = ("none", "via ")


def _rows() -> list[tuple[str, str]]:
    """(module file, I/O column) for every row of the module table that names a .py file."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and (match := re.match(r"`([\w/]+\.py)`", cells[0])):
            rows.append((match.group(1), cells[2]))
    return rows


def io_evidence(source: str) -> set[str]:
    """What in ``source`` is I/O: imported I/O modules, ``open``, file methods, os calls."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in IO_MODULES)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in IO_MODULES:
                found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
            found.add("open()")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FILE_METHODS:
            found.add(f".{node.func.attr}()")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
              and node.attr in OS_CALLS):
            found.add(f"os.{node.attr}")
    return found


def test_the_table_lists_modules_that_exist():
    missing = [module for module, _ in _rows() if not (PACKAGE / module).is_file()]
    assert _rows() and not missing, f"docs/architecture.md lists modules that are not there: {missing}"


@pytest.mark.parametrize("module, io", _rows(), ids=[module for module, _ in _rows()])
def test_the_table_says_whether_a_module_does_io(module, io):
    evidence = io_evidence((PACKAGE / module).read_text())
    if io.startswith(NO_IO):
        assert not evidence, f"docs/architecture.md says {module} does no I/O ({io!r}), but it uses {sorted(evidence)}"
    else:
        assert evidence, f"docs/architecture.md says {module} does I/O ({io!r}), but it shows none"


def test_the_check_sees_io():
    assert io_evidence("import mmap") == {"mmap"}
    assert io_evidence("from time import monotonic") == {"time"}
    assert io_evidence("def f(p):\n    return p.read_text()") == {".read_text()"}
    assert io_evidence("import os\nx = os.environ.get('A')") == {"os.environ"}
    assert io_evidence("import os.path\nx = os.path.join('a', 'b')") == set()
    assert io_evidence("import json\nx = json.dumps({})") == set()
