"""Mixture-of-experts models with real processes: the estimate against llama.cpp's per-device buffers, and
a three-node mesh giving the same greedy text as llama-server's own --rpc over plain TCP rpc-servers."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest

from benchmarks.synthetic_model import MOE_TEST, ensure_synthetic_model
from mesh_sidecar.llama.estimate import assign_layers, estimate_model
from mesh_sidecar.units import MIB
from tests.helpers.llama import complete
from tests.helpers.llama_buffers import RpcServer, answer_over_tcp, buffer_sizes_mib, llama_buffers

pytestmark = pytest.mark.slow

N_CTX = 4096
# moe-test's 6 blocks and head over three rpc-servers: two blocks each, the head on the last.
SPLIT = (2, 2, 3)
# The bound: per device, weights + K/V within 5 % of llama.cpp's, and all that with the compute
# margin at most 5 % above llama.cpp's total (never below).
MOE_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def moe_model() -> Path:
    """~213 MB: 8 experts of 1024 per block, 2 used per token (benchmarks/synthetic_model.py)."""
    return ensure_synthetic_model(MOE_TEST)


def _device_ranges(n_layers: int, split: Sequence[int]) -> list[tuple[int, int, bool]]:
    """(first block, end, holds the head) of each device, as llama.cpp assigns them."""
    devices = assign_layers(n_layers, split)
    ranges = []
    for d in range(len(split)):
        blocks = [il for il in range(n_layers) if devices[il] == d]
        ranges.append((blocks[0], blocks[-1] + 1, devices[n_layers] == d))
    return ranges


def test_estimate_matches_llama_cpp_buffers(binaries, moe_model: Path, tmp_path: Path) -> None:
    est = estimate_model(moe_model, N_CTX)
    buffers = llama_buffers(binaries, moe_model, SPLIT, N_CTX, tmp_path)
    # llama.cpp read the file as a mixture of experts (not as a dense llama).
    assert re.search(r"n_expert += 8\b", buffers.log) and re.search(r"n_expert_used += 2\b", buffers.log)
    assert buffers.assigned == {il: f"RPC{d}" for il, d in enumerate(assign_layers(est.n_layers, SPLIT))}

    print(f"\nmoe-test, -c {N_CTX}, --tensor-split {','.join(map(str, SPLIT))} (MiB, estimate vs llama.cpp):")
    for endpoint, (start, end, last) in zip(buffers.endpoints, _device_ranges(est.n_layers, SPLIT), strict=True):
        sizes = {kind: buffers.sizes_mib[(endpoint, kind)] for kind in ("model", "KV", "compute")}
        weights = (sum(est.layer_weight_bytes[start:end]) + (est.output_bytes if last else 0)) / MIB
        kv = (end - start) * est.kv_bytes_per_layer / MIB
        total = est.range_bytes(start, end, with_output=last) / MIB
        theirs = sizes["model"] + sizes["KV"] + sizes["compute"]
        print(f"  blocks [{start}, {end}){' + head' if last else ''}: weights {weights:.2f} vs {sizes['model']:.2f}, "
              f"KV {kv:.2f} vs {sizes['KV']:.2f}, compute {est.compute_margin_bytes / MIB:.2f} vs "
              f"{sizes['compute']:.2f}, total {total:.2f} vs {theirs:.2f} ({total / theirs - 1:+.2%})")
        assert weights + kv == pytest.approx(sizes["model"] + sizes["KV"], rel=MOE_TOLERANCE), (endpoint, sizes)
        assert sizes["compute"] <= est.compute_margin_bytes / MIB
        assert theirs <= total <= theirs * (1 + MOE_TOLERANCE), (endpoint, sizes, total)


def test_three_node_mesh_gives_the_same_text_as_rpc_over_tcp(start_node, binaries, moe_model: Path,
                                                              tmp_path: Path) -> None:
    a = start_node("a")
    start_node("b", "--join", a.ticket())
    c = start_node("c", "--join", a.ticket(), "--model", str(moe_model), "--min-peers", "2", serve=True)
    plan = c.status()["serving"]["plan"]
    assert sorted(n["name"] for n in plan["nodes"]) == ["a", "b", "c"]
    assert all(n["layers"][1] > n["layers"][0] for n in plan["nodes"]), plan["nodes"]
    text = complete(c.serve_port, ignore_eos=True)

    llama = next(p for p in c.status()["processes"] if p["name"] == "llama-server")
    mesh_argv = psutil.Process(llama["pid"]).cmdline()
    split = [int(w) for w in mesh_argv[mesh_argv.index("--tensor-split") + 1].split(",")]
    assert sum(split) == MOE_TEST.n_layers + 1 and len(split) == 3

    # The plan's figures per node beside what the mesh's llama-server logged (--rpc entry i = plan node i).
    sizes = buffer_sizes_mib(open(llama["log"]).read())
    endpoints = mesh_argv[mesh_argv.index("--rpc") + 1].split(",")
    print("\nplan vs llama.cpp in the mesh (MiB):")
    for endpoint, node in zip(endpoints, plan["nodes"], strict=True):
        theirs = {kind: sizes[(endpoint, kind)] for kind in ("model", "KV", "compute")}
        ours = (node["weights_bytes"] + node["output_bytes"] + node["kv_bytes"]) / MIB
        needed = node["needed_bytes"] / MIB
        print(f"  {node['name']} blocks {node['layers']}: weights + KV {ours:.2f} vs "
              f"{theirs['model'] + theirs['KV']:.2f}, with compute {needed:.2f} vs {sum(theirs.values()):.2f}")
        assert ours == pytest.approx(theirs["model"] + theirs["KV"], rel=MOE_TOLERANCE), (node, theirs)
        assert sum(theirs.values()) <= needed <= sum(theirs.values()) * (1 + MOE_TOLERANCE), (node, theirs)

    assert text == answer_over_tcp(mesh_argv, [RpcServer(binaries)] * len(endpoints), tmp_path,
                                   lambda port: complete(port, ignore_eos=True))
