"""Small split GGUF sets written with gguf-py, in llama.cpp's gguf-split layout, for tests of the file handling
(real models split by llama.cpp's own tool: tests/integration/test_split_model.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from mesh_sidecar.llama.model_files import SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_KEY, ShardName

FLOAT32_BYTES = 4


def write_split_model(directory: Path, prefix: str, sizes_mib: list[int], *, seed: int = 0) -> Path:
    """Shards ``{prefix}-0000k-of-0000N.gguf`` in ``directory``, one f32 tensor of ``sizes_mib[k]`` MiB
    each (random values); the first shard's path."""
    directory.mkdir(parents=True, exist_ok=True)
    names = ShardName(prefix, 1, len(sizes_mib))
    rng = np.random.default_rng(seed)
    for number, size_mib in enumerate(sizes_mib, start=1):
        writer = gguf.GGUFWriter(directory / names.of(number), "llama")
        writer.add_uint16(SPLIT_NO_KEY, number - 1)
        writer.add_uint16(SPLIT_COUNT_KEY, len(sizes_mib))
        writer.add_int32(SPLIT_TENSORS_KEY, len(sizes_mib))
        values = size_mib * 1024 * 1024 // FLOAT32_BYTES
        writer.add_tensor(f"blk.{number - 1}.weight", rng.standard_normal(values, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return directory / names.of(1)
