"""A quantized K/V cache (--cache-type-k/-v q8_0) against llama.cpp's own figures, and through the product:
a model that does not fit a mesh with the f16 cache at a long context fits it with q8_0, and answers."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from mesh_sidecar.llama.estimate import assign_layers, estimate_model
from mesh_sidecar.llama.kv_cache import KvCacheTypes
from mesh_sidecar.units import MIB
from tests.helpers.llama import complete
from tests.helpers.llama_buffers import buffer_sizes_mib, llama_buffers
from tests.helpers.nodes import cli
from tests.helpers.waiting import wait_until
from tests.integration.test_planning import llama_log, plan_json, serving_plan
from tests.unit.test_estimate import SMOL_LAYERS

pytestmark = pytest.mark.slow

Q8_0 = KvCacheTypes("q8_0", "q8_0")
Q8_0_ARGS = ("--cache-type-k", "q8_0", "--cache-type-v", "q8_0")
# A long context, so that the K/V cache dominates the default model's memory (weights ~121 MiB):
# 360 MiB of f16 cache, 191 MiB of q8_0.
LONG_CTX = 16384
# Per device, between the estimate and llama.cpp's figure (the issue asks 5 %).
TOLERANCE = 0.05
# Two nodes offering this much each hold the model at LONG_CTX with a q8_0 cache (the plan needs
# ~476 MiB of the 571 MiB left once the server's token embeddings are off) but not with f16 (~645 MiB).
NODE_MAX_MEMORY = "300M"
REFUSAL_TIMEOUT_S = 60


def test_q8_0_estimate_matches_llama_cpp_buffers(binaries, model_path: Path, tmp_path: Path) -> None:
    """2 rpc-servers, --tensor-split 10,21, -c 16384, q8_0 K and V: llama.cpp's per-device buffers vs the
    estimate (K/V and weights within 5 %, the whole device within 5 % and never short)."""
    est = estimate_model(model_path, LONG_CTX, kv_cache=Q8_0)
    f16 = estimate_model(model_path, LONG_CTX)
    assert est.kv_bytes * 64 == f16.kv_bytes * 34  # 34 bytes per 32 elements instead of 2 bytes each
    split = [10, 21]
    buffers = llama_buffers(binaries, model_path, split, LONG_CTX, tmp_path, Q8_0_ARGS)
    assert "K (q8_0)" in buffers.log and "V (q8_0)" in buffers.log
    assert buffers.assigned == {il: f"RPC{d}" for il, d in enumerate(assign_layers(est.n_layers, split))}

    sizes = buffers.sizes_mib
    for endpoint, (start, end, last) in zip(buffers.endpoints, [(0, 10, False), (10, SMOL_LAYERS, True)],
                                            strict=True):
        kv = (end - start) * est.kv_bytes_per_layer / MIB
        assert kv == pytest.approx(sizes[(endpoint, "KV")], rel=TOLERANCE), (endpoint, sizes)
        weights_and_kv = (sum(est.layer_weight_bytes[start:end]) + (est.output_bytes if last else 0)) / MIB + kv
        assert weights_and_kv == pytest.approx(sizes[(endpoint, "model")] + sizes[(endpoint, "KV")],
                                               rel=TOLERANCE), (endpoint, sizes)
        theirs = sizes[(endpoint, "model")] + sizes[(endpoint, "KV")] + sizes[(endpoint, "compute")]
        ours = est.range_bytes(start, end, with_output=last) / MIB
        assert theirs <= ours <= theirs * (1 + TOLERANCE), (endpoint, ours, sizes)


def test_q8_0_cache_fits_where_f16_does_not(start_node) -> None:
    worker = start_node("worker", "--max-memory", NODE_MAX_MEMORY)
    common = ("--max-memory", NODE_MAX_MEMORY, "--ctx-size", str(LONG_CTX), "--join", worker.ticket(),
              "--min-peers", "1")

    f16 = start_node("server-f16", *common, serve=True, wait=False)
    wait_until(lambda: "Cannot load the model" in f16.text(), REFUSAL_TIMEOUT_S, "the f16 refusal is printed")
    refused = cli("plan", "--home", str(f16.home))
    assert refused.returncode != 0 and "short" in refused.stderr, refused.stderr
    assert f16.stop() == 0

    q8 = start_node("server-q8", *common, *Q8_0_ARGS, serve=True)
    plan = plan_json(q8)
    assert plan["kv_cache_type"] == "q8_0/q8_0" and [n["name"] for n in plan["nodes"]] == ["worker", "server-q8"]
    assert "KV cache q8_0/q8_0" in cli("plan", "--home", str(q8.home)).stdout
    assert complete(q8.serve_port)  # a greedy answer of N_PREDICT tokens

    llama = next(p for p in q8.status()["processes"] if p["name"] == "llama-server")
    argv = psutil.Process(llama["pid"]).cmdline()
    assert argv[argv.index("--cache-type-k") + 1] == "q8_0" and argv[argv.index("--cache-type-v") + 1] == "q8_0"
    # The plan's KV column against what llama.cpp allocated on each member (--rpc entry i = plan node i).
    sizes = buffer_sizes_mib(Path(llama_log(q8)).read_text(errors="replace"))
    endpoints = argv[argv.index("--rpc") + 1].split(",")
    for endpoint, node in zip(endpoints, serving_plan(q8)["nodes"], strict=True):
        assert node["kv_bytes"] / MIB == pytest.approx(sizes[(endpoint, "KV")], rel=TOLERANCE), (node, sizes)
        theirs = sizes[(endpoint, "model")] + sizes[(endpoint, "KV")] + sizes[(endpoint, "compute")]
        assert theirs <= node["needed_bytes"] / MIB <= theirs * (1 + TOLERANCE), (node, sizes)
