"""The real llama.cpp side of the tests: the greedy request every test asks, plain llama-server and rpc-server
processes, and an rpc-server behind the fault proxy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx
import psutil

from mesh_sidecar.llama.build import LLAMA_SERVER_BINARY, RPC_SERVER_BINARY, LlamaBinaries
from mesh_sidecar.ports import free_tcp_port
from tests.helpers.waiting import wait_until

PROMPT = "The three primary colors are"
N_PREDICT = 48
GREEDY = {"temperature": 0, "seed": 42, "top_k": 1}
PLAIN_LLAMA_SERVER_START_TIMEOUT_S = 120.0
FAULT_PROXY = Path(__file__).resolve().with_name("fault_proxy.py")


def quiet(message: str, done: int, total: int) -> None:
    """A progress callback that shows nothing (for ``ensure_binaries`` and ``ensure_model``)."""


def api_healthy(port: int) -> bool:
    """Whether llama-server (or the node's proxy in front of it) on ``port`` is ready."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def complete(port: int, prompt: str = PROMPT, *, ignore_eos: bool = False) -> str:
    """Greedy completion of N_PREDICT tokens from the API on ``port``.

    ``ignore_eos``: for random-weight models, which may say end-of-sequence at once.
    """
    body = {"prompt": prompt, "max_tokens": N_PREDICT, **GREEDY, **({"ignore_eos": True} if ignore_eos else {})}
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json=body)
    response.raise_for_status()
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == N_PREDICT
    return answer["choices"][0]["text"]


def start_bare_rpc_server(binaries: LlamaBinaries, port: int, log: Path, *, env: Mapping[str, str] | None = None,
                          devices: Sequence[str] = (), args: Sequence[str] = ()) -> subprocess.Popen:
    """A bare rpc-server, returned once it listens (llama-server aborts on a port not yet open); ``env`` adds
    to the environment, ``devices`` are the ones it offers (its -d), ``args`` add to its command line."""
    proc = subprocess.Popen([str(binaries.rpc_server), "-H", "127.0.0.1", "-p", str(port),
                             *(["-d", ",".join(devices)] if devices else []), *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def listening() -> bool:  # its sockets, not a probe connection: that would be a client
        assert proc.poll() is None, log.read_text()
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(proc.pid).net_connections(kind="tcp"))

    wait_until(listening, 30, f"rpc-server listens on {port}")
    return proc


def plain_llama_server_answer(binaries: LlamaBinaries, model: Path, log_dir: Path,
                              ask: Callable[[int], str], args: Sequence[str] = (),
                              env: Mapping[str, str] | None = None) -> str:
    """``ask(port)`` against plain llama-server on this machine (its log: ``log_dir``/plain.log): on the CPU,
    the output to match. ``args`` and ``env`` add to its command line and to our environment."""
    port = free_tcp_port()
    log_path = log_dir / "plain.log"
    proc = subprocess.Popen([str(binaries.llama_server), "-m", str(model), "--host", "127.0.0.1",
                             "--port", str(port), *args], stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **env} if env else None)
    try:
        deadline = time.monotonic() + PLAIN_LLAMA_SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline and not api_healthy(port):
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        return ask(port)
    finally:
        proc.terminate()
        proc.wait(10)


def wrapped_rpc_build(binaries: LlamaBinaries, directory: Path, script: str) -> Path:
    """Make ``directory`` a --llama-bin directory: the real llama-server, and as its rpc-server a shell
    ``script`` (its body after ``#!/bin/sh``; ``"$@"`` are rpc-server's arguments)."""
    directory.mkdir()
    (directory / LLAMA_SERVER_BINARY).symlink_to(binaries.llama_server)
    wrapper = directory / RPC_SERVER_BINARY
    wrapper.write_text(f"#!/bin/sh\n{script}\n")
    wrapper.chmod(0o755)
    return directory


def faulty_rpc_build(binaries: LlamaBinaries, directory: Path, trigger: Path, *fault_args: str) -> None:
    """Make ``directory`` a --llama-bin directory whose rpc-server sits behind the fault proxy
    (fault_proxy.py; NaNs, or with ``"--delay-s", "S"`` late replies), armed once ``trigger`` exists."""
    wrapped_rpc_build(binaries, directory, f'exec "{sys.executable}" "{FAULT_PROXY}" --real "{binaries.rpc_server}" '
                                           f'--trigger "{trigger}" {" ".join(fault_args)} "$@"')
