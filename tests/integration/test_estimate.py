"""The memory estimate against llama.cpp's own buffer figures (a real llama-server over bare rpc-servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh_sidecar.llama.estimate import (
    assign_layers,
    estimate_model,
)
from mesh_sidecar.units import MIB
from tests.helpers.llama_buffers import llama_buffers
from tests.unit.test_estimate import N_CTX, SMOL_LAYERS

# What this test allows between our weights + KV and llama.cpp's, per device.
REAL_TOLERANCE = 0.15


# --- against the real llama.cpp -----------------------------------------------


@pytest.mark.slow
def test_estimate_matches_llama_cpp_buffers(binaries, model_path: Path, tmp_path: Path) -> None:
    """2 rpc-servers, --tensor-split 10,21, -c 4096: llama.cpp's per-device buffers vs the estimate."""
    est = estimate_model(model_path, N_CTX)
    split = [10, 21]
    buffers = llama_buffers(binaries, model_path, split, N_CTX, tmp_path)
    sizes, assigned, endpoints = buffers.sizes_mib, buffers.assigned, buffers.endpoints
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
