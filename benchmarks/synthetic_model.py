"""Llama-architecture GGUF models with random weights, made on demand and cached.

Benchmarks and tests need models of a chosen size and tensor layout (for
instance, every layer matrix above llama.cpp's RPC ``HASH_THRESHOLD`` of
10 MiB, so that all of them travel as ``SET_TENSOR_HASH``) without downloading
gigabytes. These models answer nonsense, but llama.cpp loads and runs them like
real ones, so load and decode timings are real.

A spec with ``n_experts`` makes a mixture-of-experts model the way llama.cpp's
llama architecture reads one (as Mixtral's GGUFs are): ``llama.expert_count``,
``llama.expert_used_count``, and per block a router ``ffn_gate_inp`` and 3-D
``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps`` stacks of ``n_experts``
matrices, each ``feed_forward_length`` wide, in place of the dense FFN.

The tokenizer (vocabulary of 49152, merges, special ids, chat template) is
copied from the default SmolLM2 model, so llama.cpp tokenizes prompts normally.
The output head is tied to ``token_embd`` (no ``output.weight``), as in SmolLM2.

Weights are drawn from a numpy Generator seeded per tensor from the spec's seed
and the tensor's name, so one spec always gives the same bytes. The file is
written one tensor at a time (peak memory: about one tensor), to a ``.partial``
file renamed into place when complete, under
``cache_root()/models/synthetic-<name>-<hash of the spec>.gguf``. Models live in
the cache, never in the repository.

    .venv/bin/python -m benchmarks.synthetic_model [--preset cache-test|bench-1gb|bench-4gb|tier-test|moe-test] [--plan]

prints the model's path (generating it first if needed); ``--plan`` prints the
tensors and their sizes instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

from mesh_sidecar.home import cache_root
from mesh_sidecar.llama.model import ensure_model
from mesh_sidecar.progress import ProgressCallback

RPC_HASH_THRESHOLD_BYTES = 10 * 1024 * 1024  # llama.cpp ggml-rpc: larger tensors go as SET_TENSOR_HASH
WEIGHT_STD = 0.02
NORM_VALUE = 1.0
RMS_NORM_EPS = 1e-5
ROPE_FREQ_BASE = 100000.0
FILL_CHUNK_VALUES = 1 << 22  # normals drawn per step: 16 MiB of float32
# Bump when the bytes a spec produces change (layout, metadata, drawing), so stale caches are not reused.
GENERATOR_VERSION = 1
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16}


@dataclass(frozen=True)
class SyntheticSpec:
    """The shape of a synthetic llama model; the same spec always gives the same file."""

    name: str  # part of the file name and of general.name
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    attn_dtype: str  # "F32" or "F16": attn_q, attn_k, attn_v, attn_output
    ffn_dtype: str  # "F32" or "F16": ffn_gate, ffn_up, ffn_down
    embd_dtype: str  # "F32" or "F16": token_embd, also the (tied) output head
    seed: int = 0
    ctx_len: int = 4096
    n_experts: int = 0  # 0: a dense FFN; else experts per block, each n_ff wide, in ffn_dtype
    n_experts_used: int = 0  # experts the router picks per token (0 when dense)

    def __post_init__(self) -> None:
        for field_name in ("attn_dtype", "ffn_dtype", "embd_dtype"):
            if getattr(self, field_name) not in _NUMPY_DTYPES:
                raise ValueError(f"{field_name} must be one of {sorted(_NUMPY_DTYPES)}")
        if min(self.n_layers, self.n_embd, self.n_ff, self.n_head, self.n_head_kv, self.ctx_len) <= 0:
            raise ValueError("layer, embedding, ffn, head and context sizes must be positive")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv or (self.n_embd // self.n_head) % 2:
            raise ValueError("n_embd must split into n_head even-sized heads, n_head into n_head_kv groups")
        dense = self.n_experts == self.n_experts_used == 0
        if not dense and not 1 <= self.n_experts_used <= self.n_experts:
            raise ValueError("a MoE spec needs 1 <= n_experts_used <= n_experts; a dense one has both 0")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def digest(self) -> str:
        """A short hash of the spec and the generator version: the cache key."""
        fields = asdict(self)
        if not self.n_experts:
            # Dense specs hash as before the MoE fields existed, so their cached files keep their names.
            del fields["n_experts"], fields["n_experts_used"]
        key = json.dumps({"generator": GENERATOR_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:12]


# A test model: 2 layers, ~342 MB, every per-layer matrix above RPC_HASH_THRESHOLD_BYTES
# (attention 1664x1664 F32 = 11.08 MB, ffn 1664x4480 F16 = 14.91 MB; 10 MiB = 10.49 MB).
CACHE_TEST = SyntheticSpec(
    name="cache-test", n_layers=2, n_embd=1664, n_ff=4480, n_head=13, n_head_kv=13,
    attn_dtype="F32", ffn_dtype="F16", embd_dtype="F16",
)
# Three layers of CACHE_TEST's (~432 MB): a three-node split where each worker holds by-hash tensors.
SHARE_TEST = SyntheticSpec(
    name="share-test", n_layers=3, n_embd=1664, n_ff=4480, n_head=13, n_head_kv=13,
    attn_dtype="F32", ffn_dtype="F16", embd_dtype="F16",
)
# A benchmark model: 8 layers, ~1.25 GB, all F16 and still every layer matrix above the
# threshold (attention 2304x2304 F16 = 10.62 MB, ffn 2304x6144 F16 = 28.31 MB).
BENCH_1GB = SyntheticSpec(
    name="bench-1gb", n_layers=8, n_embd=2304, n_ff=6144, n_head=18, n_head_kv=18,
    attn_dtype="F16", ffn_dtype="F16", embd_dtype="F16",
)
# The larger benchmark model (issue 40's GPU comparison asks for one beyond bench-1gb): 16 layers,
# ~3.9 GB F16, a layer's matrices 3072 wide (attention 18.9 MB, ffn 50.3 MB each).
BENCH_4GB = SyntheticSpec(
    name="bench-4gb", n_layers=16, n_embd=3072, n_ff=8192, n_head=24, n_head_kv=24,
    attn_dtype="F16", ffn_dtype="F16", embd_dtype="F16",
)
# A bigger model tier for tests: 8 layers, ~330 MB, SmolLM2-135M's embedding width, so its
# layers (not its 56 MB embeddings) are what spreads it over several capped nodes.
TIER_TEST = SyntheticSpec(
    name="tier-test", n_layers=8, n_embd=576, n_ff=8192, n_head=9, n_head_kv=3,
    attn_dtype="F16", ffn_dtype="F16", embd_dtype="F16",
)
# A mixture-of-experts test model: 6 layers, ~213 MB, 8 experts of 1024 per block, 2 used per
# token. The experts are 94 % of a block's bytes, and the routed FFN activations (2 x 1024 per
# token) outgrow the dense formula's single n_ff row set, so both the weights and the MoE compute
# buffer are visible in llama.cpp's per-device figures.
MOE_TEST = SyntheticSpec(
    name="moe-test", n_layers=6, n_embd=512, n_ff=1024, n_head=8, n_head_kv=4,
    attn_dtype="F16", ffn_dtype="F16", embd_dtype="F16", n_experts=8, n_experts_used=2,
)
PRESETS = {spec.name: spec for spec in (CACHE_TEST, SHARE_TEST, BENCH_1GB, BENCH_4GB, TIER_TEST, MOE_TEST)}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a synthetic model, in file order."""

    name: str
    shape: tuple[int, ...]  # numpy order (rows, columns); GGUF stores it reversed
    dtype: str  # "F32" or "F16"
    fill: float | None  # a constant value (norms), or None for random normal weights

    @property
    def n_bytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(_NUMPY_DTYPES[self.dtype]).itemsize


def tensor_plan(spec: SyntheticSpec, n_vocab: int) -> list[TensorPlan]:
    """The tensors of ``spec``'s model, in the order they are written."""
    n_embd_kv = spec.head_dim * spec.n_head_kv
    plan = [
        TensorPlan("token_embd.weight", (n_vocab, spec.n_embd), spec.embd_dtype, None),
        TensorPlan("output_norm.weight", (spec.n_embd,), "F32", NORM_VALUE),
    ]
    for i in range(spec.n_layers):
        blk = f"blk.{i}"
        plan += [
            TensorPlan(f"{blk}.attn_norm.weight", (spec.n_embd,), "F32", NORM_VALUE),
            TensorPlan(f"{blk}.attn_q.weight", (spec.n_embd, spec.n_embd), spec.attn_dtype, None),
            TensorPlan(f"{blk}.attn_k.weight", (n_embd_kv, spec.n_embd), spec.attn_dtype, None),
            TensorPlan(f"{blk}.attn_v.weight", (n_embd_kv, spec.n_embd), spec.attn_dtype, None),
            TensorPlan(f"{blk}.attn_output.weight", (spec.n_embd, spec.n_embd), spec.attn_dtype, None),
            TensorPlan(f"{blk}.ffn_norm.weight", (spec.n_embd,), "F32", NORM_VALUE),
        ]
        plan += _moe_ffn(spec, blk) if spec.n_experts else [
            TensorPlan(f"{blk}.ffn_gate.weight", (spec.n_ff, spec.n_embd), spec.ffn_dtype, None),
            TensorPlan(f"{blk}.ffn_up.weight", (spec.n_ff, spec.n_embd), spec.ffn_dtype, None),
            TensorPlan(f"{blk}.ffn_down.weight", (spec.n_embd, spec.n_ff), spec.ffn_dtype, None),
        ]
    return plan


def _moe_ffn(spec: SyntheticSpec, blk: str) -> list[TensorPlan]:
    # Shapes as llama_model_llama::load_arch_tensors creates them (ne reversed): the router
    # {n_embd, n_expert}, gate/up {n_embd, n_ff, n_expert}, down {n_ff, n_embd, n_expert}.
    n_exp = spec.n_experts
    return [
        TensorPlan(f"{blk}.ffn_gate_inp.weight", (n_exp, spec.n_embd), "F32", None),
        TensorPlan(f"{blk}.ffn_gate_exps.weight", (n_exp, spec.n_ff, spec.n_embd), spec.ffn_dtype, None),
        TensorPlan(f"{blk}.ffn_up_exps.weight", (n_exp, spec.n_ff, spec.n_embd), spec.ffn_dtype, None),
        TensorPlan(f"{blk}.ffn_down_exps.weight", (n_exp, spec.n_embd, spec.n_ff), spec.ffn_dtype, None),
    ]


def synthetic_model_path(spec: SyntheticSpec) -> Path:
    return cache_root() / "models" / f"synthetic-{spec.name}-{spec.digest()}.gguf"


def ensure_synthetic_model(spec: SyntheticSpec, progress: ProgressCallback | None = None) -> Path:
    """The cached model file of ``spec``, generated first if it is not there yet."""
    path = synthetic_model_path(spec)
    if path.exists():
        return path
    report = progress or (lambda _message, _done, _total: None)
    tokenizer_source = ensure_model(None, report)
    path.parent.mkdir(parents=True, exist_ok=True)
    # pid in the name: concurrent generators of one spec each write their own file; the last rename wins.
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        _write_model(spec, gguf.GGUFReader(tokenizer_source), partial, report)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _write_model(
    spec: SyntheticSpec, tokenizer: gguf.GGUFReader, out: Path, report: ProgressCallback
) -> None:
    n_vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].data)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA]
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"synthetic-{spec.name}")
    writer.add_description("Random weights for benchmarks and tests: the outputs are nonsense.")
    any_f16 = "F16" in (spec.attn_dtype, spec.ffn_dtype, spec.embd_dtype)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if any_f16 else gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(spec.ctx_len)
    writer.add_embedding_length(spec.n_embd)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_block_count(spec.n_layers)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_vocab_size(n_vocab)
    if spec.n_experts:
        writer.add_expert_count(spec.n_experts)
        writer.add_expert_used_count(spec.n_experts_used)
    _copy_tokenizer(tokenizer, writer)

    plan = tensor_plan(spec, n_vocab)
    for t in plan:
        np_dtype = np.dtype(_NUMPY_DTYPES[t.dtype])
        writer.add_tensor_info(t.name, t.shape, np_dtype, t.n_bytes)
    total = sum(t.n_bytes for t in plan)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done = 0
        for t in plan:
            writer.write_tensor_data(_tensor_values(spec, t))
            done += t.n_bytes
            report(f"Writing synthetic model {spec.name}", done, total)
    finally:
        writer.close()


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every ``tokenizer.*`` key of ``reader``, values and types unchanged."""
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        main_type = field.types[0]
        sub_type = field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, raw_contents(field), main_type, sub_type=sub_type)


def raw_contents(field: gguf.ReaderField) -> object:
    # Strings stay bytes: the writer stores them as given, so nothing is decoded and re-encoded.
    if gguf.GGUFValueType.STRING not in field.types:
        return field.contents()
    strings = [field.parts[i].tobytes() for i in field.data]
    return strings if field.types[0] == gguf.GGUFValueType.ARRAY else strings[0]


def _tensor_values(spec: SyntheticSpec, t: TensorPlan) -> np.ndarray:
    values = np.empty(t.shape, dtype=_NUMPY_DTYPES[t.dtype])
    if t.fill is not None:
        values.fill(t.fill)
        return values
    # Seeded by name, not position, so a tensor's bytes do not depend on the other tensors.
    rng = np.random.default_rng([spec.seed, zlib.crc32(t.name.encode())])
    flat = values.reshape(-1)
    chunk = np.empty(min(FILL_CHUNK_VALUES, flat.size), dtype=np.float32)
    for start in range(0, flat.size, chunk.size):
        part = chunk[: min(chunk.size, flat.size - start)]
        rng.standard_normal(dtype=np.float32, out=part)
        part *= WEIGHT_STD
        flat[start : start + part.size] = part
    return values


def _print_plan(spec: SyntheticSpec) -> None:
    n_vocab = 49152  # the default model's vocabulary; --plan reads no file
    plan = tensor_plan(spec, n_vocab)
    for t in plan:
        hashed = "hashed" if t.n_bytes > RPC_HASH_THRESHOLD_BYTES else ""
        print(f"{t.name:28} {t.dtype} {'x'.join(map(str, t.shape)):>12} {t.n_bytes:>12,} B  {hashed}")
    print(f"total {sum(t.n_bytes for t in plan):,} B; RPC hash threshold {RPC_HASH_THRESHOLD_BYTES:,} B")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.synthetic_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default=CACHE_TEST.name)
    parser.add_argument("--plan", action="store_true", help="print the tensors and sizes, generate nothing")
    args = parser.parse_args(argv)
    spec = PRESETS[args.preset]
    if args.plan:
        _print_plan(spec)
        return 0
    last_tenth = -1

    def progress(message: str, done: int, total: int) -> None:
        nonlocal last_tenth
        tenth = done * 10 // total if total else -1
        if tenth != last_tenth:
            last_tenth = tenth
            print(f"{message}: {done * 100 // total}%" if total else message, file=sys.stderr)

    print(ensure_synthetic_model(spec, progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
