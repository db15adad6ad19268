"""A target and a draft for the speculative-decoding benchmark, both sharing one tokenizer.

A draft must guess what the target will say, and this machine has only one real
model (SmolLM2-135M). Random synthetic models cannot guess each other, and a
layer-skipped copy of the small model guesses badly (measured: 1-8% of draft
tokens accepted with 8-26 of its 30 blocks). So the benchmark keeps the real
model as the *draft* and builds a bigger *target* from it: the same 30 blocks
followed by ``extra`` copies of its first blocks whose output projections
(``attn_output``, ``ffn_down``) are scaled by ``scale``. Those blocks cost the
full compute and memory of real blocks but nudge the residual stream only a
little, so the target says nearly, not exactly, what the draft says: the
acceptance rate the benchmark reports is a property of this construction, and
it says so. Generated on demand, cached, never committed.

    python -m benchmarks.spec_models [--extra N] [--scale S]   prints target and draft paths
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import numpy as np

from benchmarks.synthetic_model import raw_contents
from mesh_sidecar.home import cache_root
from mesh_sidecar.llama.model import ensure_model

DEFAULT_EXTRA_BLOCKS = 30
DEFAULT_SCALE = 0.1
SCALED_TENSORS = ("attn_output", "ffn_down")  # what a block adds to the residual stream
_WRITER_OWNED = ("GGUF.", "general.architecture")  # the writer sets these itself
# Q4_0/Q4_1/Q8_0 blocks start with an f16 scale d (Q4_1 also an f16 min m): scaling those scales the block.
_BLOCK_SCALES = {gguf.GGMLQuantizationType.Q4_0: (18, 1), gguf.GGMLQuantizationType.Q4_1: (20, 2),
                 gguf.GGMLQuantizationType.Q8_0: (34, 1)}


def _scaled(tensor: gguf.ReaderTensor, scale: float) -> np.ndarray:
    data = np.array(tensor.data, copy=True)
    if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return data * data.dtype.type(scale)
    block_bytes, n_scales = _BLOCK_SCALES[tensor.tensor_type]
    blocks = data.reshape(-1, block_bytes)
    scales = blocks[:, : 2 * n_scales].copy().view(np.float16)
    blocks[:, : 2 * n_scales] = (scales * np.float16(scale)).view(np.uint8)
    return blocks.reshape(data.shape)


def ensure_padded_target(draft: Path, extra: int = DEFAULT_EXTRA_BLOCKS, scale: float = DEFAULT_SCALE) -> Path:
    """The cached target: ``draft``'s blocks, then ``extra`` damped copies of its first blocks."""
    path = cache_root() / "models" / f"target-{draft.stem}-plus{extra}x{scale:g}.gguf"
    if path.exists():
        return path
    reader = gguf.GGUFReader(draft)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    n_blocks = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, arch)
    try:
        for field in reader.fields.values():
            if field.name.startswith(_WRITER_OWNED):
                continue
            if field.name == f"{arch}.block_count":
                writer.add_block_count(n_blocks + extra)
                continue
            main_type = field.types[0]
            sub_type = field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, raw_contents(field), main_type, sub_type=sub_type)
        tensors: list[tuple[str, gguf.ReaderTensor, np.ndarray | None]] = [(t.name, t, None) for t in reader.tensors]
        for i in range(extra):
            source = i % n_blocks
            for t in reader.tensors:
                if t.name.startswith(f"blk.{source}."):
                    kind = t.name.split(".")[2]
                    tensors.append((f"blk.{n_blocks + i}.{'.'.join(t.name.split('.')[2:])}", t,
                                    _scaled(t, scale) if kind in SCALED_TENSORS else None))
        for name, t, data in tensors:
            values = t.data if data is None else data
            writer.add_tensor_info(name, values.shape, values.dtype, values.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, t, data in tensors:
            writer.write_tensor_data(t.data if data is None else data)
        writer.close()
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spec_models", description=__doc__.split("\n")[0])
    parser.add_argument("--extra", type=int, default=DEFAULT_EXTRA_BLOCKS)
    parser.add_argument("--scale", type=float, default=DEFAULT_SCALE)
    args = parser.parse_args(argv)
    draft = ensure_model(None, lambda *_: None)
    print(ensure_padded_target(draft, args.extra, args.scale))
    print(draft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
