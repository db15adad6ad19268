"""A worker's own layers of a hub model, fetched from the hub by this worker (wire/layer_share.py).

The serving node names the tensors the plan gives this worker, where they lie in the hub's file and what its
own copy of them hashes to. Each is fetched with one Range request, checked against both names (the FNV-1a
rpc-server finds it by, and the sha256: FNV-1a alone could be forged) and let into the weight cache
(llama/weight_cache.py); one that does not match is dropped, and the load sends it over the LAN as it would
have anyway. Tensors the cache already holds are not fetched again, so a replan fetches only what is new.

Whoever sends a share chooses the bytes, and FNV-1a names can be made to collide with another model's
tensors: so a fetched tensor serves only the serving node it was fetched for. ``FetchedFor`` follows which
serving node uses this worker now (the last to announce an ``--rpc`` order naming it); when that changes,
the tensors fetched for the one before leave the cache before anything else is let in.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..errors import MeshError
from ..progress import ProgressCallback
from ..wire.layer_share import LayersFetched, LayerShare, SharedTensor
from . import weight_cache
from .hub_models import fetch_range
from .weight_cache import WeightCache

FETCHING_FILE = "fetching.tensor"  # in the cache's root, outside rpc/: rpc-server never sees it unchecked


class FetchedFor:
    """The serving node this worker's fetched tensors are for; a fetch thread and the mesh's events share it."""

    def __init__(self, cache: WeightCache) -> None:
        self._cache = cache
        self._lock = threading.Lock()  # a change of serving node and an admission never interleave
        self._serving = ""  # hex id; "": none yet, and nothing fetched is kept from an earlier run
        weight_cache.drop_fetched(cache)

    @property
    def serving(self) -> str:
        return self._serving

    @property
    def cache(self) -> WeightCache:
        return self._cache

    def used_by(self, node_id: bytes) -> int:
        """``node_id`` announced an --rpc order naming this worker: its loads come next. Tensors fetched for
        another serving node are dropped (how many)."""
        with self._lock:
            if node_id.hex() == self._serving:
                return 0
            self._serving = node_id.hex()
            return weight_cache.drop_fetched(self._cache, keep_for=self._serving)

    def admit(self, sender: bytes, tool: Path, fetched: Path, tensor: SharedTensor) -> bool:
        """``fetched`` into the cache for ``sender``, if it is still the serving node using this worker and the
        bytes hash as ``tensor`` says."""
        with self._lock:
            if sender.hex() != self._serving:
                fetched.unlink(missing_ok=True)
                return False
            return weight_cache.admit_fetched(self._cache, tool, fetched, tensor.cache_name, tensor.sha256,
                                              self._serving)


def fetch_layers(share: LayerShare, sender: bytes, fetched_for: FetchedFor, tool: Path, progress: ProgressCallback,
                 *, endpoint: str | None = None, token: str | None = None) -> LayersFetched:
    """Every tensor of the share ``sender`` sent in the cache, as far as the hub gives them and they check, while
    ``sender`` uses this worker; the report to send back. ``endpoint`` and ``token`` default to
    huggingface_hub's (HF_ENDPOINT, HF_TOKEN)."""
    if sender.hex() != fetched_for.serving:
        return LayersFetched(share.model_sha256, 0, 0, "this worker is not in that node's --rpc order now")
    cache = fetched_for.cache
    cache.create()
    todo = [t for t in share.tensors if not weight_cache.holds(cache, t.cache_name, t.sha256)]
    held, total = len(share.tensors) - len(todo), sum(t.size_bytes for t in todo)
    fetched_bytes, refused = 0, 0
    label = f"Fetching this node's layers of {share.repo} from the hub"
    progress(label, 0, total)
    staged = cache.root / FETCHING_FILE
    try:
        for tensor in todo:
            if sender.hex() != fetched_for.serving:
                return LayersFetched(share.model_sha256, held, fetched_bytes, "another serving node uses it now")
            with open(staged, "wb") as out:
                fetch_range(share.repo, share.revision, share.files[tensor.file], tensor.offset, tensor.size_bytes,
                            out, endpoint=endpoint, token=token)
            fetched_bytes += tensor.size_bytes
            if fetched_for.admit(sender, tool, staged, tensor):
                held += 1
            else:
                refused += 1
            progress(label, fetched_bytes, total)
    except (MeshError, OSError) as exc:
        staged.unlink(missing_ok=True)
        return LayersFetched(share.model_sha256, held, fetched_bytes, _short(str(exc)))
    error = (f"{refused} tensor(s) from the hub did not match the serving node's copy: they come over the LAN"
             if refused else "")
    return LayersFetched(share.model_sha256, held, fetched_bytes, error)


def _short(reason: str) -> str:
    reason = " ".join(reason.split())  # one printable line, as gossip takes it
    return reason if len(reason) <= 250 else reason[:249] + "…"
