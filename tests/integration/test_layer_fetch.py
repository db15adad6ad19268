"""A worker's layers fetched from a hub (llama/layer_fetch.py) against a local hub and the real weight-cache
tool: the tensors a share names arrive checked in the cache; a replan fetches only what is new; a tensor the
hub sends damaged is refused and said, the others kept; what was fetched for one serving node leaves the cache
when another uses the worker, and a share from a node not using it is refused."""

from __future__ import annotations

import hashlib

import pytest

from benchmarks.synthetic_model import SHARE_TEST, ensure_synthetic_model
from mesh_sidecar.llama import weight_cache
from mesh_sidecar.llama.hub_models import parse_model_name, resolve
from mesh_sidecar.llama.layer_fetch import FetchedFor, fetch_layers
from mesh_sidecar.llama.weight_cache import WeightCache, seed, seeded_tensors
from mesh_sidecar.serve.layer_share import planned_shares
from mesh_sidecar.serve.planner import Plan, PlannedNode
from tests.helpers.llama import quiet
from tests.helpers.local_hub import LocalHub

REPO = "u/share-test-GGUF"
FILE = "share-test-F16.gguf"
WORKER, SERVING, OTHER = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A hub holding the model, and the serving node's side: its copy from the hub and its seeded cache."""
    model = ensure_synthetic_model(SHARE_TEST)
    root = tmp_path_factory.mktemp("serving")
    with LocalHub() as hub:
        hub.add_repo(REPO, {FILE: model.read_bytes()})
        name = parse_model_name(f"hf:{REPO}")
        assert name is not None
        resolved = resolve(name, progress=quiet, endpoint=hub.endpoint, cache_dir=root / "hub")
        cache, tool = WeightCache(root / "weight-cache"), weight_cache.ensure_tool(quiet)
        sha256 = hashlib.sha256(model.read_bytes()).hexdigest()
        seed(cache, tool, resolved.model_path, sha256, quiet)
        yield hub, seeded_tensors(cache, resolved.model_path, sha256), sha256, tool


def share_of(served, start: int, end: int):
    _, tensors, sha256, _ = served
    plan = Plan((PlannedNode(WORKER, "w", start, end, 0, 0, 0, 0, 0),
                 PlannedNode(SERVING, "s", end, SHARE_TEST.n_layers, 0, 0, 0, 0, 0)), (), SHARE_TEST.n_layers)
    return planned_shares(plan, tensors, sha256, lambda node_id: node_id == WORKER)[WORKER]


def used_by_serving(cache: WeightCache) -> FetchedFor:
    fetched_for = FetchedFor(cache)
    fetched_for.used_by(SERVING)  # its --rpc order names the worker
    return fetched_for


def range_gets(hub: LocalHub) -> int:
    return len([r for r in hub.file_requests(FILE) if r[0] == "GET" and r[2] and not r[2].endswith("-")])


def test_a_share_lands_checked_and_a_replan_fetches_only_the_new_layers(served, tmp_path):
    hub, _, _, tool = served
    cache = WeightCache(tmp_path / "weight-cache")
    first = share_of(served, 0, 1)
    before = range_gets(hub)
    fetched_for = used_by_serving(cache)
    report = fetch_layers(first, SERVING, fetched_for, tool, quiet, endpoint=hub.endpoint)
    assert (report.tensors, report.fetched_bytes, report.error) == (len(first.tensors), first.total_bytes, "")
    assert all(weight_cache.holds(cache, t.cache_name, t.sha256) for t in first.tensors)
    assert range_gets(hub) - before == len(first.tensors)
    assert weight_cache.verify(cache, quiet) == 0  # the cache's own check keeps what was fetched
    wider = share_of(served, 0, 2)
    before = range_gets(hub)
    report = fetch_layers(wider, SERVING, fetched_for, tool, quiet, endpoint=hub.endpoint)
    assert report.tensors == len(wider.tensors) and report.error == ""
    assert range_gets(hub) - before == len(wider.tensors) - len(first.tensors)


def test_a_tensor_damaged_on_the_way_is_refused_and_the_rest_kept(served, tmp_path):
    hub, _, _, tool = served
    share = share_of(served, 0, 1)
    damaged = share.tensors[1]
    hub.corrupt(REPO, FILE, damaged.offset + damaged.size_bytes // 2)
    try:
        cache = WeightCache(tmp_path / "weight-cache")
        report = fetch_layers(share, SERVING, used_by_serving(cache), tool, quiet, endpoint=hub.endpoint)
    finally:
        hub.repos[REPO].corrupt.clear()
    assert report.tensors == len(share.tensors) - 1
    assert "1 tensor(s) from the hub did not match the serving node's copy" in report.error
    assert not weight_cache.holds(cache, damaged.cache_name, damaged.sha256)
    assert len(list(cache.tensors.iterdir())) == len(share.tensors) - 1  # nothing unchecked left in it


def test_a_hub_that_is_gone_is_reported_not_raised(served, tmp_path):
    _, _, _, tool = served
    share = share_of(served, 0, 1)
    report = fetch_layers(share, SERVING, used_by_serving(WeightCache(tmp_path / "weight-cache")), tool, quiet,
                          endpoint="http://127.0.0.1:9")  # nothing listens on the discard port
    assert report.tensors == 0 and "Cannot reach http://127.0.0.1:9" in report.error


def test_what_one_serving_node_fetched_never_answers_anothers_load(served, tmp_path):
    """A share's bytes are the sender's choice (and FNV-1a names can be made to collide): tensors fetched for
    one serving node leave the cache once another's --rpc order names the worker, and a node that does not
    use the worker has its share refused."""
    hub, _, _, tool = served
    cache = WeightCache(tmp_path / "weight-cache")
    fetched_for = used_by_serving(cache)
    share = share_of(served, 0, 1)
    assert fetch_layers(share, SERVING, fetched_for, tool, quiet, endpoint=hub.endpoint).tensors == len(share.tensors)
    refused = fetch_layers(share, OTHER, fetched_for, tool, quiet, endpoint=hub.endpoint)
    assert refused.tensors == 0 and "not in that node's --rpc order" in refused.error
    assert fetched_for.used_by(OTHER) == len(share.tensors)  # another serving node's load comes next
    assert not any(weight_cache.holds(cache, t.cache_name, t.sha256) for t in share.tensors)
    assert list(cache.tensors.iterdir()) == []
    # Nor does a restart keep them: a node's first look at its cache drops whatever was fetched.
    assert fetch_layers(share, OTHER, fetched_for, tool, quiet, endpoint=hub.endpoint).tensors == len(share.tensors)
    FetchedFor(cache)
    assert list(cache.tensors.iterdir()) == []
