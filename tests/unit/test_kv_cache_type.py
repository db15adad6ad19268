"""--cache-type-k/-v: the K/V cache's bytes by element type, the types llama.cpp refuses, the argv, the plan.

(Against llama.cpp's own buffer figures: tests/integration/test_kv_cache_type.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mesh_sidecar.cli.views import plan_view
from mesh_sidecar.errors import ModelError, UsageError
from mesh_sidecar.llama.estimate import estimate_model, kv_block, kv_row_bytes
from mesh_sidecar.llama.kv_cache import DEFAULT_KV_CACHE, KV_CACHE_TYPES, KvCacheTypes
from mesh_sidecar.serve.planner import NodeCapacity, plan_layers
from tests.unit.test_cli_views import rendered
from tests.unit.test_estimate import (
    N_CTX,
    SMOL_HEAD_DIM,
    SMOL_KV_HEADS,
    TINY_KV,
    TINY_TENSORS,
    _write_gguf,
)

# One cell's K (or V) row of the default model: 3 K/V heads of 64.
SMOL_ROW_ELEMENTS = SMOL_KV_HEADS * SMOL_HEAD_DIM
Q8_0_BLOCK = (32, 34)  # 32 int8 and one f16 scale
Q4_0_BLOCK = (32, 18)  # 32 nibbles and one f16 scale
Q4_1_BLOCK = (32, 20)  # 32 nibbles, an f16 scale and an f16 minimum
GIB = 1 << 30


def smol_kv_per_layer(model_path: Path, k: str, v: str) -> int:
    return estimate_model(model_path, N_CTX, kv_cache=KvCacheTypes(k, v)).kv_bytes_per_layer


def test_element_sizes_come_from_gguf_py() -> None:
    assert kv_block("f32") == (1, 4) and kv_block("f16") == (1, 2) and kv_block("bf16") == (1, 2)
    assert kv_block("q8_0") == Q8_0_BLOCK and kv_block("q4_0") == Q4_0_BLOCK and kv_block("q4_1") == Q4_1_BLOCK
    assert {name: kv_block(name)[0] for name in KV_CACHE_TYPES if kv_block(name)[0] > 1} == {
        "q8_0": 32, "q4_0": 32, "q4_1": 32, "iq4_nl": 32, "q5_0": 32, "q5_1": 32}
    assert kv_row_bytes("q8_0", 192) == 6 * 34
    with pytest.raises(ValueError, match="whole q8_0 blocks"):
        kv_row_bytes("q8_0", 48)


def test_f16_is_the_default_and_unchanged(model_path: Path) -> None:
    assert estimate_model(model_path, N_CTX).kv_cache == DEFAULT_KV_CACHE == KvCacheTypes("f16", "f16")
    assert smol_kv_per_layer(model_path, "f16", "f16") == N_CTX * SMOL_ROW_ELEMENTS * 2 * 2


@pytest.mark.parametrize(("k", "v", "k_block", "v_block"), [
    ("q8_0", "q8_0", Q8_0_BLOCK, Q8_0_BLOCK),
    ("q4_0", "q4_0", Q4_0_BLOCK, Q4_0_BLOCK),
    ("q8_0", "q4_1", Q8_0_BLOCK, Q4_1_BLOCK),  # K and V sized separately
    ("f16", "q8_0", (1, 2), Q8_0_BLOCK),
    ("f32", "bf16", (1, 4), (1, 2)),
])
def test_kv_bytes_by_type(model_path: Path, k: str, v: str, k_block: tuple[int, int],
                          v_block: tuple[int, int]) -> None:
    def row(block: tuple[int, int]) -> int:
        return SMOL_ROW_ELEMENTS // block[0] * block[1]
    est = estimate_model(model_path, N_CTX, kv_cache=KvCacheTypes(k, v))
    assert est.kv_bytes_per_layer == N_CTX * (row(k_block) + row(v_block))
    assert est.kv_cache == KvCacheTypes(k, v)


def test_q8_0_about_halves_the_cache(model_path: Path) -> None:
    f16 = smol_kv_per_layer(model_path, "f16", "f16")
    assert smol_kv_per_layer(model_path, "q8_0", "q8_0") * 64 == f16 * 34  # 34 bytes per 32 elements, not 64
    assert smol_kv_per_layer(model_path, "q4_0", "q4_0") * 64 == f16 * 18


@pytest.mark.parametrize(("k", "v", "option"), [("q8", "f16", "--cache-type-k"), ("f16", "Q8_0", "--cache-type-v"),
                                                ("q4_k", "q4_k", "--cache-type-k")])
def test_a_type_llama_cpp_does_not_take_is_refused(k: str, v: str, option: str) -> None:
    with pytest.raises(UsageError, match=re.escape(option)) as refused:
        KvCacheTypes(k, v)
    assert ", ".join(KV_CACHE_TYPES) in str(refused.value)


def test_llama_server_gets_the_options_only_when_not_f16() -> None:
    assert DEFAULT_KV_CACHE.llama_server_args() == []
    assert KvCacheTypes("q8_0", "q8_0").llama_server_args() == ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]
    assert KvCacheTypes("f16", "q4_0").llama_server_args() == ["--cache-type-v", "q4_0"]
    assert KvCacheTypes("bf16", "f16").llama_server_args() == ["--cache-type-k", "bf16"]
    assert str(KvCacheTypes("q8_0", "q4_1")) == "q8_0/q4_1"


def test_blocks_that_do_not_divide_a_head_are_a_model_error(tmp_path: Path) -> None:
    # TINY_KV: heads of 8 / 2 = 4 elements, fewer than a quantized block of 32.
    path = _write_gguf(tmp_path / "tiny.gguf", "tiny", TINY_KV, TINY_TENSORS)
    assert estimate_model(path, 256, kv_cache=KvCacheTypes("f32", "bf16")).kv_bytes_per_layer == 256 * 2 * 4 * 6
    for cache, option in ((KvCacheTypes("q8_0", "f16"), "--cache-type-k q8_0"),
                          (KvCacheTypes("f16", "q4_0"), "--cache-type-v q4_0")):
        with pytest.raises(ModelError, match=f"{option} stores blocks of 32 elements.*heads of 4"):
            estimate_model(path, 256, kv_cache=cache)


def test_quantized_v_without_flash_attention_is_a_model_error(tmp_path: Path) -> None:
    """llama.cpp turns flash attention off for Grok, and a quantized V cache needs it; a quantized K does not."""
    kv = {key.replace("tiny.", "grok."): value for key, value in TINY_KV.items()}
    kv.update({"grok.attention.key_length": 32, "grok.attention.value_length": 32})
    path = _write_gguf(tmp_path / "grok.gguf", "grok", kv, TINY_TENSORS)
    with pytest.raises(ModelError, match=r"flash attention.*--cache-type-v f16"):
        estimate_model(path, 256, kv_cache=KvCacheTypes("q8_0", "q8_0"))
    assert estimate_model(path, 256, kv_cache=KvCacheTypes("q8_0", "f16")).kv_cache.k == "q8_0"


def test_plan_shows_what_its_kv_figures_assume(model_path: Path) -> None:
    est = estimate_model(model_path, N_CTX, kv_cache=KvCacheTypes("q8_0", "q8_0"))
    plan = plan_layers([NodeCapacity(b"w" * 32, "worker", GIB), NodeCapacity(b"s" * 32, "server", GIB)], est)
    assert sum(node.kv_bytes for node in plan.nodes) == est.kv_bytes
    as_json = plan.to_json()
    assert as_json["kv_cache_type"] == "q8_0/q8_0"
    assert "30 layers, KV cache q8_0/q8_0" in rendered(plan_view(as_json), 80)
