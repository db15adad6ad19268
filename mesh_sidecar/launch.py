"""Starting, watching and stopping the llama.cpp processes a node runs.

Every node runs one ``ggml-rpc-server`` bound to 127.0.0.1 (it must never face a
network: whoever reaches it can read and write its memory). A serving node also
runs ``llama-server`` on an internal 127.0.0.1 port with ``--rpc`` listing RPC
endpoints: its own rpc-server first, then one tunnel port per peer. The user's
port belongs to the sidecar's proxy, so llama-server can be restarted without
the API going away.

Children get their own process group (a terminal's Ctrl-C reaches only us, and
we stop them in order) and die with the sidecar if it is killed outright.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx
import psutil

from .errors import ChildExitedError, ReadinessTimeoutError
from .llama_build import LlamaBinaries
from .ports import LOOPBACK

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
READY_POLL_S = 0.05
RPC_SERVER_READY_TIMEOUT_S = 30.0
LLAMA_SERVER_READY_TIMEOUT_S = 300.0
LOG_TAIL_LINES = 15
OFFLOAD_ALL_LAYERS = "99"
# Level 4 logs each device's model, KV and compute buffer sizes (which machine
# holds what); it never logs prompt text.
LLAMA_SERVER_LOG_VERBOSITY = "4"
_PR_SET_PDEATHSIG = 1


def rpc_server_argv(binaries: LlamaBinaries, port: int, *, tensor_cache: bool = False) -> list[str]:
    argv = [str(binaries.rpc_server), "-H", LOOPBACK, "-p", str(port)]
    if tensor_cache:
        argv.append("-c")
    return argv


def llama_server_argv(
    binaries: LlamaBinaries,
    model: Path,
    rpc_endpoints: Sequence[str],
    port: int,
    *,
    tensor_split: Sequence[float] = (),
    extra: Sequence[str] = (),
) -> list[str]:
    """llama-server offloading every layer to the RPC endpoints, in list order."""
    argv = [
        str(binaries.llama_server),
        "-m", str(model),
        "--host", LOOPBACK,
        "--port", str(port),
        "--rpc", ",".join(rpc_endpoints),
        "-ngl", OFFLOAD_ALL_LAYERS,
        "--alias", model.stem,
        "--metrics",
        "--log-verbosity", LLAMA_SERVER_LOG_VERBOSITY,
    ]
    if tensor_split:
        argv += ["--tensor-split", ",".join(f"{w:g}" for w in tensor_split)]
    return argv + list(extra)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the sidecar is SIGKILLed,
    # the kernel sends the child SIGTERM instead of leaving it orphaned.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess:
    """One supervised child: its output goes to a log file under the node's home."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
            out.flush()
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        log.info("started %s (pid %d), log %s", self.name, self._proc.pid, self.log_path)

    def last_log_lines(self, n: int = LOG_TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def exited_error(self) -> ChildExitedError:
        code = self._proc.returncode if self._proc else None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return ChildExitedError(
            f"{self.name} {how}. Last lines of {self.log_path}:\n{self.last_log_lines()}"
        )

    async def wait(self) -> int:
        """Wait for the child to exit; its return code."""
        assert self._proc is not None
        return await self._proc.wait()

    async def wait_ready(self, probe: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
        """Poll ``probe`` until it says ready; raise if the child dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.running:
                raise self.exited_error()
            if await probe():
                return
            if time.monotonic() > deadline:
                raise ReadinessTimeoutError(
                    f"{self.name} did not become ready within {timeout_s:.0f} s. "
                    f"Last lines of {self.log_path}:\n{self.last_log_lines()}"
                )
            await asyncio.sleep(READY_POLL_S)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; by pid, never by name."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            log.warning("%s (pid %d) ignored SIGTERM; killing it", self.name, proc.pid)
            proc.kill()
            await proc.wait()


def listening_probe(child: ChildProcess, port: int) -> Callable[[], Awaitable[bool]]:
    """Ready when the child itself listens on ``port``.

    We look at the child's sockets instead of connecting: rpc-server serves one
    client at a time, and a probe connection is a client.
    """

    async def probe() -> bool:
        try:
            conns = psutil.Process(child.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)

    return probe


def http_health_probe(port: int) -> Callable[[], Awaitable[bool]]:
    """Ready when llama-server's /health answers 200 (it answers 503 while loading)."""

    async def probe() -> bool:
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                response = await client.get(f"http://{LOOPBACK}:{port}/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    return probe


async def start_rpc_server(
    binaries: LlamaBinaries, port: int, logs: Path, *, tensor_cache: bool = False
) -> ChildProcess:
    child = ChildProcess("ggml-rpc-server", rpc_server_argv(binaries, port, tensor_cache=tensor_cache),
                         logs / "rpc-server.log")
    await child.start()
    try:
        await child.wait_ready(listening_probe(child, port), RPC_SERVER_READY_TIMEOUT_S)
    except BaseException:
        await child.stop()
        raise
    return child


async def start_llama_server(argv: Sequence[str], port: int, logs: Path) -> ChildProcess:
    child = ChildProcess("llama-server", argv, logs / "llama-server.log")
    await child.start()
    try:
        await child.wait_ready(http_health_probe(port), LLAMA_SERVER_READY_TIMEOUT_S)
    except BaseException:
        await child.stop()
        raise
    return child
