"""llama.cpp's own memory figures, for checking the estimate: a real llama-server over bare rpc-servers, and
the per-device buffer sizes and layer placement its log reports."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from mesh_sidecar.llama.build import LlamaBinaries
from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.units import MIB
from tests.helpers.llama import api_healthy, start_bare_rpc_server
from tests.helpers.waiting import wait_until

LLAMA_START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 10
PLAN_TOLERANCE = 0.05  # the issues' bound: a plan's weights + K/V per device against llama.cpp's

BUFFER_LINE = re.compile(r"(RPC\d+)\[([\d.]+:\d+)\] (model|KV|compute) buffer size = +([\d.]+) MiB")
_ASSIGNED_LINE = re.compile(r"layer +(\d+) assigned to device (\S+?),")


@dataclass(frozen=True)
class LlamaBuffers:
    """What llama-server logged of one load over rpc-servers."""

    endpoints: tuple[str, ...]  # the rpc-servers, in --rpc order
    sizes_mib: dict[tuple[str, str], float]  # (endpoint, "model" | "KV" | "compute") -> MiB
    assigned: dict[int, str]  # layer -> device ("RPC0", "RPC1", ...); the head is layer n_layers
    log: str


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def llama_buffers(binaries: LlamaBinaries, model: Path, tensor_split: Sequence[int], n_ctx: int, log_dir: Path,
                  extra: Sequence[str] = ()) -> LlamaBuffers:
    """Load ``model`` with ``-ngl 99 -c n_ctx --tensor-split ...`` (and ``extra``) over one bare rpc-server
    per split entry, wait until llama-server is ready, stop everything and read its log."""
    procs: list[subprocess.Popen] = []
    log_path = log_dir / "llama-server.log"
    try:
        endpoints = _start_rpc_servers([RpcServer(binaries)] * len(tensor_split), log_dir, procs)
        # -lv 5 (debug) prints the "layer N assigned to device" lines; 4 would do for the sizes.
        _start_llama_server(
            [str(binaries.llama_server), "-m", str(model), "--host", "127.0.0.1", "--port", str(free_tcp_port()),
             "--rpc", ",".join(endpoints), "-ngl", "99", "-c", str(n_ctx),
             "--tensor-split", ",".join(map(str, tensor_split)), "-lv", "5", *extra], log_path, procs)
    finally:
        for proc in reversed(procs):
            _stop(proc)
    log = log_path.read_text(errors="replace")
    assigned = {int(layer): device for layer, device in _ASSIGNED_LINE.findall(log)}
    return LlamaBuffers(tuple(endpoints), buffer_sizes_mib(log), assigned, log)


def buffer_sizes_mib(log: str) -> dict[tuple[str, str], float]:
    """(endpoint, "model" | "KV" | "compute") -> MiB, from a llama-server log at verbosity 4 or more."""
    # The last load wins: the --fit pass before it logs the same lines with sizes of 0.
    sizes: dict[tuple[str, str], float] = {}
    for _, endpoint, kind, mib in BUFFER_LINE.findall(log):
        sizes[(endpoint, kind)] = float(mib)
    return sizes


@dataclass(frozen=True)
class RpcServer:
    """A bare rpc-server to start: its build, what to add to its environment, the devices it offers (-d)."""

    binaries: LlamaBinaries
    env: Mapping[str, str] | None = None
    devices: tuple[str, ...] = ()


def reference_argv(mesh_argv: Sequence[str], endpoints: Sequence[str], port: int) -> list[str]:
    """A mesh's llama-server command line over other rpc-servers and API port (and without the API key
    file, which only the node's proxy needs): everything that shapes the arithmetic stays the same."""
    replaced = {"--rpc": ",".join(endpoints), "--port": str(port)}
    argv, rest = [], list(mesh_argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--api-key-file":
            rest.pop(0)
        elif arg in replaced:
            argv += [arg, replaced[arg]]
            rest.pop(0)
        else:
            argv.append(arg)
    return argv


def answer_over_tcp(mesh_argv: Sequence[str], rpc_servers: Sequence[RpcServer], log_dir: Path,
                    ask: Callable[[int], str]) -> str:
    """What ``ask`` gets from the mesh's llama-server command run over bare rpc-servers on plain TCP
    (``rpc_servers``, in its --rpc order): llama.cpp's own --rpc, the reference for the mesh's text."""
    started: list[subprocess.Popen] = []
    try:
        endpoints = _start_rpc_servers(rpc_servers, log_dir, started)
        api = free_tcp_port()
        _start_llama_server(reference_argv(mesh_argv, endpoints, api), log_dir / "llama-server.log", started)
        return ask(api)
    finally:
        for proc in reversed(started):
            _stop(proc)


def _start_rpc_servers(specs: Sequence[RpcServer], log_dir: Path, started: list[subprocess.Popen]) -> list[str]:
    """One bare rpc-server per spec (added to ``started``, to be stopped); their endpoints, in order."""
    endpoints = []
    for i, spec in enumerate(specs):
        port = free_tcp_port()
        endpoints.append(f"127.0.0.1:{port}")
        started.append(start_bare_rpc_server(spec.binaries, port, log_dir / f"rpc{i}.log", env=spec.env,
                                             devices=spec.devices))
    return endpoints


def _start_llama_server(argv: Sequence[str], log_path: Path, started: list[subprocess.Popen]) -> None:
    """llama-server from ``argv`` (added to ``started``), returned once its API answers on argv's --port."""
    port = int(argv[list(argv).index("--port") + 1])
    with open(log_path, "w") as out:
        server = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT)
    started.append(server)

    def ready() -> bool:
        assert server.poll() is None, log_path.read_text()[-3000:]
        return api_healthy(port)

    wait_until(ready, LLAMA_START_TIMEOUT_S, "llama-server becomes ready")


@dataclass(frozen=True)
class Served:
    """What one llama-server of a serving node answered, with the plan it runs, its argv and its log."""

    answer: str
    plan: dict
    argv: list[str]
    log: str


REPLAN_WITHIN_S = 120.0  # a replan's stop, plan and load on a busy machine


def served_by_one_llama_server(node, ask: Callable[[], str], attempts: int = 3) -> Served:
    """``ask()`` answered with ``node``'s plan, read while the llama-server running it stayed the same.

    The supervisor may replan (capacities in gossip move: a lavapipe device's free memory is the host's)
    and start a new llama-server between reading the plan and asking; then ask again."""
    def running() -> tuple[int, dict, list[str], str]:
        def found() -> tuple[dict, dict] | None:  # none while a replan restarts it
            status = node.status()
            llama = next((p for p in status["processes"] if p["name"] == "llama-server"), None)
            return None if llama is None else (llama, status)

        llama, status = wait_until(found, REPLAN_WITHIN_S, f"{node.home.name}'s llama-server runs")
        return llama["pid"], status["serving"]["plan"], psutil.Process(llama["pid"]).cmdline(), llama["log"]

    for _ in range(attempts):
        pid, plan, argv, log = running()
        given = argv[argv.index("--tensor-split") + 1].split(",") if "--tensor-split" in argv else []
        if [float(w) for w in given] != plan["tensor_split"]:
            continue  # the plan read is not yet (or no longer) the one running
        answer = ask()
        if running()[0] == pid:
            return Served(answer, plan, argv, log)
    raise AssertionError(f"{node.home.name}'s llama-server was replaced {attempts} times while asked")


def device_buffers_mib(log: str) -> dict[tuple[str, str], float]:
    """(llama-server's device, e.g. "RPC1[127.0.0.1:4000]", "model" | "KV" | "compute") -> MiB, last load."""
    return {(f"{device}[{endpoint}]", kind): float(mib) for device, endpoint, kind, mib in BUFFER_LINE.findall(log)}


def check_plan_against_llama_cpp(plan: dict, mesh_argv: list[str], mesh_log: str) -> None:
    """The plan's figures per device beside llama.cpp's buffers for the devices holding layers, printed;
    weights + K/V within 5 %."""
    sizes = device_buffers_mib(mesh_log)
    endpoints = mesh_argv[mesh_argv.index("--rpc") + 1].split(",")
    # llama-server's device order: its --rpc endpoints in order, each rpc-server's devices in order.
    devices = sorted({device for device, _ in sizes}, key=lambda d: (endpoints.index(d.split("[")[1][:-1]), d))
    holding = [d for d in devices if sizes.get((d, "model"), 0) > 0]
    print("\nplan vs llama.cpp per device (MiB):")
    for device, node in zip(holding, plan["nodes"], strict=True):
        ours = (node["weights_bytes"] + node["output_bytes"] + node["kv_bytes"]) / MIB
        theirs = sizes[(device, "model")] + sizes[(device, "KV")]
        print(f"  {node['name']} {node['device']} ({device}) layers {node['layers']}: weights + KV {ours:.2f} vs "
              f"{theirs:.2f}; with compute {node['needed_bytes'] / MIB:.2f} vs "
              f"{theirs + sizes.get((device, 'compute'), 0):.2f}")
        assert ours == pytest.approx(theirs, rel=PLAN_TOLERANCE), (node, device, sizes)
