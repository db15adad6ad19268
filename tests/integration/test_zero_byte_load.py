"""Zero-byte loads with real processes: a worker that holds the model file gets only hashes."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.synthetic_model import CACHE_TEST, ensure_synthetic_model
from mesh_sidecar.llama.model import file_sha256
from mesh_sidecar.llama.weight_cache import hashed_tensor_ranges
from tests.helpers.llama import plain_llama_server_answer
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

MAX_SHARE_OF_MODEL = 0.05  # the bound: weight bytes over the worker's tunnel vs the model
PROMPT = "The history of the printing press begins"


def greedy(port: int) -> str:
    # Random weights may say end-of-sequence at once: ignore_eos keeps the comparison long.
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "top_k": 1, "seed": 42,
                                "ignore_eos": True})
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def big_tensor_model():
    """~340 MB, every per-layer matrix above llama.cpp's 10 MiB by-hash threshold."""
    return ensure_synthetic_model(CACHE_TEST)


def test_worker_with_the_model_file_receives_only_hashes(start_node, binaries, big_tensor_model, tmp_path):
    expected = plain_llama_server_answer(binaries, big_tensor_model, tmp_path, greedy)
    worker = start_node("a", "--model", str(big_tensor_model))
    seeded = list((worker.home / "weight-cache" / "rpc").iterdir())
    assert len(seeded) == len(hashed_tensor_ranges(big_tensor_model))
    server = start_node("c", "--join", worker.ticket(), "--model", str(big_tensor_model), "--min-peers", "1",
                        serve=True)
    assert greedy(server.serve_port) == expected
    status = server.status()
    plan = status["serving"]["plan"]
    assert [n["name"] for n in plan["nodes"]] == ["a", "c"]  # the worker holds layers
    worker_row = next(p for p in status["peers"] if p["name"] == "a")
    model_bytes = big_tensor_model.stat().st_size
    share = worker_row["bytes_to_peer"] / model_bytes
    print(f"\nworker's tunnel carried {worker_row['bytes_to_peer']} bytes = {share:.4%} of the model "
          f"({model_bytes} bytes); its layers hold {plan['nodes'][0]['weights_bytes']} bytes")
    assert share < MAX_SHARE_OF_MODEL
    assert plan["nodes"][0]["weights_bytes"] > MAX_SHARE_OF_MODEL * model_bytes  # so the bound means something


def test_worker_fetches_the_served_model_then_holds_it(start_node, binaries, model_path, tmp_path):
    server = start_node("c", serve=True)
    own_cache = tmp_path / "b-cache"  # so the fetch really happens, whatever the shared cache holds
    worker = start_node("b", "--join", server.ticket(), "--fetch-model", "--llama-bin", str(binaries.directory),
                        env={"MESH_CACHE": str(own_cache)})
    wait_until(lambda: "Now holding the served model" in worker.text() or worker.proc.poll() is not None, 120,
               "the worker fetches the model")
    assert "Fetching the model from c" in worker.text()
    fetched = own_cache / "models" / "sha256" / f"{file_sha256(model_path)}.gguf"
    assert fetched.read_bytes() == model_path.read_bytes()
    row = next(p for p in server.status()["peers"] if p["name"] == "b")
    assert row["model_sha256"] == file_sha256(model_path) and row["refused"] is None
    assert len(list((worker.home / "weight-cache" / "rpc").iterdir())) == len(hashed_tensor_ranges(model_path))
