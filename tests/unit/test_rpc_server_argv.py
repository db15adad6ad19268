"""rpc-server's command line: its CPU threads are the machine's physical cores unless --threads says."""

from __future__ import annotations

from pathlib import Path

from mesh_sidecar.llama.build import LlamaBinaries
from mesh_sidecar.llama.launch import physical_cores, rpc_server_argv

BINARIES = LlamaBinaries(Path("/opt/llama/ggml-rpc-server"), Path("/opt/llama/llama-server"))


def threads_of(argv: list[str]) -> int:
    return int(argv[argv.index("-t") + 1])


def test_rpc_server_computes_on_every_physical_core_by_default():
    # Its own default is one thread: a CPU member would offer half or less of its speed.
    assert threads_of(rpc_server_argv(BINARIES, 50052)) == physical_cores() >= 1


def test_threads_and_devices_as_given():
    argv = rpc_server_argv(BINARIES, 50052, tensor_cache=True, devices=("Vulkan0", "CPU"), threads=3)
    assert threads_of(argv) == 3
    assert argv[argv.index(str(BINARIES.rpc_server)):] == [
        str(BINARIES.rpc_server), "-H", "127.0.0.1", "-p", "50052", "-c", "-d", "Vulkan0,CPU", "-t", "3"]
