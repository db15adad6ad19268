"""Tunnels to what only a real process gives: a real ggml-rpc-server answering through one, and a client run as
another local user (root only) refused at the tunnel port."""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mesh_sidecar.llama.launch import start_rpc_server
from mesh_sidecar.ports import free_tcp_port
from tests.helpers.tunnels import (
    DEVICE_COUNT_CMD,
    GET_DEVICE_MEMORY_CMD,
    HANG_S,
    HELLO_REQUEST,
    RPC_HEADER,
    U64,
    EchoServer,
    Mesh,
    echo_round_trip,
    echo_server,
    read_to_end,
    tunnel_mesh,
)


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    async with tunnel_mesh() as m:
        yield m


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    async with echo_server() as server:
        yield server


@pytest.mark.slow
async def test_real_rpc_server_answers_through_the_tunnel(mesh: Mesh, binaries, tmp_path: Path) -> None:
    port = free_tcp_port()
    rpc_server = await start_rpc_server(binaries, port, tmp_path)
    try:
        mesh.target_port = port
        reader, writer = await mesh.connect()

        writer.write(HELLO_REQUEST)
        reply = await asyncio.wait_for(reader.readexactly(8 + 28), HANG_S)
        assert U64.unpack_from(reply)[0] == 28
        assert reply[8:11] == bytes([7, 0, 0]), reply.hex()

        writer.write(RPC_HEADER.pack(DEVICE_COUNT_CMD, 0))
        reply = await asyncio.wait_for(reader.readexactly(8 + 4), HANG_S)
        size, count = struct.unpack("<QI", reply)
        assert size == 4 and count >= 1

        writer.write(RPC_HEADER.pack(GET_DEVICE_MEMORY_CMD, 4) + struct.pack("<I", 0))
        reply = await asyncio.wait_for(reader.readexactly(8 + 16), HANG_S)
        size, free, total = struct.unpack("<QQQ", reply)
        assert size == 16 and total > 0 and free <= total

        writer.write_eof()
        rest, _ = await asyncio.wait_for(read_to_end(reader), HANG_S)
        assert rest == b""
        writer.close()

        sent = len(HELLO_REQUEST) + 9 + 13
        assert mesh.listener.counters.bytes_to_peer == sent
        assert mesh.listener.counters.bytes_from_peer == 36 + 12 + 24
        assert mesh.listener.counters.streams == 1
        assert rpc_server.running
    finally:
        await rpc_server.stop()


# bash's /dev/tcp, not Python: the user running the tests may keep its interpreter (a venv, pyenv)
# in a home that uid 65534 cannot enter. Prints "closed: " when the port hangs up without a byte.
OTHER_USER_CONNECT = (
    'exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 3; printf hello >&3; '
    'if IFS= read -r -t 10 -n 16 reply <&3; then echo "reply: $reply"; '
    'elif [ $? -gt 128 ]; then echo timeout; else echo "closed: $reply"; fi'
)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
async def test_tunnel_port_refuses_other_local_users(mesh: Mesh, echo: EchoServer, caplog) -> None:
    caplog.set_level(logging.WARNING, "mesh_sidecar.net.tunnel")
    mesh.target_port = await echo.start()
    assert mesh.listener.port is not None
    result = await asyncio.to_thread(
        subprocess.run, ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                         "/bin/bash", "-c", OTHER_USER_CONNECT, "other-user", str(mesh.listener.port)],
        capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "closed: \n", result.stdout
    assert echo.received == [] and mesh.listener.counters.streams == 0
    assert any("owned by uid 65534" in r.getMessage() for r in caplog.records)
    await echo_round_trip(mesh, b"our own user still gets through")
