"""A real rpc-server's device listing, as the capacity parser reads it."""

from __future__ import annotations

import pytest

from mesh_sidecar.llama.capacity import parse_device_listing
from mesh_sidecar.llama.launch import start_rpc_server
from mesh_sidecar.ports import free_tcp_port


@pytest.mark.slow
async def test_a_real_rpc_server_lists_its_devices_in_its_log(binaries, tmp_path) -> None:
    """The listing must reach the log while rpc-server runs (its stdout is a pipe), or GPUs go uncounted."""
    server = await start_rpc_server(binaries, free_tcp_port(), tmp_path)
    try:
        devices = parse_device_listing(server.log_path.read_text())
    finally:
        await server.stop()
    assert devices and devices[0].total_bytes > 0, server.log_path.read_text()
