"""How many bytes each device needs when llama.cpp spreads a GGUF over rpc-servers.

The serving node runs ``llama-server -m MODEL --rpc <endpoints> -ngl 99 -c N_CTX``.
With that command line the pinned llama.cpp (``src/llama-model.cpp``,
``llama_model_base::load_tensors``) places the model like this:

- the input layer (token embeddings) always stays on the serving host's CPU,
  whatever ``-ngl`` says ("there is very little benefit to offloading the
  input layer");
- repeating block ``N`` (every ``blk.N.*`` tensor) and its K/V cache live on the
  device that :func:`assign_layers` names for it;
- the output head (``output.weight``, ``output_norm.weight``) counts as one more
  layer, number ``n_layers``, and so lands on the last device. A model without
  ``output.weight`` ties its head to ``token_embd.weight``; llama.cpp then
  loads a *second copy* of the embeddings into the output device's buffer.

Each participating device also needs compute buffers for the graph (activations
of one micro-batch, the attention mask); :func:`estimate_model` derives a margin
for them, checked against what llama.cpp logs (docs/memory-estimate.md has the
formulas and the measured numbers).

Pure apart from reading the GGUF's header (:mod:`.gguf_file`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ModelError
from ..units import MIB
from ..wire.gguf_header import GGUFHeader
from .kv_cache import DEFAULT_KV_CACHE, KvCacheTypes
from .model import check_gguf
from .model_files import model_stem, read_model_header

# --- KV cache ---------------------------------------------------------------
# Architectures llama.cpp runs without flash attention whatever -fa says
# (llama_init_from_model forces it off), so a quantized V cache cannot work.
NO_FLASH_ATTENTION_ARCHITECTURES = ("grok",)
# llama_context pads n_ctx up to a multiple of 256 cells (GGML_PAD(n_ctx, 256)),
# and the cache is allocated for the padded size.
KV_CELL_PAD = 256

# --- compute buffers --------------------------------------------------------
# llama.cpp's default physical batch (-ub / n_ubatch), tokens per graph run.
DEFAULT_N_UBATCH = 512
# With more than one device and every layer offloaded, llama.cpp turns on
# pipeline parallelism and the scheduler keeps GGML_SCHED_MAX_COPIES (4) copies
# of each split's inputs, so the attention mask is held 4 times per device.
SCHED_COPIES = 4
# The KQ mask is f16 (flash attention, which llama.cpp picks on CPU backends).
MASK_BYTES_PER_ELEMENT = 2
# Activations are f32.
ACTIVATION_BYTES = 4
# Peak live activations per token, measured on the pinned build with pipeline
# parallelism: three n_ff-wide rows (ffn gate, up, and their product) plus seven
# n_embd-wide rows (residual stream, norm output, and the input copies of the
# split). See docs/memory-estimate.md for the fit.
FFN_ROWS_PER_TOKEN = 3
EMBD_ROWS_PER_TOKEN = 7
# Mixture-of-experts blocks (build_moe_ffn in src/llama-graph.cpp) peak the same
# way with n_expert_used x n_ff_exp-wide rows for the routed up, gate and product.
# The down projection's output, n_expert_used x n_embd wide, goes into the hole
# the freed up and gate rows leave when it fits (it did up to twice the routed
# width), else on top of that peak. The router's n_expert-wide rows never raised
# the peak (measured up to 256 experts).
MOE_DOWN_FITS_RATIO = 2
# llama-server's automatic n_parallel is 4 and the reserve graph computes one
# logits row per sequence, so the last device's head needs 4 x n_vocab floats.
N_OUTPUT_ROWS = 4
# Small graph inputs (positions, output ids) and allocator rounding: measured
# at ~0.04 MiB; 1 MiB keeps the margin on the safe side of llama.cpp's figure.
COMPUTE_SLACK_BYTES = 1 * MIB
# Transformers without a feed_forward_length key: the usual 4 x n_embd.
DEFAULT_FFN_RATIO = 4

# --- tensors ----------------------------------------------------------------
# GGUF's default tensor alignment; ggml buffers align tensors the same way.
DEFAULT_ALIGNMENT = 32
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")
# Input-layer tensors (LLM_TENSOR_LAYER_INPUT in src/llama-arch.cpp): llama.cpp
# keeps them on the CPU of the host that runs llama-server.
HOST_TENSOR_PREFIXES = ("token_embd.", "position_embd.", "token_types.", "per_layer_token_embd.")
TOKEN_EMBD = "token_embd.weight"
OUTPUT_WEIGHT = "output.weight"
# Metadata that marks a cache llama.cpp does not size as n_ctx x K/V rows:
# recurrent state (Mamba, RWKV, LFM2's short convolutions) or MLA's compressed KV.
_UNSUPPORTED_KEYS = ("ssm.state_size", "wkv.head_size", "shortconv.l_cache", "attention.kv_lora_rank")




def kv_block(cache_type: str) -> tuple[int, int]:
    """(elements, bytes) of one block of a cache type: (1, 2) for f16, (32, 34) for q8_0 (gguf-py's table)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[cache_type.upper()]]


def kv_row_bytes(cache_type: str, n_elements: int) -> int:
    """Bytes of ``n_elements`` of ``cache_type``, as ggml_row_size: whole blocks only."""
    block_elements, block_bytes = kv_block(cache_type)
    if n_elements % block_elements:
        raise ValueError(f"{n_elements} elements are not whole {cache_type} blocks of {block_elements}")
    return n_elements // block_elements * block_bytes


@dataclass(frozen=True)
class ModelEstimate:
    """Bytes one model needs, by where llama.cpp puts them (all sizes in bytes).

    The first seven fields are the interface the planner relies on; the rest
    describe the model for messages.
    """

    n_layers: int
    layer_weight_bytes: tuple[int, ...]  # real tensor bytes of blk.N.* for each N
    host_bytes: int  # input-layer weights that stay on the serving host's CPU
    output_bytes: int  # head + output_norm on the last device; a tied head counts its token_embd copy
    kv_bytes_per_layer: int  # K + V cache of one layer at n_ctx (the largest, if layers differ)
    n_ctx: int
    compute_margin_bytes: int  # llama.cpp's compute buffers on each participating device
    architecture: str = ""
    name: str = ""
    tied_output: bool = False  # the head reuses token_embd (a copy sits on the last device)
    kv_cache: KvCacheTypes = DEFAULT_KV_CACHE  # the element types kv_bytes_per_layer assumes
    # A --mmproj projector in the serving node's llama-server, with one image's compute (llama/projector.py).
    projector_bytes: int = 0

    def __post_init__(self) -> None:
        if len(self.layer_weight_bytes) != self.n_layers:
            raise ValueError(f"{len(self.layer_weight_bytes)} layer sizes for {self.n_layers} layers")

    def layer_bytes(self, i: int) -> int:
        """Weights plus K/V cache of block ``i``."""
        return self.layer_weight_bytes[i] + self.kv_bytes_per_layer

    def range_bytes(self, start: int, end: int, *, with_output: bool) -> int:
        """What a device holding blocks ``[start, end)`` (and the head if ``with_output``) needs.

        Includes the compute margin, which every participating device pays; a
        device holding nothing does not take part and needs nothing.
        """
        if not 0 <= start <= end <= self.n_layers:
            raise ValueError(f"layer range [{start}, {end}) outside 0..{self.n_layers}")
        if start == end and not with_output:
            return 0
        layers = sum(self.layer_bytes(i) for i in range(start, end))
        return layers + self.compute_margin_bytes + (self.output_bytes if with_output else 0)

    @property
    def weight_bytes(self) -> int:
        """Model weights in memory, counting a tied head's second copy."""
        return self.host_bytes + sum(self.layer_weight_bytes) + self.output_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_layer * self.n_layers

    @property
    def serving_host_bytes(self) -> int:
        """What stays on the serving node whatever the split: the input layer, and a projector if any."""
        return self.host_bytes + self.projector_bytes

    @property
    def total_bytes(self) -> int:
        """Weights (host, blocks, head), the whole K/V cache and a projector, without compute margins.

        The margins are left out because they depend on how many devices take
        part: a plan adds ``compute_margin_bytes`` once per participant.
        """
        return self.weight_bytes + self.kv_bytes + self.projector_bytes


def kv_cells(n_ctx: int) -> int:
    """Cells llama.cpp allocates for a context of ``n_ctx`` tokens (padded to 256)."""
    return math.ceil(n_ctx / KV_CELL_PAD) * KV_CELL_PAD


def compute_margin(*, n_ctx: int, n_embd: int, n_ff: int, n_vocab: int,
                   n_ubatch: int = DEFAULT_N_UBATCH, n_expert_used: int = 0, n_ff_exp: int = 0) -> int:
    """Compute-buffer bytes one device needs under pipeline parallelism.

    ``copies x cells x n_ubatch`` f16 mask elements, plus the larger of the
    block activations of one micro-batch and the head's logits (they are not
    live at the same time, so the graph allocator reuses the memory), plus slack.
    ``n_ff`` is the widest dense feed-forward (0 when every block is a
    mixture of experts); MoE blocks route each token to ``n_expert_used``
    experts ``n_ff_exp`` wide.
    """
    mask = SCHED_COPIES * kv_cells(n_ctx) * n_ubatch * MASK_BYTES_PER_ELEMENT
    rows = FFN_ROWS_PER_TOKEN * n_ff + EMBD_ROWS_PER_TOKEN * n_embd
    routed = n_expert_used * n_ff_exp
    if routed:
        down = n_expert_used * n_embd
        moe_rows = FFN_ROWS_PER_TOKEN * routed + EMBD_ROWS_PER_TOKEN * n_embd
        rows = max(rows, moe_rows + (down if down > MOE_DOWN_FITS_RATIO * routed else 0))
    activations = n_ubatch * ACTIVATION_BYTES * rows
    logits = N_OUTPUT_ROWS * n_vocab * ACTIVATION_BYTES
    return mask + max(activations, logits) + COMPUTE_SLACK_BYTES


def assign_layers(n_layers: int, tensor_split: Sequence[float]) -> tuple[int, ...]:
    """The device index llama.cpp gives each of ``n_layers + 1`` layers with ``-ngl 99``.

    Entry ``n_layers`` is the output head. Mirrors ``get_layer_buft_list`` in
    ``llama_model_base::load_tensors`` (src/llama-model.cpp), in float32 as
    there: the splits are normalised to cumulative fractions ``c_j``, and layer
    ``il`` goes to the first device with ``c_j > il / (n_layers + 1)``
    (``std::upper_bound``). So with integer weights ``k_j`` summing to
    ``n_layers + 1`` device ``j`` gets exactly ``k_j`` layers, the last device's
    share including the head.
    """
    if n_layers < 1:
        raise ValueError("a model has at least one layer")
    if not tensor_split or any(w < 0 for w in tensor_split) or not any(w > 0 for w in tensor_split):
        # All zero means "split by free memory" in llama.cpp: not a fixed rule.
        raise ValueError(f"tensor split {list(tensor_split)} needs non-negative weights, one positive")
    splits = np.array(tensor_split, dtype=np.float32)
    cumulative = np.empty_like(splits)
    total = np.float32(0)
    for i, w in enumerate(splits):  # sequential float32 sums, as the C++ loop
        total = np.float32(total + w)
        cumulative[i] = total
    cumulative = (cumulative / total).astype(np.float32)
    n_gpu = n_layers + 1  # act_gpu_layers = min(n_gpu_layers, n_layer + 1) with -ngl 99
    devices = []
    for il in range(n_gpu):
        position = np.float32(il) / np.float32(n_gpu)
        devices.append(int(np.searchsorted(cumulative, position, side="right")))
    return tuple(devices)


def estimate_model(path: Path, n_ctx: int, *, n_ubatch: int = DEFAULT_N_UBATCH,
                   kv_cache: KvCacheTypes = DEFAULT_KV_CACHE) -> ModelEstimate:
    """Read ``path``'s GGUF header and estimate its memory at a context of ``n_ctx`` tokens.

    ``kv_cache``: the K and V cache element types llama-server gets. ModelError
    when llama.cpp would refuse them for this model (a quantized type whose
    blocks do not divide a head, a quantized V cache without flash attention).
    """
    if n_ctx < 1:
        raise ValueError(f"n_ctx must be positive, not {n_ctx}")
    path = check_gguf(Path(path))
    header = read_model_header(path)  # a split model's tensors are in all its shards
    meta = _Metadata(header, path)
    arch = meta.string("general.architecture")
    if arch is None:
        raise ModelError(f"{path} has no general.architecture key: it is not a llama.cpp model GGUF.")
    for key in _UNSUPPORTED_KEYS:
        if meta.value(f"{arch}.{key}") is not None:
            raise ModelError(
                f"{path} is a '{arch}' model whose cache ({arch}.{key}) is not a plain K/V cache; "
                "the memory estimate only knows attention K/V caches, so this model cannot be planned."
            )
    n_layers = meta.required_integer(f"{arch}.block_count")
    n_embd = meta.required_integer(f"{arch}.embedding_length")
    n_head = meta.first(f"{arch}.attention.head_count")
    if n_layers < 1 or n_embd < 1 or n_head < 1:
        raise ModelError(f"{path} declares {n_layers} blocks, embedding {n_embd}, {n_head} heads: "
                         "not a model the estimate can size.")
    head_kv = meta.per_layer(f"{arch}.attention.head_count_kv", n_layers, default=n_head)
    head_dim = n_embd // n_head  # llama.cpp's default when the GGUF gives no key/value length
    key_length = meta.per_layer(f"{arch}.attention.key_length", n_layers, default=head_dim)
    value_length = meta.per_layer(f"{arch}.attention.value_length", n_layers, default=head_dim)
    alignment = meta.integer("general.alignment") or DEFAULT_ALIGNMENT

    layer_weights = [0] * n_layers
    host = output = 0
    sizes = {}
    for tensor in header.tensors:
        nbytes = _aligned(tensor.n_bytes, alignment)
        sizes[tensor.name] = nbytes
        match = _BLOCK_TENSOR.match(tensor.name)
        if match:
            block = int(match.group(1))
            if block >= n_layers:
                raise ModelError(f"{path} has tensor {tensor.name} but {arch}.block_count is {n_layers}: "
                                 "the file is inconsistent.")
            layer_weights[block] += nbytes
        elif tensor.name.startswith(HOST_TENSOR_PREFIXES):
            host += nbytes
        else:
            # The head and its norm, plus the few other non-block tensors
            # (rope tables, classifier heads): small, counted on the last device.
            output += nbytes
    if TOKEN_EMBD not in sizes:
        raise ModelError(f"{path} has no {TOKEN_EMBD} tensor: the estimate cannot size its input layer.")
    tied = OUTPUT_WEIGHT not in sizes
    if tied:
        # llama.cpp loads token_embd a second time as the head (TENSOR_DUPLICATED),
        # into the output device's buffer.
        output += sizes[TOKEN_EMBD]

    cells = kv_cells(n_ctx)
    _check_kv_cache(path, arch, kv_cache, key_length, value_length)
    # A cell holds one row of n_embd_k_gqa = h x k elements of the K type and one of
    # h x v of the V type (src/llama-kv-cache.cpp, ggml_row_size). The planner charges
    # every layer the same K/V, so take the largest layer's.
    kv_per_layer = max(cells * (kv_row_bytes(kv_cache.k, h * k) + kv_row_bytes(kv_cache.v, h * v))
                       for h, k, v in zip(head_kv, key_length, value_length, strict=True))
    n_vocab = _vocab_size(header, meta, arch)
    ffn = _ffn_shape(meta, arch, n_layers, n_embd)
    margin = compute_margin(n_ctx=n_ctx, n_embd=n_embd, n_ff=ffn.n_ff, n_vocab=n_vocab, n_ubatch=n_ubatch,
                            n_expert_used=ffn.n_expert_used, n_ff_exp=ffn.n_ff_exp)
    return ModelEstimate(
        n_layers=n_layers,
        layer_weight_bytes=tuple(layer_weights),
        host_bytes=host,
        output_bytes=output,
        kv_bytes_per_layer=kv_per_layer,
        n_ctx=n_ctx,
        compute_margin_bytes=margin,
        architecture=arch,
        name=meta.string("general.name") or model_stem(path.name),
        tied_output=tied,
        kv_cache=kv_cache,
    )


def _check_kv_cache(path: Path, arch: str, kv_cache: KvCacheTypes,
                    key_length: Sequence[int], value_length: Sequence[int]) -> None:
    """ModelError where llama_init_from_model (src/llama-context.cpp) would refuse ``kv_cache`` for this model."""
    if arch in NO_FLASH_ATTENTION_ARCHITECTURES and kv_block(kv_cache.v)[0] > 1:
        raise ModelError(f"{path} is a '{arch}' model, which llama.cpp runs without flash attention, and a "
                         f"quantized V cache ({kv_cache.v}) needs it: give --cache-type-v f16 (or bf16, f32).")
    # A quantized type stores blocks of 32 elements, and llama.cpp refuses one whose
    # blocks do not divide every head (n_embd_head_k / n_embd_head_v).
    for option, name, widths in (("--cache-type-k", kv_cache.k, key_length),
                                 ("--cache-type-v", kv_cache.v, value_length)):
        block_elements = kv_block(name)[0]
        odd = sorted({width for width in widths if width % block_elements})
        if odd:
            raise ModelError(f"{option} {name} stores blocks of {block_elements} elements, but {path} has "
                             f"heads of {odd[0]}: llama.cpp refuses that cache. Give {option} f16 "
                             "(or bf16, f32).")


def _aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


class _FfnShape(NamedTuple):
    n_ff: int  # the widest dense feed-forward; 0 if every block is MoE
    n_expert_used: int  # experts a token is routed to; 0 for a dense model
    n_ff_exp: int  # the width of one expert


def _ffn_shape(meta: _Metadata, arch: str, n_layers: int, n_embd: int) -> _FfnShape:
    """The feed-forward widths the compute margin needs, from the model's metadata.

    A model with ``expert_count`` and ``expert_used_count`` is a mixture of
    experts. Its experts are ``expert_feed_forward_length`` wide (Qwen3-MoE,
    DeepSeek, gpt-oss), and ``feed_forward_length`` is then the width of any
    dense blocks; without that key (Mixtral as the llama architecture) the
    experts are ``feed_forward_length`` wide and every block is MoE.
    """
    ff = max(meta.per_layer(f"{arch}.feed_forward_length", n_layers, default=0))
    n_expert = meta.integer(f"{arch}.expert_count") or 0
    used = max(meta.per_layer(f"{arch}.expert_used_count", n_layers, default=0))
    if not (n_expert and used):
        return _FfnShape(ff or DEFAULT_FFN_RATIO * n_embd, 0, 0)
    expert = max(meta.per_layer(f"{arch}.expert_feed_forward_length", n_layers, default=0))
    return _FfnShape(ff, used, expert) if expert else _FfnShape(0, used, ff or DEFAULT_FFN_RATIO * n_embd)


def _vocab_size(header: GGUFHeader, meta: _Metadata, arch: str) -> int:
    vocab = meta.integer(f"{arch}.vocab_size")
    if vocab:
        return vocab
    for tensor in header.tensors:
        if tensor.name == TOKEN_EMBD:
            return tensor.shape[-1]  # ne = [n_embd, n_vocab]
    return 0


class _Metadata:
    """Typed access to a GGUF header's key/value fields, with ModelError for bad ones."""

    def __init__(self, header: GGUFHeader, path: Path) -> None:
        self._fields = header.fields
        self._path = path

    def value(self, key: str) -> Any:
        return self._fields.get(key)

    def string(self, key: str) -> str | None:
        value = self.value(key)
        return value if isinstance(value, str) else None

    def integer(self, key: str) -> int | None:
        """The integer at ``key``; None if there is none."""
        value = self.value(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelError(f"{self._path}: metadata key {key} is {value!r}, expected an integer.")
        return int(value)

    def required_integer(self, key: str) -> int:
        """The integer at ``key``; ModelError if there is none."""
        value = self.integer(key)
        if value is None:
            raise ModelError(f"{self._path} lacks the metadata key {key}, which the memory estimate "
                             "needs; the GGUF may come from an old or unusual converter.")
        return value

    def first(self, key: str) -> int:
        """A required integer, or the first entry of a per-layer array."""
        value = self.value(key)
        if isinstance(value, list):
            if not value:
                raise ModelError(f"{self._path}: metadata key {key} is an empty array, expected integers.")
            return int(value[0])
        return self.required_integer(key)

    def per_layer(self, key: str, n_layers: int, *, default: int) -> list[int]:
        """A per-layer value: an array of n_layers entries, one integer for all, or ``default``."""
        value = self.value(key)
        if value is None:
            return [default] * n_layers
        if isinstance(value, list):
            if len(value) != n_layers:
                raise ModelError(f"{self._path}: {key} has {len(value)} entries for {n_layers} blocks.")
            return [int(v) for v in value]
        return [self.required_integer(key)] * n_layers
