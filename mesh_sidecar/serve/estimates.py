"""A model's memory estimate (llama/estimate.py) as the serving node and `mesh-inference plan` ask for it:
cached per file, context size and cache types, the first one made off the event loop."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

from ..llama.estimate import ModelEstimate, estimate_model
from ..llama.kv_cache import DEFAULT_KV_CACHE, KvCacheTypes

# A node asks for the estimate on every membership change; the first read of a GGUF
# takes seconds (its tokenizer arrays), so it is cached and first made off the event loop.
cached_estimate = functools.lru_cache(maxsize=8)(estimate_model)


async def estimate_off_loop(model: Path, ctx_size: int, kv_cache: KvCacheTypes = DEFAULT_KV_CACHE) -> ModelEstimate:
    """The cached estimate, computed in a thread the first time: heartbeats keep flowing meanwhile."""
    return await asyncio.to_thread(cached_estimate, model, ctx_size, kv_cache=kv_cache)
