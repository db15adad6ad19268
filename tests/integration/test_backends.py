"""`mesh-inference setup --backend`, the backend a node run follows, and the devices of a build, with real
processes. Each test has a cache of its own (MESH_CACHE): nothing is built or downloaded here."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mesh_sidecar.environment import CACHE_ENV
from mesh_sidecar.llama.backends import BACKEND_CHOICE_NAME, VULKAN
from mesh_sidecar.llama.build import BUILD_STAMP_NAME, BUILD_TARGETS, LLAMA_SERVER_BINARY, STOCK
from mesh_sidecar.llama.devices import list_devices
from mesh_sidecar.units import MIB
from tests.helpers.nodes import cli
from tests.integration.test_cli_errors import assert_clean_error


def fake_complete_build(cache: Path, key: str) -> Path:
    """A build directory in ``cache`` that looks complete (stamp, executables that do nothing); its bin/."""
    bin_dir = cache / key / "bin"
    bin_dir.mkdir(parents=True)
    for name in BUILD_TARGETS:
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / BUILD_STAMP_NAME).write_text(json.dumps({"backend": key}))
    return bin_dir


def test_cpu_build_lists_its_cpu(binaries) -> None:
    devices = list_devices(binaries)
    assert [d.name for d in devices] == ["CPU"], devices
    assert devices[0].total_bytes >= MIB and 0 < devices[0].free_bytes <= devices[0].total_bytes


def test_setup_records_the_backend_and_a_node_runs_its_build(tmp_path, model_path) -> None:
    env = {CACHE_ENV: str(tmp_path / "cache")}
    bin_dir = fake_complete_build(tmp_path / "cache", STOCK.on(VULKAN).key())
    # No index: setup cannot keep the llama.cpp source here, and says so without failing.
    no_index = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": "/dev/null", "PIP_RETRIES": "0",
                "PIP_TIMEOUT": "1"}
    result = cli("setup", "--backend", "vulkan", "--model", str(model_path), env={**env, **no_index})
    assert result.returncode == 0, result.stderr
    assert "backend: vulkan\n" in result.stdout
    assert "llama.cpp source, offered to members without package access: not kept" in result.stdout
    assert result.stdout.splitlines()[-1] == str(bin_dir)  # the bin dir last, for scripts
    assert (tmp_path / "cache" / BACKEND_CHOICE_NAME).read_text() == "vulkan\n"
    # The node run takes the build setup chose: here it is the one found broken.
    (bin_dir / LLAMA_SERVER_BINARY).unlink()
    run = cli("--home", str(tmp_path / "home"), "--model", str(model_path), env=env)
    assert_clean_error(run, f"{bin_dir} has no executable llama-server")


def test_a_node_runs_the_cpu_build_when_setup_chose_none(tmp_path, model_path) -> None:
    env = {CACHE_ENV: str(tmp_path / "cache")}
    bin_dir = fake_complete_build(tmp_path / "cache", STOCK.key())
    (bin_dir / LLAMA_SERVER_BINARY).unlink()
    run = cli("--home", str(tmp_path / "home"), "--model", str(model_path), env=env)
    assert_clean_error(run, f"{bin_dir} has no executable llama-server")


def test_missing_toolkit_is_named_before_anything_is_fetched(tmp_path) -> None:
    cache = tmp_path / "cache"
    # PATH without nvcc, on a machine that has it too.
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not shutil.which("nvcc", path=d))
    result = cli("setup", "--backend", "cuda", env={CACHE_ENV: str(cache), "PATH": path})
    assert_clean_error(result, "The cuda build of llama.cpp needs nvcc", "nvidia-cuda-toolkit",
                       "mesh-inference setup --backend cpu")
    assert not (cache / BACKEND_CHOICE_NAME).exists()
    assert not any(cache.glob("*/src*"))  # no download started


def test_backend_usage_errors(tmp_path) -> None:
    assert_clean_error(cli("setup", "--backend", "rocm", env={CACHE_ENV: str(tmp_path)}),
                       "--backend takes cpu, vulkan, cuda, metal or auto, not 'rocm'")
    assert_clean_error(cli("setup", "--backend", "vulkan", "--llama-bin", str(tmp_path)),
                       "--backend chooses which pinned build to make")
