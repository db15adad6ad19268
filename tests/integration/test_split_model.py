"""A model split by llama.cpp's own gguf-split, through the product: the same text and plan as its single
file, and a worker fetches every shard over the mesh."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import httpx
import pytest

from mesh_sidecar.llama.build import ensure_gguf_split
from mesh_sidecar.llama.estimate import estimate_model
from mesh_sidecar.llama.model import model_sha256
from mesh_sidecar.llama.model_files import model_files
from mesh_sidecar.llama.weight_cache import hashed_tensor_ranges
from tests.helpers.llama import complete, quiet
from tests.helpers.llama_buffers import check_plan_against_llama_cpp, served_by_one_llama_server
from tests.helpers.nodes import cli
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

SHARD_TENSORS = 100  # the default model's 272 tensors in three shards
N_CTX = 4096


@pytest.fixture(scope="module")
def split_model(model_path, tmp_path_factory) -> Path:
    """The default model split into three shards by llama.cpp's llama-gguf-split; its second shard."""
    directory = tmp_path_factory.mktemp("split")
    subprocess.run([str(ensure_gguf_split(quiet)), "--split", "--split-max-tensors", str(SHARD_TENSORS),
                    str(model_path), str(directory / "smol")], check=True, capture_output=True)
    assert len(list(directory.glob("smol-0000?-of-00003.gguf"))) == 3
    return directory / "smol-00002-of-00003.gguf"  # any shard names the set


def plan_json(node, model: Path) -> dict:
    result = cli("plan", "--home", str(node.home), "--model", str(model), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_estimate_of_the_shards_is_the_single_files(model_path, split_model):
    single, split = estimate_model(model_path, N_CTX), estimate_model(split_model, N_CTX)
    assert dataclasses.replace(split, name=single.name) == single


def test_a_split_model_answers_and_plans_as_its_single_file(start_node, model_path, split_model, reference_text,
                                                            tmp_path):
    a = start_node("a")
    b = start_node("b", "--join", a.ticket())
    receipts = tmp_path / "receipts"
    c = start_node("c", "--join", b.ticket(), "--model", str(split_model), "--min-peers", "2",
                   "--receipt", str(receipts), serve=True)
    served = served_by_one_llama_server(c, lambda: complete(c.serve_port))
    assert served.answer == reference_text
    models = httpx.get(f"http://127.0.0.1:{c.serve_port}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["smol"]  # the set's name, not a shard's
    plan = served.plan
    assert sorted(n["name"] for n in plan["nodes"]) == ["a", "b", "c"]  # split over all three (--spread)
    # Per node, as llama.cpp loaded it.
    check_plan_against_llama_cpp(plan, served.argv, Path(served.log).read_text())
    # The same plan for the set and for the single file, over the same mesh.
    as_split, as_single = plan_json(c, split_model), plan_json(c, model_path)
    ranges = [[(n["name"], n["layers"], n["weights_bytes"]) for n in p["nodes"]]
              for p in (as_split, as_single)]
    assert ranges[0] == ranges[1]
    # The receipt names the set by its manifest and lists every shard.
    (receipt,) = [json.loads(p.read_text()) for p in receipts.glob("*.json")]
    identity = model_sha256(split_model, quiet)
    assert receipt["body"]["model"]["sha256"] == identity
    assert [s["name"] for s in receipt["body"]["model"]["shards"]] == [f.name for f in model_files(split_model)]


def test_a_worker_fetches_every_shard_then_holds_the_model(start_node, binaries, split_model, tmp_path):
    server = start_node("c", "--model", str(split_model), serve=True)
    own_cache = tmp_path / "b-cache"  # so the fetch really happens, whatever the shared cache holds
    worker = start_node("b", "--join", server.ticket(), "--fetch-model", "--llama-bin", str(binaries.directory),
                        env={"MESH_CACHE": str(own_cache)})
    wait_until(lambda: "Now holding the served model" in worker.text() or worker.proc.poll() is not None, 120,
               "the worker fetches the model")
    identity = model_sha256(split_model, quiet)
    shards = model_files(split_model)
    for number, shard in enumerate(shards, start=1):
        assert f"{shard.name} ({number}/3)" in worker.text()
        assert (own_cache / "models" / "sha256" / identity / shard.name).read_bytes() == shard.read_bytes()
    row = next(p for p in server.status()["peers"] if p["name"] == "b")
    assert row["model_sha256"] == identity and row["refused"] is None
    assert len(list((worker.home / "weight-cache" / "rpc").iterdir())) == len(hashed_tensor_ranges(split_model))
