"""The synthetic model generator (benchmarks/synthetic_model.py): dense presets keep their cached files, MoE
specs get the tensors llama.cpp's llama architecture reads (loaded for real in tests/integration/test_moe.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.synthetic_model import (
    BENCH_1GB,
    BENCH_4GB,
    CACHE_TEST,
    MOE_TEST,
    RPC_HASH_THRESHOLD_BYTES,
    TIER_TEST,
    tensor_plan,
)

N_VOCAB = 49152
# The cache keys of the dense presets from before specs had expert fields: their files keep their names.
DENSE_DIGESTS = {CACHE_TEST: "eb41d75d9f7f", BENCH_1GB: "ec051e87375b", TIER_TEST: "d893437ebabd"}


@pytest.mark.parametrize("spec", list(DENSE_DIGESTS), ids=lambda spec: spec.name)
def test_dense_presets_keep_their_cache_keys(spec) -> None:
    assert spec.digest() == DENSE_DIGESTS[spec]


@pytest.mark.parametrize(("spec", "low_gb", "high_gb"), [(BENCH_1GB, 1.1, 1.4), (BENCH_4GB, 3.6, 4.2)],
                         ids=lambda value: getattr(value, "name", str(value)))
def test_benchmark_presets_have_their_size_and_every_layer_matrix_goes_by_hash(spec, low_gb, high_gb) -> None:
    plan = tensor_plan(spec, N_VOCAB)
    assert low_gb * 1e9 < sum(t.n_bytes for t in plan) < high_gb * 1e9
    matrices = [t for t in plan if t.name.startswith("blk.") and len(t.shape) == 2]
    assert len(matrices) == 7 * spec.n_layers  # q, k, v, output, gate, up, down
    assert all(t.n_bytes > RPC_HASH_THRESHOLD_BYTES for t in matrices)


def test_expert_fields_are_part_of_the_cache_key() -> None:
    assert replace(MOE_TEST, n_experts_used=3).digest() != MOE_TEST.digest()
    assert replace(MOE_TEST, n_experts=0, n_experts_used=0).digest() != MOE_TEST.digest()


def test_moe_blocks_hold_expert_stacks_in_llama_shapes() -> None:
    plan = {t.name: t for t in tensor_plan(MOE_TEST, N_VOCAB)}
    n_exp, n_ff, n_embd = MOE_TEST.n_experts, MOE_TEST.n_ff, MOE_TEST.n_embd
    for i in range(MOE_TEST.n_layers):
        blk = f"blk.{i}"
        assert f"{blk}.ffn_gate.weight" not in plan
        # numpy order of llama.cpp's ne: router {n_embd, n_expert}, gate/up {n_embd, n_ff, n_expert},
        # down {n_ff, n_embd, n_expert}.
        assert plan[f"{blk}.ffn_gate_inp.weight"].shape == (n_exp, n_embd)
        assert plan[f"{blk}.ffn_gate_exps.weight"].shape == (n_exp, n_ff, n_embd)
        assert plan[f"{blk}.ffn_up_exps.weight"].shape == (n_exp, n_ff, n_embd)
        assert plan[f"{blk}.ffn_down_exps.weight"].shape == (n_exp, n_embd, n_ff)
    block = sum(t.n_bytes for name, t in plan.items() if name.startswith("blk.0."))
    experts = sum(t.n_bytes for name, t in plan.items() if name.startswith("blk.0.") and "_exps." in name)
    assert experts > 0.9 * block  # the experts are what a device holding the block pays for


def test_dense_plan_is_unchanged() -> None:
    names = {t.name for t in tensor_plan(CACHE_TEST, N_VOCAB)}
    assert "blk.0.ffn_gate.weight" in names and not any("_exps." in name or "gate_inp" in name for name in names)


@pytest.mark.parametrize(("n_experts", "n_experts_used"), [(8, 0), (0, 2), (4, 5)])
def test_inconsistent_expert_counts_are_refused(n_experts: int, n_experts_used: int) -> None:
    with pytest.raises(ValueError, match="n_experts_used"):
        replace(MOE_TEST, n_experts=n_experts, n_experts_used=n_experts_used)
