"""Starting, watching and stopping the llama.cpp processes a node runs.

Every node runs one ``ggml-rpc-server`` bound to 127.0.0.1 (it must never face a
network: whoever reaches it can read and write its memory). A serving node also
runs ``llama-server`` on an internal 127.0.0.1 port with ``--rpc`` listing RPC
endpoints: its own rpc-server first, then one tunnel port per peer. The user's
port belongs to the sidecar's proxy, so llama-server can be restarted without
the API going away.

Children get their own process group (a terminal's Ctrl-C reaches only us, and
we stop them in order) and die with the sidecar if it is killed outright. Their
stdout and stderr share one pipe that the sidecar copies into a size-capped,
rotated log file (see ``logs.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import struct
import termios
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import httpx
import psutil

from ..errors import ChildExitedError, ReadinessTimeoutError
from ..logs import (
    CHILD_LOG_BACKUPS,
    CHILD_LOG_MAX_BYTES,
    CappedLogFile,
    pump_lines,
    tail,
)
from ..ports import LOOPBACK
from ..progress import ProgressCallback
from .build import LlamaBinaries
from .model_files import model_stem
from .weight_cache import WeightCache

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
READY_POLL_S = 0.05
RPC_SERVER_READY_TIMEOUT_S = 30.0
LLAMA_SERVER_READY_TIMEOUT_S = 300.0
HEALTH_PROBE_TIMEOUT_S = 2.0
LOG_TAIL_LINES = 15
OFFLOAD_ALL_LAYERS = "99"
# Level 4 logs each device's model, KV and compute buffer sizes (which machine
# holds what); it never logs prompt text.
LLAMA_SERVER_LOG_VERBOSITY = "4"
_PR_SET_PDEATHSIG = 1
# After the child exits, how long its output may take to reach end of file (a
# grandchild could hold the pipe open) before the copying stops.
PUMP_DRAIN_S = 2.0
# How long wait_ready lets the log catch up with what the child already wrote.
LOG_CATCH_UP_S = 1.0
# llama-server's load, in the order it logs it: (what its log line holds, the stage we say). Its own
# load callback (a fraction of the bytes loaded) is not logged by a standalone llama-server, so a load
# gives stage lines, not a percentage. Sending the weights to the devices (over the mesh) is the long one.
LLAMA_SERVER_LOAD_STAGES = (
    ("llama_model_loader: loaded meta data", "Loading the model: reading its metadata"),
    ("load_tensors: loading model tensors", "Loading the model: sending the weights to the devices"),
    ("llama_context: constructing llama_context", "Loading the model: allocating the context (KV cache)"),
    ("common_init_: warming up the model", "Loading the model: warming up"),
    ("llama_server: model loaded", "Loading the model: done"),
)


def rpc_server_argv(binaries: LlamaBinaries, port: int, *, tensor_cache: bool = False,
                    devices: Sequence[str] = (), threads: int | None = None) -> list[str]:
    """rpc-server's command line; ``devices``: the ones it offers, by ggml's names (none: its own rule,
    every GPU, else the CPU); ``threads``: its CPU device's (None: this machine's physical cores, as
    llama-server takes; rpc-server's own default is one thread, half or less of a CPU member's speed)."""
    # rpc-server prints its devices and their free memory (capacity.py reads them from its log) with
    # printf, then serves forever: into a pipe, block-buffered, they would never arrive. stdbuf
    # (coreutils) makes its stdout line-buffered.
    line_buffered = [stdbuf, "-oL"] if (stdbuf := shutil.which("stdbuf")) else []
    argv = [*line_buffered, str(binaries.rpc_server), "-H", LOOPBACK, "-p", str(port)]
    if tensor_cache:
        argv.append("-c")
    if devices:
        argv += ["-d", ",".join(devices)]
    return [*argv, "-t", str(threads or physical_cores())]


def physical_cores() -> int:
    """This machine's physical cores (its logical ones where that is unknown)."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def llama_server_argv(
    binaries: LlamaBinaries,
    model: Path,
    rpc_endpoints: Sequence[str],
    port: int,
    *,
    tensor_split: Sequence[float] = (),
    api_key_file: Path | None = None,
    extra: Sequence[str] = (),
    projector: Path | None = None,
) -> list[str]:
    """llama-server offloading every layer to the RPC endpoints, in list order.

    ``api_key_file`` (a file, so the key is not in ``ps``) makes llama-server's
    own loopback port useless to other local users: only our proxy knows the key.
    ``projector`` (--mmproj) runs on llama-server's own CPU (llama/projector.py says why).
    """
    argv = [
        str(binaries.llama_server),
        "-m", str(model),
        "--host", LOOPBACK,
        "--port", str(port),
        # None: the model runs in llama-server itself, alone on this machine.
        *(["--rpc", ",".join(rpc_endpoints)] if rpc_endpoints else []),
        "-ngl", OFFLOAD_ALL_LAYERS,
        "--alias", model_stem(model.name),
        "--metrics",
        "--log-verbosity", LLAMA_SERVER_LOG_VERBOSITY,
        # No host-memory prompt cache: giving a request a slot would first save the slot's KV cache
        # there (and idle slots' too), read back from the rpc-servers, hundreds of round trips a slot:
        # 1.5 s a slot through the mesh, before the request even starts. A slot still reuses the
        # prompt it holds (cache_prompt).
        "--cache-ram", "0",
    ]
    if tensor_split:
        argv += ["--tensor-split", ",".join(f"{w:g}" for w in tensor_split)]
    if api_key_file is not None:
        argv += ["--api-key-file", str(api_key_file)]
    if projector is not None:
        argv += ["--mmproj", str(projector), "--no-mmproj-offload"]
    return argv + list(extra)


def _prepare_child() -> None:
    # Runs in the child between fork and exec. If the sidecar is SIGKILLed, the kernel sends the child
    # SIGTERM instead of leaving it orphaned. A write to a socket whose reader is gone fails with EPIPE
    # instead of killing the writer: rpc-server replying to a llama-server killed at a failover (issue
    # 42) lost its life to SIGPIPE, and the serving node with it. (subprocess restores SIGPIPE's default
    # action in the child before this runs; ignored, it stays ignored across exec.)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)


class ChildProcess:
    """One supervised child: its output goes to a capped log file under the node's home.

    The child's stdout and stderr share one pipe; a task owned by this object
    copies it line by line into ``log_path`` (rotated at ``max_log_bytes``,
    keeping ``log_backups`` older files). The task ends at end of file and is
    awaited by ``wait()`` and ``stop()``, so the whole output is in the file
    once either returns.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *,
                 max_log_bytes: int = CHILD_LOG_MAX_BYTES, log_backups: int = CHILD_LOG_BACKUPS,
                 env: Mapping[str, str] | None = None, on_line: Callable[[bytes], None] | None = None) -> None:
        self.name = name
        self.on_line = on_line  # also shown each output line as it is logged
        self.argv = list(argv)
        self.env = {**os.environ, **env} if env else None  # None: inherit ours
        self.log_path = log_path
        self.max_log_bytes = max_log_bytes
        self.log_backups = log_backups
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self._pipe_fd: int | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        log_file = CappedLogFile(self.log_path, self.max_log_bytes, self.log_backups)
        try:
            # A run starts with at least half the cap free, so its startup output
            # (rpc-server's device listing, which the node reads back) stays in one file.
            if log_file.size > self.max_log_bytes // 2:
                log_file.rotate()
            log_file.write_line(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv)}")
            read_fd, write_fd = os.pipe()
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *self.argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=write_fd,
                    stderr=write_fd,
                    start_new_session=True,
                    preexec_fn=_prepare_child,
                    env=self.env,
                )
            except BaseException:
                os.close(read_fd)
                raise
            finally:
                os.close(write_fd)
            reader = asyncio.StreamReader()
            pipe = os.fdopen(read_fd, "rb", buffering=0)
            try:
                transport, _ = await loop.connect_read_pipe(
                    lambda: asyncio.StreamReaderProtocol(reader), pipe)
            except BaseException:
                pipe.close()
                raise
        except BaseException:
            log_file.close()
            if self._proc is not None and self._proc.returncode is None:
                self._proc.kill()
                await self._proc.wait()
            raise
        self._pipe_fd = read_fd
        self._pump = asyncio.create_task(self._copy_output(reader, transport, log_file),
                                         name=f"{self.name} log pump")
        log.info("started %s (pid %d), log %s", self.name, self._proc.pid, self.log_path)

    async def _copy_output(self, reader: asyncio.StreamReader, transport: asyncio.ReadTransport,
                           log_file: CappedLogFile) -> None:
        try:
            await pump_lines(reader, _WatchedLog(log_file, self.on_line) if self.on_line else log_file)
        finally:
            self._pipe_fd = None
            transport.close()
            log_file.close()

    async def _finish_pump(self) -> None:
        """Let the copying reach end of file (the child has exited); stop it if that takes too long."""
        pump = self._pump
        if pump is None:
            return
        if not pump.done():
            try:
                await asyncio.wait_for(asyncio.shield(pump), PUMP_DRAIN_S)
            except TimeoutError:
                log.warning("%s's output did not end within %.0f s of its exit; no longer logging it",
                            self.name, PUMP_DRAIN_S)
                pump.cancel()
                await asyncio.wait({pump})
        if not pump.cancelled() and (exc := pump.exception()) is not None:
            log.warning("copying %s's output failed: %r", self.name, exc)

    def _pending_output(self) -> int:
        """Bytes the child wrote that have not been read from the pipe yet."""
        fd = self._pipe_fd
        if fd is None:
            return 0
        try:
            return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    async def _catch_up(self) -> None:
        """Let the log file catch up with what the child has written so far."""
        deadline = time.monotonic() + LOG_CATCH_UP_S
        while self._pending_output() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        for _ in range(3):  # the copying task runs on the loop's next turns
            await asyncio.sleep(0)

    def last_log_lines(self, n: int = LOG_TAIL_LINES) -> str:
        lines = tail(self.log_path, n)
        if not lines and not self.log_path.exists():
            return "(no log)"
        return "\n".join(lines)

    def exited_error(self) -> ChildExitedError:
        code = self._proc.returncode if self._proc else None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return ChildExitedError(
            f"{self.name} {how}. Last lines of {self.log_path}:\n{self.last_log_lines()}"
        )

    async def wait(self) -> int:
        """Wait for the child to exit and its output to be logged; its return code."""
        assert self._proc is not None
        code = await self._proc.wait()
        await self._finish_pump()
        return code

    async def wait_ready(self, probe: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
        """Poll ``probe`` until it says ready; raise if the child dies or time runs out.

        When it returns, the log holds what the child wrote before it was ready.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.running:
                await self._finish_pump()
                raise self.exited_error()
            if await probe():
                await self._catch_up()
                return
            if time.monotonic() > deadline:
                await self._catch_up()
                raise ReadinessTimeoutError(
                    f"{self.name} did not become ready within {timeout_s:.0f} s. "
                    f"Last lines of {self.log_path}:\n{self.last_log_lines()}"
                )
            await asyncio.sleep(READY_POLL_S)

    async def stop(self, *, at_once: bool = False) -> None:
        """SIGTERM, then SIGKILL after a grace period (``at_once``: SIGKILL, for a process with nothing left
        to finish); by pid, never by name. Then finish the log."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL if at_once else signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                log.warning("%s (pid %d) ignored SIGTERM; killing it", self.name, proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        await self._finish_pump()


class _WatchedLog:
    """A log file that also hands each line to ``on_line`` (which must not raise into the pump)."""

    def __init__(self, log_file: CappedLogFile, on_line: Callable[[bytes], None]) -> None:
        self._log_file = log_file
        self._on_line = on_line
        self.path = log_file.path

    def write_line(self, line: bytes | str) -> None:
        self._log_file.write_line(line)
        try:
            self._on_line(line.encode(errors="replace") if isinstance(line, str) else line)
        except Exception:
            log.exception("watching a log line failed")


def llama_server_load_stage(line: bytes) -> str | None:
    """The load stage a llama-server log line starts (LLAMA_SERVER_LOAD_STAGES), or None."""
    text = line.decode(errors="replace")
    return next((stage for marker, stage in LLAMA_SERVER_LOAD_STAGES if marker in text), None)


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


def http_health_probe(client: httpx.AsyncClient, port: int) -> Callable[[], Awaitable[bool]]:
    """Ready when llama-server's /health answers 200 (it answers 503 while loading).

    One ``client`` for all polls: a new one per poll builds a TLS context from
    the system's CA bundle each time, which took a third of a core away from a
    loading llama-server.
    """

    async def probe() -> bool:
        try:
            response = await client.get(f"http://{LOOPBACK}:{port}/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    return probe


async def start_rpc_server(
    binaries: LlamaBinaries, port: int, logs: Path, *, weight_cache: WeightCache | None = None,
    devices: Sequence[str] = (), threads: int | None = None,
) -> ChildProcess:
    """rpc-server on 127.0.0.1:``port``; with ``weight_cache``, it answers SET_TENSOR_HASH from there;
    ``devices``, ``threads``: as rpc_server_argv."""
    child = ChildProcess("ggml-rpc-server", rpc_server_argv(binaries, port, tensor_cache=weight_cache is not None,
                                                            devices=devices, threads=threads),
                         logs / "rpc-server.log", env=weight_cache.environment() if weight_cache else None)
    await child.start()
    try:
        await child.wait_ready(listening_probe(child, port), RPC_SERVER_READY_TIMEOUT_S)
    except BaseException:
        await child.stop()
        raise
    return child


async def start_llama_server(argv: Sequence[str], port: int, logs: Path,
                             progress: ProgressCallback | None = None) -> ChildProcess:
    """llama-server, ready (its /health answers); ``progress`` hears its load stages."""

    def on_line(line: bytes) -> None:
        if progress is not None and (stage := llama_server_load_stage(line)) is not None:
            progress(stage, 0, 0)

    child = ChildProcess("llama-server", argv, logs / "llama-server.log", on_line=on_line if progress else None)
    await child.start()
    try:
        async with httpx.AsyncClient(timeout=HEALTH_PROBE_TIMEOUT_S, trust_env=False) as client:
            await child.wait_ready(http_health_probe(client, port), LLAMA_SERVER_READY_TIMEOUT_S)
    except BaseException:
        await child.stop()
        raise
    return child
