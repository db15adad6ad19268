"""Shared fixtures (here so that tests/unit and tests/integration both see them): the real llama.cpp
build, the default model, its reference answer, node processes and the faulty rpc-server build.
The helpers they use live in tests/helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mesh_sidecar.llama.build import LlamaBinaries, ensure_binaries
from mesh_sidecar.llama.model import ensure_model
from tests.helpers.llama import complete, plain_llama_server_answer, quiet
from tests.helpers.llama import faulty_rpc_build as make_faulty_rpc_build
from tests.helpers.nodes import LoopbackNodes, NodeProcess


@pytest.fixture(scope="session")
def binaries() -> LlamaBinaries:
    """The pinned build (built on first use; `scripts/test.sh` runs setup first)."""
    return ensure_binaries(None, quiet)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return ensure_model(None, quiet)


@pytest.fixture(scope="session")
def reference_text(binaries, model_path, tmp_path_factory) -> str:
    """What plain llama-server answers for the default model and PROMPT."""
    return plain_llama_server_answer(binaries, model_path, tmp_path_factory.mktemp("plain"), complete)


@pytest.fixture
def start_node(tmp_path: Path, binaries: LlamaBinaries, model_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """Start nodes: `start_node(name, *args, serve=True)`; all are stopped (and their children killed) after."""
    nodes = LoopbackNodes(tmp_path)
    yield nodes.start
    nodes.stop_all()


@pytest.fixture
def faulty_rpc_build(tmp_path, binaries) -> Callable[..., tuple[Path, Path]]:
    """``faulty_rpc_build(*fault_args)``: a --llama-bin directory whose rpc-server sits behind the fault
    proxy (NaNs, or with ``"--delay-s", "S"`` late replies), and the file that arms it."""

    def build(*fault_args: str) -> tuple[Path, Path]:
        directory, trigger = tmp_path / "faulty-build", tmp_path / "fault-armed"
        make_faulty_rpc_build(binaries, directory, trigger, *fault_args)
        return directory, trigger

    return build
