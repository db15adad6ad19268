"""Before a load, workers lacking a hub model's file fetch their own layers from the hub (wire/layer_share.py).

A model the serving node took from the Hugging Face hub is there for every member to take. So instead of
sending each worker its layers over the LAN during the load, the serving node tells each worker whose file
differs which tensors its plan gives it (with the sha256 its own copy's seeding found for each,
llama/weight_cache.py), waits a bounded time for their answers, and then loads: the tensors a worker fetched
go by hash. Only by-hash tensors (over 10 MiB) are named: smaller ones go as bytes in any case.

The wait is for the first load of a plan only: during a failover the load starts at once, and a worker's
fetch helps the loads after it. A worker that does not answer in time, or fetched only some, gets the rest
over the LAN as before.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

from ..llama.hub_models import hub_location
from ..llama.weight_cache import SeededTensor, WeightCache, seeded_tensors
from ..mesh.runtime import Mesh
from ..units import MIB, format_gib
from ..wire.layer_share import LayerShare, SharedTensor
from .planner import Plan

# A worker's fetch is waited for as if the hub gave it at least this rate, and this long besides.
LAYER_FETCH_MIN_BYTES_PER_S = 4 * MIB
LAYER_FETCH_GRACE_S = 30.0
_LAYER_OF_TENSOR = re.compile(r"blk\.(\d+)\.")


def planned_shares(plan: Plan, tensors: list[SeededTensor], model_sha256: str,
                   lacks_model: Callable[[bytes], bool]) -> dict[bytes, LayerShare]:
    """The share of each node of ``plan`` that ``lacks_model``: the tensors of its layers (``blk.N.*``). None
    for a model outside the hub's cache, or a node whose layers hold no by-hash tensor."""
    files: list[Path] = list(dict.fromkeys(t.file for t in tensors))
    locations = [hub_location(file) for file in files]
    if not files or any(location is None for location in locations):
        return {}
    first = locations[0]
    assert first is not None
    index = {file: i for i, file in enumerate(files)}
    shares: dict[bytes, LayerShare] = {}
    for node in plan.nodes:
        if not lacks_model(node.node_id):
            continue
        mine = [SharedTensor(index[t.file], t.tensor.data_offset, t.tensor.n_bytes, t.cache_name, t.sha256)
                for t in tensors if node.start <= _layer_of(t.tensor.name) < node.end]
        earlier = shares.get(node.node_id)  # another device of the same member
        if earlier is not None:
            mine = [*earlier.tensors, *mine]
        if mine:
            shares[node.node_id] = LayerShare(model_sha256, first.repo, first.revision,
                                              tuple(location.file for location in locations if location), tuple(mine))
    return shares


def _layer_of(tensor_name: str) -> int:
    found = _LAYER_OF_TENSOR.match(tensor_name)
    return int(found.group(1)) if found else -1  # token_embd, output: the serving node's


async def share_layers(mesh: Mesh, plan: Plan, model: Path, sha256: str, cache: WeightCache | None,
                       say: Callable[[str], None], *, wait: bool) -> None:
    """Tell each worker of ``plan`` lacking ``model`` to fetch its layers from the hub; with ``wait``, wait
    (a bounded time) until they say they did."""
    if cache is None or hub_location(model) is None:
        return
    tensors = await asyncio.to_thread(seeded_tensors, cache, model, sha256)
    holders = {info.node_id for info in mesh.connected_members() if info.model_sha256 == sha256}
    shares = planned_shares(plan, tensors, sha256, lambda node_id: node_id not in holders
                            and node_id != mesh.self_info.node_id)
    if not shares:
        return
    for node_id, share in shares.items():
        mesh.layers.forget(node_id)
        mesh.send_layers(node_id, share)
    listed = ", ".join(f"{mesh.name_of(n)} {format_gib(s.total_bytes)} GiB" for n, s in shares.items())
    if not wait:
        say(f"Workers fetch their new layers from the hub for later loads ({listed}); this load sends them.")
        return
    say(f"Workers fetch their own layers from the hub before the load: {listed}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LAYER_FETCH_GRACE_S + max(s.total_bytes for s in shares.values()) / \
        LAYER_FETCH_MIN_BYTES_PER_S
    while pending := [n for n in shares if mesh.layers.report_of(n, sha256) is None
                      and any(info.node_id == n for info in mesh.connected_members())]:
        seen = mesh.changes.version
        try:
            await asyncio.wait_for(mesh.changes.wait_after(seen), deadline - loop.time())
        except TimeoutError:
            say(f"Loading without waiting longer for {', '.join(mesh.name_of(n) for n in pending)}: the layers "
                "not fetched yet go over the LAN.")
            break
    for node_id, share in shares.items():
        if (report := mesh.layers.report_of(node_id, sha256)) is not None:
            said = (f"{mesh.name_of(node_id)} fetched {format_gib(report.fetched_bytes)} GiB from the hub; "
                    f"{report.tensors} of its {len(share.tensors)} large tensors go by hash")
            say(said + (f" ({report.error})" if report.error else ""))
