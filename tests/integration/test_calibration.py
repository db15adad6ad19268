"""Measuring a real rpc-server's devices: rates that rank them, a server that still serves, failures as None.

Each test starts the pinned ggml-rpc-server on the CPU (seconds). The slowed one runs it under a CFS quota
(tests/helpers/cpu_quota.py), as the speed-planning tests make one member slower than the others.
"""

from __future__ import annotations

import asyncio
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from mesh_sidecar.llama.build import LlamaBinaries
from mesh_sidecar.llama.calibration import DEVICE_TIMEOUT_S, DeviceSpeed, calibrate_devices
from mesh_sidecar.ports import LOOPBACK, free_tcp_port
from tests.helpers.cpu_quota import CpuQuota, cgroup_cpu_available
from tests.helpers.llama import N_PREDICT, api_healthy, complete, start_bare_rpc_server
from tests.helpers.tunnels import GET_DEVICE_MEMORY_CMD, HANG_S, HELLO_REQUEST, RPC_HEADER, U64
from tests.helpers.waiting import wait_until

QUOTA_CORES = 0.25
# The bound for a ranking that is right: a quarter core (of 2 here) is at least this much slower.
MIN_SLOWDOWN = 2.0
PROMPT_TIMEOUT_S = 0.5  # what "promptly" means for a server that refuses or talks nonsense


@pytest.fixture
def rpc_server(binaries: LlamaBinaries, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    port = free_tcp_port()
    proc = start_bare_rpc_server(binaries, port, tmp_path / "rpc-server.log")
    try:
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(10)


async def still_serves(port: int) -> None:
    """A new client gets HELLO and GET_DEVICE_MEMORY answered: the calibration left rpc-server whole."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(HELLO_REQUEST + RPC_HEADER.pack(GET_DEVICE_MEMORY_CMD, 4) + struct.pack("<I", 0))
        hello = await asyncio.wait_for(reader.readexactly(8 + 28), HANG_S)
        assert U64.unpack_from(hello)[0] == 28 and hello[8] == 7
        size, free, total = struct.unpack("<QQQ", await asyncio.wait_for(reader.readexactly(8 + 16), HANG_S))
        assert size == 16 and 0 < free <= total
    finally:
        writer.close()


async def test_a_real_rpc_server_measures_and_still_serves(rpc_server) -> None:
    proc, port = rpc_server
    start = time.monotonic()
    speeds = await calibrate_devices(port, 1)
    took_s = time.monotonic() - start
    assert len(speeds) == 1 and isinstance(speeds[0], DeviceSpeed), speeds
    speed = speeds[0]
    # Per prompt token a batch reads the weights once for all its tokens: faster than one token alone.
    assert 0 < speed.decode_bytes_per_s < speed.prefill_bytes_per_s
    assert took_s < DEVICE_TIMEOUT_S, took_s  # about 1 s here, the first time (the buffer's pages are new)
    print(f"CPU: decode {speed.decode_bytes_per_s / 1e9:.1f} GB/s, prefill {speed.prefill_bytes_per_s / 1e9:.1f} "
          f"GB/s per prompt token, in {took_s:.2f} s")
    assert proc.poll() is None
    await still_serves(port)
    # Again: nothing of the first run is left behind (rpc-server freed the buffer, the graph is new).
    assert isinstance((await calibrate_devices(port, 1))[0], DeviceSpeed)
    await still_serves(port)


async def test_a_device_the_server_does_not_have_is_unmeasured(rpc_server) -> None:
    proc, port = rpc_server
    speeds = await calibrate_devices(port, 2)  # rpc-server closes the connection on a device it lacks
    assert isinstance(speeds[0], DeviceSpeed) and speeds[1] is None
    assert proc.poll() is None
    await still_serves(port)


@pytest.mark.skipif(not cgroup_cpu_available(), reason="needs a writable cgroup v1 cpu controller")
async def test_a_slowed_server_measures_slower(rpc_server) -> None:
    proc, port = rpc_server
    (normal,) = await calibrate_devices(port, 1)
    with CpuQuota("mesh-calib") as quota:
        quota.add(proc.pid)
        quota.limit(QUOTA_CORES)
        start = time.monotonic()
        (slowed,) = await calibrate_devices(port, 1)
        took_s = time.monotonic() - start
    assert normal is not None and slowed is not None
    print(f"decode {normal.decode_bytes_per_s / 1e9:.1f} GB/s, at {QUOTA_CORES} core "
          f"{slowed.decode_bytes_per_s / 1e9:.1f} GB/s ({took_s:.2f} s); prefill "
          f"{normal.prefill_bytes_per_s / 1e9:.1f} and {slowed.prefill_bytes_per_s / 1e9:.1f} GB/s")
    assert slowed.decode_bytes_per_s * MIN_SLOWDOWN <= normal.decode_bytes_per_s
    assert slowed.prefill_bytes_per_s * MIN_SLOWDOWN <= normal.prefill_bytes_per_s
    assert took_s < DEVICE_TIMEOUT_S
    await still_serves(port)


@pytest.fixture
async def bad_server() -> AsyncIterator[dict[str, int]]:
    """Ports of servers that fail a calibration each their own way; ``closed``: one nobody listens on."""

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"not an rpc-server\n" * 8)
        await reader.read()
        writer.close()

    async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    async def older(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(len(HELLO_REQUEST))  # a 6.x rpc-server: another command table
        writer.write(U64.pack(28) + bytes([6, 0, 0, 0]) + bytes(24))
        await reader.read()
        writer.close()

    servers = {name: await asyncio.start_server(handler, LOOPBACK, 0)
               for name, handler in (("garbage", garbage), ("hangs_up", hangs_up), ("silent", silent),
                                     ("older", older))}
    try:
        yield {"closed": free_tcp_port(), **{name: s.sockets[0].getsockname()[1] for name, s in servers.items()}}
    finally:
        for server in servers.values():
            server.close()
            await server.wait_closed()


@pytest.mark.parametrize("kind", ["closed", "garbage", "hangs_up", "older", "silent"])
async def test_a_server_that_fails_gives_none_promptly(bad_server, kind: str) -> None:
    start = time.monotonic()
    # The silent one shows the timeout: the calibration gives up on it rather than wait.
    speeds = await calibrate_devices(bad_server[kind], 2, device_timeout_s=PROMPT_TIMEOUT_S / 4)
    assert speeds == (None, None)
    assert time.monotonic() - start < PROMPT_TIMEOUT_S


@pytest.mark.slow
def test_llama_server_serves_through_a_calibrated_rpc_server(rpc_server, binaries, model_path, reference_text,
                                                             tmp_path) -> None:
    proc, port = rpc_server
    assert all(asyncio.run(calibrate_devices(port, 1)))
    api = free_tcp_port()
    client = subprocess.Popen([str(binaries.llama_server), "-m", str(model_path), "--host", LOOPBACK, "--port",
                               str(api), "--rpc", f"{LOOPBACK}:{port}", "-ngl", "99"],
                              stdout=open(tmp_path / "llama-server.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: api_healthy(api) or client.poll() is not None, 120, "llama-server loads")
        assert client.poll() is None, (tmp_path / "llama-server.log").read_text()
        assert complete(api) == reference_text, f"{N_PREDICT} greedy tokens differ"
    finally:
        client.terminate()
        client.wait(10)
    assert proc.poll() is None
