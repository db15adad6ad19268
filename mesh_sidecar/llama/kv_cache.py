"""The KV cache as people choose it: its length (``--ctx-size``) and its element types
(``--cache-type-k``/``-v``). estimate.py sizes it.

Light on purpose: the CLI's help shows these choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

DEFAULT_CTX_SIZE = 4096  # tokens of context llama-server gets
# The element types --cache-type-k/-v accept, by ggml's names, in the order the
# pinned llama.cpp lists them (kv_cache_types in common/arg.cpp).
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# llama.cpp's default for both caches.
DEFAULT_KV_CACHE_TYPE = "f16"


@dataclass(frozen=True)
class KvCacheTypes:
    """The element types of llama.cpp's K and V caches: ``--cache-type-k`` and ``--cache-type-v``.

    Raises UsageError for a name the pinned llama.cpp does not accept.
    """

    k: str = DEFAULT_KV_CACHE_TYPE
    v: str = DEFAULT_KV_CACHE_TYPE

    def __post_init__(self) -> None:
        for option, name in (("--cache-type-k", self.k), ("--cache-type-v", self.v)):
            if name not in KV_CACHE_TYPES:
                raise UsageError(f"{option} takes one of {', '.join(KV_CACHE_TYPES)} (llama.cpp's names), "
                                 f"not {name!r}.")

    def __str__(self) -> str:
        """``K/V``, e.g. ``q8_0/q8_0``: what a plan's KV figures assume."""
        return f"{self.k}/{self.v}"

    def llama_server_args(self) -> list[str]:
        """llama-server's options for these types; none for a cache left at llama.cpp's default."""
        args: list[str] = []
        for option, name in (("--cache-type-k", self.k), ("--cache-type-v", self.v)):
            if name != DEFAULT_KV_CACHE_TYPE:
                args += [option, name]
        return args


DEFAULT_KV_CACHE = KvCacheTypes()
