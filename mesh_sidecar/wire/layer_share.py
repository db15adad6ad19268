"""Gossip's two messages for fetching layers from the hub (serve/layer_share.py, llama/layer_fetch.py). Pure.

A serving node whose model came from the Hugging Face hub tells each worker that lacks the file which tensors
its layers hold, where they lie in the hub's file, and what they hash to; the worker fetches those byte ranges
from the hub itself, checks them and puts them in its weight cache, then answers. The load that follows sends
those tensors by hash (llama/weight_cache.py), not over the LAN::

    serving node                                   worker
        LayerShare(model, repo, revision, files,
                   tensors [file, offset, size,
                            cache name, sha256]) --->
                                                       Range GETs to the hub, checked
        <--- LayersFetched(model, tensors, bytes, error)

Bodies are JSON objects like every gossip message's (wire/gossip.py, types 8 and 9). A tensor is the list
``[file index, offset in that file, size in bytes, FNV-1a name (16 hex digits), sha256 (64 hex digits)]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from .gossip_fields import bounded_list, field_error, integer, json_object, matching, text

MAX_SHARED_FILES = 64  # a split GGUF's shards
MAX_SHARED_TENSORS = 4096  # 1 MiB frame / about 120 bytes a tensor, with room to spare
MAX_REPO_CHARS = 96 * 2 + 1  # USER/REPO as the hub allows them (llama/hub_models.py)
MAX_FILE_CHARS = 255
MAX_OFFSET = 2**63 - 1
MAX_ERROR_CHARS = 256
_SHA256_RE = re.compile("[0-9a-f]{64}")
_REVISION_RE = re.compile("[0-9a-f]{40}")  # a git commit: the files cannot change under the fetch
_CACHE_NAME_RE = re.compile("[0-9a-f]{16}")
_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_FILE_RE = re.compile(r"[A-Za-z0-9._-][A-Za-z0-9._/-]*\.gguf")


@dataclass(frozen=True)
class SharedTensor:
    """One tensor a worker will hold: where its bytes lie in the hub's file, and what they hash to."""

    file: int  # index into LayerShare.files
    offset: int  # of its data in that file
    size_bytes: int
    cache_name: str  # its FNV-1a, the name rpc-server's cache finds it by
    sha256: str  # what the bytes must hash to: the serving node's own copy's

    def to_body(self) -> list[Any]:
        return [self.file, self.offset, self.size_bytes, self.cache_name, self.sha256]

    @classmethod
    def from_body(cls, body: Any, n_files: int) -> SharedTensor:
        entry = bounded_list(body, "layer_share.tensor", 5)
        if len(entry) != 5:
            raise field_error("layer_share.tensor", "[file, offset, size, cache name, sha256]")
        file = integer(entry[0], "layer_share.tensor.file", n_files - 1)
        return cls(file, integer(entry[1], "layer_share.tensor.offset", MAX_OFFSET),
                   integer(entry[2], "layer_share.tensor.size", MAX_OFFSET),
                   matching(entry[3], "layer_share.tensor.cache_name", _CACHE_NAME_RE, "16 hex digits"),
                   matching(entry[4], "layer_share.tensor.sha256", _SHA256_RE, "64 hex digits"))


@dataclass(frozen=True)
class LayerShare:
    """Serving node -> worker: fetch these tensors of ``model_sha256`` from the hub, then say LayersFetched."""

    TYPE: ClassVar[int] = 8
    model_sha256: str  # the model in service: the answer names it
    repo: str  # USER/REPO on the hub
    revision: str  # the commit the files are from
    files: tuple[str, ...]  # paths in the repo
    tensors: tuple[SharedTensor, ...]

    @property
    def total_bytes(self) -> int:
        return sum(tensor.size_bytes for tensor in self.tensors)

    def to_body(self) -> dict[str, Any]:
        return {"model_sha256": self.model_sha256, "repo": self.repo, "revision": self.revision,
                "files": list(self.files), "tensors": [tensor.to_body() for tensor in self.tensors]}

    @classmethod
    def from_body(cls, body: Any) -> LayerShare:
        fields = json_object(body, "layer_share", ("model_sha256", "repo", "revision", "files", "tensors"))
        files = tuple(matching(text(f, "layer_share.file", MAX_FILE_CHARS), "layer_share.file", _FILE_RE,
                               "a .gguf path in the repo")
                      for f in bounded_list(fields["files"], "layer_share.files", MAX_SHARED_FILES))
        if not files or any(".." in f.split("/") for f in files):
            raise field_error("layer_share.files", "one or more .gguf paths in the repo")
        return cls(
            model_sha256=matching(fields["model_sha256"], "layer_share.model_sha256", _SHA256_RE, "64 hex digits"),
            repo=matching(text(fields["repo"], "layer_share.repo", MAX_REPO_CHARS), "layer_share.repo", _REPO_RE,
                          "USER/REPO"),
            revision=matching(fields["revision"], "layer_share.revision", _REVISION_RE, "a 40-digit commit id"),
            files=files,
            tensors=tuple(SharedTensor.from_body(t, len(files))
                          for t in bounded_list(fields["tensors"], "layer_share.tensors", MAX_SHARED_TENSORS)),
        )


@dataclass(frozen=True)
class LayersFetched:
    """Worker -> serving node: how the fetch a LayerShare asked for ended (its tensors now in the cache)."""

    TYPE: ClassVar[int] = 9
    model_sha256: str
    tensors: int  # tensors in the cache now, of those asked for
    fetched_bytes: int  # bytes taken from the hub for it
    error: str = ""  # why some are missing (the load sends those over the LAN); "" when none is

    def to_body(self) -> dict[str, Any]:
        return {"model_sha256": self.model_sha256, "tensors": self.tensors, "fetched_bytes": self.fetched_bytes,
                "error": self.error}

    @classmethod
    def from_body(cls, body: Any) -> LayersFetched:
        fields = json_object(body, "layers_fetched", ("model_sha256", "tensors", "fetched_bytes", "error"))
        return cls(matching(fields["model_sha256"], "layers_fetched.model_sha256", _SHA256_RE, "64 hex digits"),
                   integer(fields["tensors"], "layers_fetched.tensors", MAX_SHARED_TENSORS),
                   integer(fields["fetched_bytes"], "layers_fetched.fetched_bytes", MAX_OFFSET),
                   text(fields["error"], "layers_fetched.error", MAX_ERROR_CHARS))
