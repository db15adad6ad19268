"""Which tensors the weight cache hashes (the helper that hashes them: tests/integration/test_weight_cache.py)."""

from __future__ import annotations

from mesh_sidecar.llama.weight_cache import HASH_THRESHOLD_BYTES, hashed_tensor_ranges


def test_hashed_tensors_of_the_default_model(model_path):
    ranges = hashed_tensor_ranges(model_path)
    # SmolLM2-135M: only the token embeddings (49152 x 576, Q4_1) pass llama.cpp's 10 MiB threshold.
    ((file, offset, size),) = ranges
    assert file == model_path.resolve() and size > HASH_THRESHOLD_BYTES
    with open(model_path, "rb") as f:
        f.seek(offset)
        assert len(f.read(size)) == size


