"""The package's tree is its architecture: each layer imports only the layers below it.

    foundation (errors, units, environment, home, identity, logs, ports)
      < wire < llama < net < mesh < serve < node < cli

The pure layer (``wire``) also imports nothing that opens sockets, starts
processes, reads clocks or speaks HTTP. docs/architecture.md draws the same order.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mesh_sidecar"
LAYERS = ("wire", "llama", "net", "mesh", "serve", "node", "cli")
FOUNDATION_RANK = -1
# Standard and third-party modules that do I/O the pure layer must not touch.
IMPURE_MODULES = {"asyncio", "socket", "ssl", "select", "selectors", "subprocess", "threading", "time", "mmap",
                  "psutil", "httpx", "aiohttp", "aioquic", "qh3", "zeroconf"}


def _modules() -> list[tuple[str, Path]]:
    return sorted((".".join(p.relative_to(PACKAGE).with_suffix("").parts), p) for p in PACKAGE.rglob("*.py"))


def _rank(module: str) -> int:
    """A module's layer: its subpackage's place in LAYERS, or the foundation's below them all."""
    head = module.split(".")[0]
    if head == "__main__":  # `python -m mesh_sidecar`: the command itself
        return len(LAYERS)
    return LAYERS.index(head) if head in LAYERS else FOUNDATION_RANK


def _imports(module: str, path: Path) -> tuple[set[str], set[str]]:
    """(modules of this package it imports, as dotted names; other top-level modules it imports)."""
    package = module.split(".")[:-1]
    ours, others = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] if node.module else [".".join(base + [a.name]) for a in node.names]
            ours.update(n for n in names if n)
        elif isinstance(node, ast.ImportFrom) and node.module:
            (ours if node.module.startswith("mesh_sidecar") else others).add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            others.update(a.name.split(".")[0] for a in node.names)
    return ours, others


@pytest.mark.parametrize("module, path", _modules(), ids=[m for m, _ in _modules()])
def test_imports_only_its_own_layer_or_below(module: str, path: Path) -> None:
    ours, _ = _imports(module, path)
    upward = sorted(t for t in ours if t and _rank(t) > _rank(module))
    assert not upward, f"{module} imports from a higher layer: {upward}"


# Wire formats that live in the room of what speaks them, pure all the same.
PURE_ELSEWHERE = frozenset({"net.data_plane.control_lines"})


def _pure(module: str) -> bool:
    return _rank(module) == 0 or module in PURE_ELSEWHERE


@pytest.mark.parametrize("module, path", [(m, p) for m, p in _modules() if _pure(m)],
                         ids=[m for m, _ in _modules() if _pure(m)])
def test_the_pure_layer_does_no_io(module: str, path: Path) -> None:
    _, others = _imports(module, path)
    assert not others & IMPURE_MODULES, f"{module} imports {sorted(others & IMPURE_MODULES)}"


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text("from ..serve.proxy import ApiAccess\nimport socket\n")
    ours, others = _imports("wire.probe", bad)
    assert [t for t in ours if _rank(t) > _rank("wire.probe")] == ["serve.proxy"]
    assert others & IMPURE_MODULES == {"socket"}


def _import_graph() -> dict[str, set[str]]:
    """Each module -> the modules of this package it imports anywhere in it (TYPE_CHECKING blocks,
    ``from . import x`` and imports inside functions too); a package stands for its ``__init__``."""
    paths = dict(_modules())

    def module(target: str) -> str | None:
        return next((m for m in (target, f"{target}.__init__" if target else "__init__") if m in paths), None)

    return {name: {m for t in _imports(name, path)[0] if (m := module(t)) is not None and m != name}
            for name, path in paths.items()}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph`` (its modules, the first repeated at the end), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        path, pending = [start], [iter(sorted(graph[start]))]
        while pending:
            target = next(pending[-1], None)
            if target is None:
                done.add(path.pop())
                pending.pop()
            elif target in path:
                return path[path.index(target):] + [target]
            elif target not in done:
                path.append(target)
                pending.append(iter(sorted(graph[target])))
    return None


def test_no_module_imports_itself_through_others() -> None:
    circle = _circle(_import_graph())
    assert circle is None, f"an import circle: {' -> '.join(circle or [])}"


def test_the_circle_rule_finds_a_circle_however_deep() -> None:
    assert _circle({"a": {"b"}, "b": {"c", "d"}, "c": set(), "d": {"b"}}) == ["b", "d", "b"]
    assert _circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # shared, not circular


ARCHITECTURE_MD = PACKAGE.parent / "docs" / "architecture.md"


@pytest.mark.parametrize("module, path", _modules(), ids=[m for m, _ in _modules()])
def test_every_module_opens_with_one_line_saying_its_job(module: str, path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring, f"{module} has no docstring"
    first = docstring.splitlines()[0]
    assert first.strip() and len(first) <= 120, f"{module}: {first!r}"


def test_architecture_md_names_every_module() -> None:
    text = ARCHITECTURE_MD.read_text()
    missing = [m for m, p in _modules() if p.name != "__init__.py" and f"`{p.relative_to(PACKAGE)}`" not in text]
    assert not missing, f"docs/architecture.md does not list: {missing}"


def _timeout_rows() -> list[tuple[str, str, str]]:
    """(value, module, constant) of each row of the architecture doc's timeouts table."""
    table = ARCHITECTURE_MD.read_text().split("## Timeouts", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\|[^|]+\| ([0-9.]+) s \| `([a-z_.]+)\.([A-Z_]+)` \|$", table, flags=re.M)


def test_the_timeouts_table_names_real_constants_with_their_values() -> None:
    rows = _timeout_rows()
    assert len(rows) >= 10
    for value, module, constant in rows:
        actual = getattr(importlib.import_module(f"mesh_sidecar.{module}"), constant)
        assert actual == float(value), f"{module}.{constant} is {actual}, the doc says {value} s"
