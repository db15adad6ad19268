"""Models named on the hub, end to end (real processes, a local hub: tests/helpers/local_hub.py): a serving
node started with `--model hf:USER/REPO:QUANT` and members joining it answer through a split with llama.cpp's
own --rpc text; a worker naming the same model loads from its own copy; status and plan show the name; a
vision repo's projector is fetched and used, and an image is answered through the split.

Each node has its own hub cache (as separate machines have), so each download is counted at the hub.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import httpx
import pytest

from benchmarks.synthetic_model import SHARE_TEST, ensure_synthetic_model
from mesh_sidecar.llama.model_files import read_header, read_model_header
from mesh_sidecar.llama.weight_cache import HASH_THRESHOLD_BYTES, SEEDED_PREFIX
from tests.helpers.llama import complete, plain_llama_server_answer
from tests.helpers.llama_buffers import RpcServer, answer_over_tcp, served_by_one_llama_server
from tests.helpers.local_hub import LocalHub
from tests.helpers.mesh_api import GREEDY, answer_text, ask
from tests.helpers.nodes import cli
from tests.helpers.synthetic_projector import image_chat_messages, write_projector

pytestmark = pytest.mark.slow

REPO = "smol/SmolLM2-135M-Instruct-GGUF"
MODEL_FILE = "SmolLM2-135M-Instruct-Q4_K_M.gguf"
VISION_REPO = "smol/SmolVLM-synthetic-GGUF"
PROJECTOR_FILE = "mmproj-SmolVLM-synthetic-f16.gguf"
IMAGE_CHAT = {"messages": image_chat_messages(), "max_tokens": 24, **GREEDY}
MAX_SHARE_OF_MODEL = 0.05  # a worker's tunnel at a load by hash: a few small tensors and the hashes


@pytest.fixture
def hub():
    with LocalHub() as local:
        yield local


def hub_env(hub: LocalHub, cache: Path) -> dict[str, str]:
    """A node's environment: this hub, a cache of its own, no token."""
    return {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(cache), "HF_TOKEN": "", "HF_HUB_OFFLINE": "0"}


def greedy(port: int) -> str:
    # Random weights may say end-of-sequence at once: ignore_eos keeps the comparison long.
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"prompt": "The history of the printing press begins", "max_tokens": 16,
                                "ignore_eos": True, **GREEDY})
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def downloads(hub: LocalHub, file: str) -> int:
    return len([r for r in hub.file_requests(file) if r[0] == "GET"])


def test_a_split_of_a_model_named_on_the_hub_answers_as_llama_cpp(start_node, hub, model_path, binaries, tmp_path):
    hub.add_repo(REPO, {MODEL_FILE: model_path.read_bytes(), "README.md": b"# SmolLM2 135M\n"})
    name = f"hf:{REPO}:q4_k_m"  # the quant matched as llama.cpp matches it: case-insensitively
    a = start_node("a", "--model", f"hf:{REPO}", env=hub_env(hub, tmp_path / "cache-a"))  # its own copy
    b = start_node("b", "--join", a.ticket(), env=hub_env(hub, tmp_path / "cache-b"))  # no model named
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", "--model", name,
                   env=hub_env(hub, tmp_path / "cache-c"), serve=True)
    served = served_by_one_llama_server(c, lambda: complete(c.serve_port))
    assert sorted(n["name"] for n in served.plan["nodes"]) == ["a", "b", "c"]
    model = Path(served.argv[served.argv.index("-m") + 1])
    assert model.parent.parent.name == "snapshots" and str(model).startswith(str(tmp_path / "cache-c"))
    assert served.answer == answer_over_tcp(served.argv, [RpcServer(binaries)] * 3, tmp_path, complete)
    # a and c fetched the file once each; b, naming nothing, fetched nothing.
    assert downloads(hub, MODEL_FILE) == 2
    assert not (tmp_path / "cache-b").exists()
    # The name is what people see.
    shown = f"hf:{REPO}:Q4_K_M"
    assert c.status()["model"]["name"] == shown and a.status()["model"]["name"] == shown
    assert b.status()["model"]["name"] is None
    assert shown in cli("status", "--home", str(c.home), env={"COLUMNS": "200"}).stdout
    assert json.loads(cli("plan", "--home", str(a.home), "--json").stdout)["model_name"] == shown
    assert c.status()["serving"]["plan"]["model_name"] == shown  # the plan in service, as `plan` shows it
    planned = cli("plan", "--home", str(c.home), "--model", shown,
                  env={"COLUMNS": "200", **hub_env(hub, tmp_path / "cache-c"), "HF_HUB_OFFLINE": "1"})
    assert shown in planned.stdout, planned.stderr
    # Where the model is not downloaded, planning says how to get it.
    missing = cli("plan", "--home", str(c.home), "--model", f"hf:{REPO}:Q8_0", env=hub_env(hub, tmp_path / "cache-c"))
    assert missing.returncode != 0 and f"mesh-inference setup --model hf:{REPO}:Q8_0" in missing.stderr
    # a holds the served model under the same identity (the hub's sha256, not hashed again): its weight cache
    # was seeded from its own copy, so its loads send hashes.
    sha256 = hashlib.sha256(model_path.read_bytes()).hexdigest()
    assert c.status()["mesh"]["model_sha256"] == sha256 == a.status()["mesh"]["model_sha256"]
    assert (a.home / "weight-cache" / f"{SEEDED_PREFIX}{sha256}").exists()


def test_a_vision_repos_projector_is_fetched_and_answers_an_image(start_node, hub, model_path, binaries, tmp_path):
    header = read_model_header(model_path)
    n_embd = header.fields[f"{header.fields['general.architecture']}.embedding_length"]
    projector = write_projector(tmp_path / PROJECTOR_FILE, n_embd)
    hub.add_repo(VISION_REPO, {MODEL_FILE: model_path.read_bytes(), PROJECTOR_FILE: projector.read_bytes()})
    a = start_node("a")
    c = start_node("c", "--join", a.ticket(), "--min-peers", "1", "--model", f"hf:{VISION_REPO}",
                   env=hub_env(hub, tmp_path / "cache-c"), serve=True)

    def image_answer(port: int) -> str:
        return answer_text(ask(port, "/v1/chat/completions", IMAGE_CHAT))

    served = served_by_one_llama_server(c, lambda: image_answer(c.serve_port))
    used = Path(served.argv[served.argv.index("--mmproj") + 1])
    assert used.name == PROJECTOR_FILE and str(used).startswith(str(tmp_path / "cache-c"))
    assert served.answer == answer_over_tcp(served.argv, [RpcServer(binaries)] * 2, tmp_path, image_answer)
    assert [m["vision"] for m in a.status()["models"]] == [True]


def test_mmproj_none_takes_no_projector_from_the_repo(start_node, hub, model_path, tmp_path):
    hub.add_repo(VISION_REPO, {MODEL_FILE: model_path.read_bytes(), PROJECTOR_FILE: b"GGUF not fetched"})
    c = start_node("c", "--model", f"hf:{VISION_REPO}", "--mmproj", "none", env=hub_env(hub, tmp_path / "cache"),
                   serve=True)
    assert [m["vision"] for m in c.status()["models"]] == [False]
    assert downloads(hub, PROJECTOR_FILE) == 0


def test_a_name_the_hub_does_not_have_is_said_before_any_build(hub, tmp_path):
    malformed = cli("--home", str(tmp_path / "home"), "--model", "hf:just-a-repo")
    assert malformed.returncode != 0 and "is not a Hugging Face model name" in malformed.stderr
    missing = cli("--home", str(tmp_path / "home"), "--model", "hf:nobody/nothing-GGUF",
                  env={**hub_env(hub, tmp_path / "cache"), "MESH_LLAMA_BIN": str(tmp_path / "no-build")})
    assert missing.returncode != 0
    assert "has no model repo nobody/nothing-GGUF. Check the name" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr


def test_workers_fetch_only_their_own_layers_from_the_hub(start_node, hub, binaries, tmp_path):
    """Three nodes, only the serving one holding the file: each worker takes the tensors of its own layers
    from the hub (Range requests), checked against the serving node's copy, and the load sends them by hash."""
    model = ensure_synthetic_model(SHARE_TEST)  # three layers, every layer matrix over the by-hash threshold
    hub.add_repo(REPO, {MODEL_FILE: model.read_bytes()})
    expected = plain_llama_server_answer(binaries, model, tmp_path, greedy)
    a = start_node("a", env=hub_env(hub, tmp_path / "cache-a"))
    b = start_node("b", "--join", a.ticket(), env=hub_env(hub, tmp_path / "cache-b"))
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", "--model", f"hf:{REPO}",
                   env=hub_env(hub, tmp_path / "cache-c"), serve=True)
    assert greedy(c.serve_port) == expected
    plan = c.status()["serving"]["plan"]
    tensors = {t.name: t for t in read_header(model).tensors}
    ranges = [r[2] for r in hub.file_requests(MODEL_FILE) if r[0] == "GET" and r[2] and r[2].count("-") == 1
              and not r[2].endswith("-")]  # bounded ranges: the workers' (c downloads the file whole)
    assert ranges, hub.requests
    for worker in (a, b):
        start, end = next(n["layers"] for n in plan["nodes"] if n["name"] == worker.home.name)
        own = {t.data_offset: t.n_bytes for name, t in tensors.items() if t.n_bytes > HASH_THRESHOLD_BYTES
               and start <= int(name.split(".")[1] if name.startswith("blk.") else -1) < end}
        said = re.search(rf"^{worker.home.name} fetched [\d.]+ GiB from the hub; (\d+) of its (\d+) large tensors "
                         "go by hash", c.text(), re.MULTILINE)
        assert said and said.group(1) == said.group(2) == str(len(own)), c.text()
        row = next(p for p in c.status()["peers"] if p["name"] == worker.home.name)
        print(f"\n{worker.home.name}: layers [{start}, {end}), fetched {sum(own.values())} bytes from the hub; "
              f"its tunnel carried {row['bytes_to_peer']} bytes")
        assert row["bytes_to_peer"] < MAX_SHARE_OF_MODEL * model.stat().st_size  # hashes, not weights
    fetched = [tuple(int(x) for x in r[len("bytes="):].split("-")) for r in ranges]
    wanted = {(t.data_offset, t.data_offset + t.n_bytes - 1) for t in tensors.values()
              if t.n_bytes > HASH_THRESHOLD_BYTES}
    assert set(fetched) <= wanted and len(fetched) == len(set(fetched))  # each tensor once, no more
