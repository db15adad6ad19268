"""The wheel holds everything an installed package needs at run time, and nothing else.

``pip install .`` (not editable) gets only what the wheel holds: every module of
``mesh_sidecar``, and the plain files it reads beside its modules: the native helper's
C source (``llama/native/tensor_cache.c``), the native data relay's sources
(``net/data_plane/native/``), the /mesh dashboard (``serve/dashboard/*``) and the llama.cpp patches
(``llama/patches/*.patch``). A file missing from
``[tool.setuptools.package-data]`` works from a checkout and breaks once installed, so
this builds the wheel and compares it with the source tree. Tests and benchmarks stay out.

The wheel is built from a copy of the source (setuptools writes ``build/`` and
``*.egg-info`` into the tree it builds), without build isolation when the venv's
setuptools satisfies ``[build-system] requires``, else with it (pip then fetches
setuptools from the package index). Fast: a few seconds, no node started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "mesh_sidecar"
# Left out of the copy: state and build output, never part of a source tree.
NOT_SOURCE = (".git", ".venv", ".venv-*", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache",
              ".hypothesis", "test-artifacts", "results")
# What the package reads from beside its modules, relative to the package (each must match something).
RUNTIME_DATA = ("llama/native/tensor_cache.c", "serve/dashboard/index.html", "serve/dashboard/*.js",
                "serve/dashboard/*.css", "llama/patches/*.patch",
                "net/data_plane/native/*.c", "net/data_plane/native/*.h", "net/data_plane/native/CMakeLists.txt")
BUILD_TIMEOUT_S = 300


def _build_requirements_met() -> bool:
    """Whether this interpreter already has what ``[build-system] requires`` names."""
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    for line in requires:
        requirement = Requirement(line)
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            return False
        if not requirement.specifier.contains(version, prereleases=True):
            return False
    return True


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the source tree: the wheel is built from it and compared with it (not with the
    checkout, which others may be editing meanwhile)."""
    copy = tmp_path_factory.mktemp("wheel") / "source"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
    return copy


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel-out")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
               "-w", str(out), str(source)]
    if _build_requirements_met():
        command.insert(4, "--no-build-isolation")
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {out}, found {wheels}"
    with zipfile.ZipFile(wheels[0]) as archive:
        yield archive


def _package_files(source: Path) -> set[str]:
    """Every file of the package in the source tree, as wheel paths (``mesh_sidecar/...``)."""
    root = source / PACKAGE
    return {f"{PACKAGE}/{path.relative_to(root).as_posix()}" for path in root.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


def test_every_module_is_in_the_wheel(source, wheel):
    names = set(wheel.namelist())
    modules = {name for name in _package_files(source) if name.endswith(".py")}
    assert f"{PACKAGE}/__init__.py" in modules
    missing = sorted(modules - names)
    assert not missing, f"modules missing from the wheel: {missing}"


@pytest.mark.parametrize("pattern", RUNTIME_DATA)
def test_the_files_read_at_run_time_are_in_the_wheel(source, wheel, pattern):
    """Each one must exist in the source, and be in the wheel at the same place."""
    in_source = sorted(f"{PACKAGE}/{p.relative_to(source / PACKAGE).as_posix()}"
                       for p in (source / PACKAGE).glob(pattern))
    assert in_source, f"{PACKAGE}/{pattern} matches nothing in the source tree: update RUNTIME_DATA"
    missing = [name for name in in_source if name not in wheel.namelist()]
    assert not missing, f"missing from the wheel (add them to [tool.setuptools.package-data]): {missing}"


def test_every_file_of_the_package_is_in_the_wheel(source, wheel):
    """The catch-all: a new data file beside the modules needs a package-data glob too."""
    missing = sorted(_package_files(source) - set(wheel.namelist()))
    assert not missing, f"missing from the wheel (add them to [tool.setuptools.package-data]): {missing}"


def test_the_wheel_holds_only_the_package(wheel):
    """No tests, benchmarks, scripts or docs: only mesh_sidecar/ and the wheel's own metadata."""
    stray = sorted(name for name in wheel.namelist()
                   if not name.startswith(f"{PACKAGE}/") and ".dist-info/" not in name)
    assert not stray, f"files outside {PACKAGE}/ in the wheel: {stray}"
    assert not any(part in ("tests", "benchmarks") for name in wheel.namelist() for part in name.split("/"))


def test_the_wheel_installs_the_command(wheel):
    entry_points = next(name for name in wheel.namelist() if name.endswith(".dist-info/entry_points.txt"))
    text = wheel.read(entry_points).decode()
    assert "mesh-inference = mesh_sidecar.cli.main:main" in text, text
