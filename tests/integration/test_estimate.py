"""The memory estimate against llama.cpp's own buffer figures (a real llama-server over bare rpc-servers)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from mesh_sidecar.llama.estimate import (
    assign_layers,
    estimate_model,
)
from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.units import MIB
from tests.helpers.llama import api_healthy, start_bare_rpc_server
from tests.unit.test_estimate import N_CTX, SMOL_LAYERS

# What this test allows between our weights + KV and llama.cpp's, per device.
REAL_TOLERANCE = 0.15
LLAMA_START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 10


# --- against the real llama.cpp -----------------------------------------------

_BUFFER_LINE = re.compile(r"(RPC\d+)\[([\d.]+:\d+)\] (model|KV|compute) buffer size = +([\d.]+) MiB")
_ASSIGNED_LINE = re.compile(r"layer +(\d+) assigned to device (\S+?),")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_estimate_matches_llama_cpp_buffers(binaries, model_path: Path, tmp_path: Path) -> None:
    """2 rpc-servers, --tensor-split 10,21, -c 4096: llama.cpp's per-device buffers vs the estimate."""
    est = estimate_model(model_path, N_CTX)
    split = [10, 21]
    procs: list[subprocess.Popen] = []
    log_path = tmp_path / "llama-server.log"
    try:
        endpoints = []
        for i in range(len(split)):
            port = free_tcp_port()
            endpoints.append(f"127.0.0.1:{port}")
            procs.append(start_bare_rpc_server(binaries, port, tmp_path / f"rpc{i}.log"))
        port = free_tcp_port()
        # -lv 5 (debug) prints the "layer N assigned to device" lines; 4 would do for the sizes.
        with open(log_path, "w") as out:
            server = subprocess.Popen(
                [str(binaries.llama_server), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port),
                 "--rpc", ",".join(endpoints), "-ngl", "99", "-c", str(N_CTX),
                 "--tensor-split", ",".join(map(str, split)), "-lv", "5"],
                stdout=out, stderr=subprocess.STDOUT)
        procs.append(server)
        deadline = time.monotonic() + LLAMA_START_TIMEOUT_S
        while not api_healthy(port):
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "llama-server did not become ready"
            time.sleep(0.2)
    finally:
        for proc in reversed(procs):
            _stop(proc)
    log = log_path.read_text(errors="replace")

    # The last load wins: the --fit pass before it logs the same lines with sizes of 0.
    sizes: dict[tuple[str, str], float] = {}
    for _, endpoint, kind, mib in _BUFFER_LINE.findall(log):
        sizes[(endpoint, kind)] = float(mib)
    assigned: dict[int, str] = {}
    for layer, device in _ASSIGNED_LINE.findall(log):
        assigned[int(layer)] = device
    expected_devices = assign_layers(est.n_layers, split)
    assert assigned == {il: f"RPC{d}" for il, d in enumerate(expected_devices)}

    ranges = [(0, 10, False), (10, SMOL_LAYERS, True)]
    for endpoint, (start, end, last) in zip(endpoints, ranges, strict=True):
        ours = (sum(est.layer_weight_bytes[start:end]) + (est.output_bytes if last else 0)
                + (end - start) * est.kv_bytes_per_layer) / MIB
        theirs = sizes[(endpoint, "model")] + sizes[(endpoint, "KV")]
        assert ours == pytest.approx(theirs, rel=REAL_TOLERANCE), (endpoint, sizes)
        assert sizes[(endpoint, "compute")] <= est.compute_margin_bytes / MIB
        assert est.range_bytes(start, end, with_output=last) / MIB >= theirs + sizes[(endpoint, "compute")]
