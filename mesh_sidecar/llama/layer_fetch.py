"""A worker's own layers of a hub model, fetched from the hub by this worker (wire/layer_share.py).

The serving node names the tensors the plan gives this worker, where they lie in the hub's file and what its
own copy of them hashes to. Each is fetched with one Range request, checked against both names (the FNV-1a
rpc-server finds it by, and the sha256: FNV-1a alone could be forged) and let into the weight cache
(llama/weight_cache.py); one that does not match is dropped, and the load sends it over the LAN as it would
have anyway. Tensors the cache already holds are not fetched again, so a replan fetches only what is new.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MeshError
from ..progress import ProgressCallback
from ..wire.layer_share import LayersFetched, LayerShare
from . import weight_cache
from .hub_models import fetch_range
from .weight_cache import WeightCache

FETCHING_FILE = "fetching.tensor"  # in the cache's root, outside rpc/: rpc-server never sees it unchecked


def fetch_layers(share: LayerShare, cache: WeightCache, tool: Path, progress: ProgressCallback, *,
                 endpoint: str | None = None, token: str | None = None) -> LayersFetched:
    """Every tensor of ``share`` in the cache, as far as the hub gives them and they check; the report to send
    back. ``endpoint`` and ``token`` default to huggingface_hub's (HF_ENDPOINT, HF_TOKEN)."""
    cache.create()
    todo = [t for t in share.tensors if not weight_cache.holds(cache, t.cache_name, t.sha256)]
    held, total = len(share.tensors) - len(todo), sum(t.size_bytes for t in todo)
    fetched_bytes, refused = 0, 0
    label = f"Fetching this node's layers of {share.repo} from the hub"
    progress(label, 0, total)
    staged = cache.root / FETCHING_FILE
    try:
        for tensor in todo:
            with open(staged, "wb") as out:
                fetch_range(share.repo, share.revision, share.files[tensor.file], tensor.offset, tensor.size_bytes,
                            out, endpoint=endpoint, token=token)
            fetched_bytes += tensor.size_bytes
            if weight_cache.admit_fetched(cache, tool, staged, tensor.cache_name, tensor.sha256):
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
