"""Memory estimate: the default GGUF's numbers, the formulas and errors
(against llama.cpp's own figures: tests/integration/test_estimate.py)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from hypothesis import given
from hypothesis import strategies as st

from mesh_sidecar.errors import ModelError
from mesh_sidecar.llama.estimate import (
    DEFAULT_N_UBATCH,
    ModelEstimate,
    assign_layers,
    compute_margin,
    estimate_model,
    kv_cells,
)
from mesh_sidecar.units import MIB

N_CTX = 4096
# SmolLM2-135M: 30 blocks, 576 wide, 9 query heads sharing 3 K/V heads of 64.
SMOL_LAYERS = 30
SMOL_KV_HEADS = 3
SMOL_HEAD_DIM = 64
SMOL_EMBD = 576
SMOL_FFN = 1536
SMOL_VOCAB = 49152

# Compute buffer per RPC device that the pinned llama.cpp logs for the default
# model with 2 rpc-servers (pipeline parallelism), by (n_ctx, n_ubatch); MiB.
MEASURED_COMPUTE_MIB = {(1024, 512): 20.91, (4096, 512): 32.91, (8192, 512): 48.91, (4096, 256): 16.46}
# The margin may exceed llama.cpp's figure by its slack and a little more, never fall short.
MARGIN_OVERSHOOT_MIB = 1.5


@pytest.fixture(scope="module")
def smol(model_path: Path) -> ModelEstimate:
    return estimate_model(model_path, N_CTX)


def test_default_model_shape(smol: ModelEstimate) -> None:
    assert smol.n_layers == SMOL_LAYERS
    assert len(smol.layer_weight_bytes) == SMOL_LAYERS
    assert smol.architecture == "llama"
    assert smol.name
    assert smol.tied_output  # SmolLM2 has no output.weight
    # Every block of this model has the same tensors.
    assert len(set(smol.layer_weight_bytes)) == 1


def test_parts_add_up_to_the_file(smol: ModelEstimate, model_path: Path) -> None:
    reader = GGUFReader(model_path)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    embd = next(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    # The tied head is a second copy of token_embd on the last device.
    counted = sum(smol.layer_weight_bytes) + smol.host_bytes + smol.output_bytes
    assert counted == pytest.approx(file_bytes + embd, rel=1e-3)
    assert smol.host_bytes == embd
    assert smol.output_bytes >= embd
    assert smol.weight_bytes == counted


def test_kv_formula(smol: ModelEstimate, model_path: Path) -> None:
    # K and V, f16, for each of the 3 K/V heads (GQA), not the 9 query heads.
    assert smol.kv_bytes_per_layer == 2 * N_CTX * SMOL_KV_HEADS * SMOL_HEAD_DIM * 2
    assert smol.kv_bytes == SMOL_LAYERS * smol.kv_bytes_per_layer
    assert smol.n_ctx == N_CTX
    # llama.cpp pads the cache to 256 cells.
    assert estimate_model(model_path, 4000).kv_bytes_per_layer == smol.kv_bytes_per_layer
    assert kv_cells(1) == 256 and kv_cells(256) == 256 and kv_cells(257) == 512


def test_layer_and_range_bytes(smol: ModelEstimate) -> None:
    assert smol.layer_bytes(3) == smol.layer_weight_bytes[3] + smol.kv_bytes_per_layer
    inner = smol.range_bytes(0, 10, with_output=False)
    assert inner == sum(smol.layer_bytes(i) for i in range(10)) + smol.compute_margin_bytes
    assert smol.range_bytes(10, 30, with_output=True) == (
        sum(smol.layer_bytes(i) for i in range(10, 30)) + smol.compute_margin_bytes + smol.output_bytes)
    assert smol.range_bytes(5, 5, with_output=False) == 0  # holds nothing: not a participant
    assert smol.total_bytes == smol.weight_bytes + smol.kv_bytes
    with pytest.raises(ValueError):
        smol.range_bytes(0, SMOL_LAYERS + 1, with_output=True)


def test_margin_comes_from_the_model_hyperparameters(smol: ModelEstimate) -> None:
    assert smol.compute_margin_bytes == compute_margin(
        n_ctx=N_CTX, n_embd=SMOL_EMBD, n_ff=SMOL_FFN, n_vocab=SMOL_VOCAB, n_ubatch=DEFAULT_N_UBATCH)


@pytest.mark.parametrize(("n_ctx", "n_ubatch"), sorted(MEASURED_COMPUTE_MIB))
def test_compute_margin_covers_measured_buffers(n_ctx: int, n_ubatch: int) -> None:
    margin = compute_margin(n_ctx=n_ctx, n_embd=SMOL_EMBD, n_ff=SMOL_FFN, n_vocab=SMOL_VOCAB, n_ubatch=n_ubatch)
    measured = MEASURED_COMPUTE_MIB[(n_ctx, n_ubatch)]
    assert measured <= margin / MIB <= measured + MARGIN_OVERSHOOT_MIB


def test_compute_margin_uses_logits_when_vocab_dominates() -> None:
    small = compute_margin(n_ctx=256, n_embd=64, n_ff=256, n_vocab=1000, n_ubatch=DEFAULT_N_UBATCH)
    huge_vocab = compute_margin(n_ctx=256, n_embd=64, n_ff=256, n_vocab=10_000_000, n_ubatch=DEFAULT_N_UBATCH)
    assert huge_vocab - small > 100 * MIB


def test_tensor_split_assignment_matches_llama_rule() -> None:
    devices = assign_layers(SMOL_LAYERS, [10, 21])
    assert devices == (0,) * 10 + (1,) * 21  # 10 blocks; 20 blocks + the head
    # Equal weights (as for equal free memory): 31 layers in thirds, rounded up at each boundary.
    assert Counter(assign_layers(SMOL_LAYERS, [1, 1, 1])) == {0: 11, 1: 10, 2: 10}
    # A zero-weight last device gets nothing, so the head goes to the last one with weight.
    assert assign_layers(4, [1, 1, 0])[-1] == 1
    with pytest.raises(ValueError):
        assign_layers(SMOL_LAYERS, [0, 0])


@given(st.lists(st.integers(0, 200), min_size=1, max_size=12).filter(lambda c: sum(c) >= 1))
def test_integer_counts_give_exact_layers(counts: list[int]) -> None:
    """Weights k_j with sum n_layers + 1 give device j exactly k_j layers (the head last)."""
    n_layers = sum(counts) - 1
    if n_layers < 1:
        return
    got = Counter(assign_layers(n_layers, counts))
    assert [got.get(j, 0) for j in range(len(counts))] == counts


def _write_gguf(path: Path, arch: str, kv: dict[str, int], tensors: dict[str, tuple[int, ...]]) -> Path:
    writer = GGUFWriter(str(path), arch)
    for key, value in kv.items():
        writer.add_uint32(key, value)
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY_TENSORS = {"token_embd.weight": (32, 8), "blk.0.attn_q.weight": (8, 8), "blk.1.attn_q.weight": (8, 8),
                "output_norm.weight": (8,), "output.weight": (32, 8)}
TINY_KV = {"tiny.block_count": 2, "tiny.embedding_length": 8, "tiny.attention.head_count": 2}


def test_tiny_gguf_untied_head_and_defaults(tmp_path: Path) -> None:
    est = estimate_model(_write_gguf(tmp_path / "tiny.gguf", "tiny", TINY_KV, TINY_TENSORS), 256)
    assert not est.tied_output
    assert est.layer_weight_bytes == (8 * 8 * 4, 8 * 8 * 4)
    assert est.host_bytes == 32 * 8 * 4
    assert est.output_bytes == 32 * 8 * 4 + 32  # head + norm (8 floats, aligned to 32 bytes)
    # No head_count_kv: every head has its own K/V; head_dim = 8 / 2.
    assert est.kv_bytes_per_layer == 2 * 256 * 2 * 4 * 2


def test_tiny_gguf_gqa_and_explicit_head_lengths(tmp_path: Path) -> None:
    kv = {**TINY_KV, "tiny.attention.head_count_kv": 1, "tiny.attention.key_length": 16,
          "tiny.attention.value_length": 8}
    est = estimate_model(_write_gguf(tmp_path / "gqa.gguf", "tiny", kv, TINY_TENSORS), 300)
    # 300 tokens -> 512 cells; one K/V head; K rows of 16, V rows of 8; f16.
    assert est.kv_bytes_per_layer == 512 * 1 * (16 + 8) * 2


@pytest.mark.parametrize("missing", sorted(TINY_KV))
def test_missing_metadata_is_a_model_error(tmp_path: Path, missing: str) -> None:
    kv = {k: v for k, v in TINY_KV.items() if k != missing}
    with pytest.raises(ModelError, match=re.escape(missing)):
        estimate_model(_write_gguf(tmp_path / "bad.gguf", "tiny", kv, TINY_TENSORS), 256)


def test_recurrent_model_is_a_model_error(tmp_path: Path) -> None:
    kv = {key.replace("tiny.", "mamba."): value for key, value in TINY_KV.items()}
    path = _write_gguf(tmp_path / "ssm.gguf", "mamba", {**kv, "mamba.ssm.state_size": 16}, TINY_TENSORS)
    with pytest.raises(ModelError, match="not a plain K/V cache"):
        estimate_model(path, 256)


def test_block_outside_block_count_is_a_model_error(tmp_path: Path) -> None:
    tensors = {**TINY_TENSORS, "blk.2.attn_q.weight": (8, 8)}
    path = _write_gguf(tmp_path / "odd.gguf", "tiny", TINY_KV, tensors)
    with pytest.raises(ModelError, match=r"blk\.2"):
        estimate_model(path, 256)


def test_not_a_gguf_is_a_model_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ModelError, match="not a GGUF"):
        estimate_model(junk, 256)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelError, match="GGUF header"):
        estimate_model(truncated, 256)


# --- mixture of experts ---------------------------------------------------------

# Compute buffer per RPC device that the pinned llama.cpp logs for the synthetic moe-test model
# (benchmarks/synthetic_model.py: llama architecture, n_embd 512, 8 experts of 1024, 2 used) with
# rpc-servers holding two blocks or more, by (n_ctx, n_ubatch); MiB.
MOE_TEST_EMBD, MOE_TEST_FF_EXP, MOE_TEST_USED = 512, 1024, 2
MEASURED_MOE_TEST_COMPUTE_MIB = {(1024, 512): 23.04, (4096, 512): 35.04, (8192, 512): 51.04, (4096, 256): 17.52,
                                 (4096, 128): 8.76}
# The same for other synthetic llama MoE shapes at -c 4096 -ub 512, by (n_embd, n_ff_exp, n_expert_used);
# the expert count (8 to 256) did not change the figures.
MEASURED_MOE_COMPUTE_MIB = {
    (256, 1024, 2): 31.54, (1024, 1024, 2): 42.04, (512, 1024, 4): 47.04, (512, 512, 2): 29.04,
    (512, 2048, 2): 47.04, (512, 512, 8): 47.04, (640, 512, 4): 36.79, (768, 512, 4): 38.54,
    (896, 512, 4): 40.29, (1024, 512, 2): 34.04,
    (512, 256, 8): 35.04, (512, 256, 4): 29.04,  # the down output at twice the routed width still fits
    (768, 256, 4): 38.54, (512, 128, 8): 37.04, (512, 128, 16): 51.04, (512, 128, 4): 27.04,
    (512, 64, 8): 31.04, (1024, 128, 8): 46.04, (512, 1024, 1): 28.07, (1024, 256, 1): 32.04,
}
# Where part of a wide down projection's output fits in freed memory, the margin still charges all of it.
MOE_MARGIN_OVERSHOOT = 0.16


def _moe_margin(n_ctx: int = N_CTX, n_ubatch: int = DEFAULT_N_UBATCH, *, n_embd: int = MOE_TEST_EMBD,
                n_ff_exp: int = MOE_TEST_FF_EXP, n_expert_used: int = MOE_TEST_USED) -> int:
    return compute_margin(n_ctx=n_ctx, n_embd=n_embd, n_ff=0, n_vocab=SMOL_VOCAB, n_ubatch=n_ubatch,
                          n_expert_used=n_expert_used, n_ff_exp=n_ff_exp)


@pytest.mark.parametrize(("n_ctx", "n_ubatch"), sorted(MEASURED_MOE_TEST_COMPUTE_MIB))
def test_moe_margin_covers_measured_buffers(n_ctx: int, n_ubatch: int) -> None:
    measured = MEASURED_MOE_TEST_COMPUTE_MIB[(n_ctx, n_ubatch)]
    assert measured <= _moe_margin(n_ctx, n_ubatch) / MIB <= measured + MARGIN_OVERSHOOT_MIB


@pytest.mark.parametrize(("n_embd", "n_ff_exp", "n_expert_used"), sorted(MEASURED_MOE_COMPUTE_MIB))
def test_moe_margin_covers_other_shapes(n_embd: int, n_ff_exp: int, n_expert_used: int) -> None:
    measured = MEASURED_MOE_COMPUTE_MIB[(n_embd, n_ff_exp, n_expert_used)]
    margin = _moe_margin(n_embd=n_embd, n_ff_exp=n_ff_exp, n_expert_used=n_expert_used) / MIB
    assert measured <= margin <= measured * (1 + MOE_MARGIN_OVERSHOOT)


def test_moe_margin_counts_every_used_expert() -> None:
    # A dense block of the expert's width would fall short of what moe-test's graph needs.
    dense = compute_margin(n_ctx=N_CTX, n_embd=MOE_TEST_EMBD, n_ff=MOE_TEST_FF_EXP, n_vocab=SMOL_VOCAB)
    assert dense / MIB < MEASURED_MOE_TEST_COMPUTE_MIB[(N_CTX, DEFAULT_N_UBATCH)]
    # Each more expert used adds three routed rows per token of the micro-batch.
    assert _moe_margin(n_expert_used=3) - _moe_margin() == DEFAULT_N_UBATCH * 4 * 3 * MOE_TEST_FF_EXP


def _moe_tensors(n_expert: int, n_ff: int) -> dict[str, tuple[int, ...]]:
    """TINY_TENSORS with a routed FFN in both blocks, in llama.cpp's shapes (numpy order)."""
    tensors = dict(TINY_TENSORS)
    for blk in ("blk.0", "blk.1"):
        tensors |= {f"{blk}.ffn_gate_inp.weight": (n_expert, 8),
                    f"{blk}.ffn_gate_exps.weight": (n_expert, n_ff, 8),
                    f"{blk}.ffn_up_exps.weight": (n_expert, n_ff, 8),
                    f"{blk}.ffn_down_exps.weight": (n_expert, 8, n_ff)}
    return tensors


def test_tiny_moe_counts_every_expert(tmp_path: Path) -> None:
    # Mixtral as the llama architecture: no expert_feed_forward_length, the experts are n_ff wide.
    kv = {**TINY_KV, "tiny.feed_forward_length": 16, "tiny.expert_count": 4, "tiny.expert_used_count": 2}
    est = estimate_model(_write_gguf(tmp_path / "moe.gguf", "tiny", kv, _moe_tensors(4, 16)), 256)
    # attn_q, the router (4 x 8) and three stacks of 4 experts of 16 x 8, all f32: all 4 experts count.
    block = 8 * 8 * 4 + 4 * 8 * 4 + 3 * 4 * 16 * 8 * 4
    assert est.layer_weight_bytes == (block, block)
    assert est.compute_margin_bytes == compute_margin(n_ctx=256, n_embd=8, n_ff=0, n_vocab=32, n_expert_used=2,
                                                      n_ff_exp=16)


def test_tiny_moe_with_an_expert_width(tmp_path: Path) -> None:
    # Qwen3-MoE, DeepSeek: expert_feed_forward_length is the experts', feed_forward_length any dense block's.
    kv = {**TINY_KV, "tiny.feed_forward_length": 64, "tiny.expert_feed_forward_length": 16, "tiny.expert_count": 4,
          "tiny.expert_used_count": 2}
    est = estimate_model(_write_gguf(tmp_path / "moe.gguf", "tiny", kv, _moe_tensors(4, 16)), 256)
    assert est.compute_margin_bytes == compute_margin(n_ctx=256, n_embd=8, n_ff=64, n_vocab=32, n_expert_used=2,
                                                      n_ff_exp=16)
    # Without a used count llama.cpp routes nothing: the margin is the dense one.
    kv = {key: value for key, value in kv.items() if key != "tiny.expert_used_count"}
    est = estimate_model(_write_gguf(tmp_path / "unrouted.gguf", "tiny", kv, _moe_tensors(4, 16)), 256)
    assert est.compute_margin_bytes == compute_margin(n_ctx=256, n_embd=8, n_ff=64, n_vocab=32)
