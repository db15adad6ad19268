"""Every environment variable the sidecar reads: named here, and read only here.

    MESH_HOME        a node's state directory (``--home`` wins)
    MESH_CACHE       the shared cache of llama.cpp builds and models
    MESH_LLAMA_BIN   a llama.cpp build's bin/ to use instead of the pinned one (``--llama-bin`` wins)
    MESH_API_KEY     the API key (``--api-key`` wins; typer reads it for that option)
    MESH_QUIC        the QUIC library: aioquic (default) or qh3 1.x
    MESH_OUTPUT_CHECK  0: the serving node does not check its workers' layer outputs (to measure its cost)
    MESH_RESUME      how a stream goes on after a failover: continue (default, from the tokens
                     delivered) or replay (regenerate them, the way before continuation; to compare)
    VULKAN_SDK       LunarG's Vulkan SDK, where a Vulkan build's toolkit is looked for besides /usr
                     (cmake reads it too)
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "MESH_HOME"
CACHE_ENV = "MESH_CACHE"
LLAMA_BIN_ENV = "MESH_LLAMA_BIN"
API_KEY_ENV = "MESH_API_KEY"
QUIC_LIBRARY_ENV = "MESH_QUIC"
DEFAULT_QUIC_LIBRARY = "aioquic"
OUTPUT_CHECK_ENV = "MESH_OUTPUT_CHECK"
RESUME_ENV = "MESH_RESUME"
RESUME_BY_REPLAY = "replay"
VULKAN_SDK_ENV = "VULKAN_SDK"


def _path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def home_dir() -> Path | None:
    return _path(HOME_ENV)


def cache_dir() -> Path | None:
    return _path(CACHE_ENV)


def llama_bin_dir() -> Path | None:
    return _path(LLAMA_BIN_ENV)


def vulkan_sdk_dir() -> Path | None:
    return _path(VULKAN_SDK_ENV)


def quic_library() -> str:
    return os.environ.get(QUIC_LIBRARY_ENV, DEFAULT_QUIC_LIBRARY)


def output_check() -> bool:
    """Whether the serving node checks the layer outputs its workers return (on unless set to 0)."""
    return os.environ.get(OUTPUT_CHECK_ENV, "1") != "0"


def resume_by_replay() -> bool:
    """Whether streams are to be replayed after a failover even where they could be continued."""
    return os.environ.get(RESUME_ENV, "").strip().lower() == RESUME_BY_REPLAY
