"""Images through the mesh (real processes): a serving node given --mmproj answers image chats through a
three-node split with llama-server's own text (--mmproj, --rpc over plain TCP, the same split), on a
forwarding member too; the plan counts the projector; /v1/models and status mark the model; a stream with an
image survives a worker's loss; a model without a projector refuses images with a 400.

The projector is made for the test (tests/helpers/synthetic_projector.py): random weights, nonsense answers,
the real path (llama-server's clip loader, the vision graph, the image's embeddings through the split).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from mesh_sidecar.llama.model_files import read_model_header
from mesh_sidecar.llama.projector import read_projector
from mesh_sidecar.serve.routing import NO_IMAGES_CODE
from mesh_sidecar.serve.tiers import model_id
from tests.helpers.llama_buffers import RpcServer, answer_over_tcp, served_by_one_llama_server
from tests.helpers.mesh_api import GREEDY, Streamed, answer_text, ask, listed_models, stream
from tests.helpers.nodes import cli, kill_worker, metrics
from tests.helpers.synthetic_projector import image_chat_messages, write_projector

pytestmark = pytest.mark.slow

CHAT_PATH = "/v1/chat/completions"
IMAGE_CHAT = {"messages": image_chat_messages(), "max_tokens": 24, **GREEDY}
LONG_IMAGE_CHAT = {"messages": image_chat_messages("Describe this image at length."), "max_tokens": 160,
                   "ignore_eos": True, **GREEDY}
KILL_AFTER_EVENTS = 20
OVER_THE_BODY_LIMIT_BYTES = 9 * 1024 * 1024  # the API takes 8 MiB


@pytest.fixture
def projector(tmp_path: Path, model_path: Path) -> Path:
    """A projector for the default model: its output as wide as the model's embeddings."""
    header = read_model_header(model_path)
    n_embd = header.fields[f"{header.fields['general.architecture']}.embedding_length"]
    return write_projector(tmp_path / "mmproj-synthetic.gguf", n_embd)


def image_answer(port: int) -> str:
    return answer_text(ask(port, CHAT_PATH, IMAGE_CHAT))


def test_image_chats_through_a_split_are_llama_servers_own_and_survive_a_worker(start_node, binaries, model_path,
                                                                                projector, tmp_path):
    a = start_node("a")
    b = start_node("b", "--join", a.ticket())
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", "--mmproj", str(projector), serve=True)
    served = served_by_one_llama_server(c, lambda: image_answer(c.serve_port))
    assert sorted(n["name"] for n in served.plan["nodes"]) == ["a", "b", "c"]
    assert served.argv[served.argv.index("--mmproj") + 1] == str(projector) and "--no-mmproj-offload" in served.argv
    reference = answer_over_tcp(served.argv, [RpcServer(binaries)] * 3, tmp_path, image_answer)
    assert served.answer == reference
    forwarded = image_answer(a.api_port)  # a's API forwards it to c over the mesh
    assert forwarded == reference
    print(f"\nimage chat answered through forwarding member a: {forwarded!r}")
    text_only = answer_text(ask(c.serve_port, CHAT_PATH, {**IMAGE_CHAT, "messages": [
        {"role": "user", "content": "What is in this image?"}]}))
    assert text_only != reference  # the image reached the model

    # The plan counts the projector on the serving node, and says so.
    plan = json.loads(cli("plan", "--home", str(c.home), "--json").stdout)
    assert plan["projector_bytes"] >= read_projector(projector).memory_bytes > projector.stat().st_size
    shown = cli("plan", "--home", str(c.home), env={"COLUMNS": "120"}).stdout
    assert "Image projector (--mmproj)" in shown
    print(shown)
    # Every member lists the model as taking images.
    model = model_id(model_path.name)
    assert "multimodal" in listed_models(a.api_port)[model]["capabilities"]
    assert [m["vision"] for m in a.status()["models"]] == [True]
    assert "(images)" in cli("status", "--home", str(a.home), env={"COLUMNS": "200"}).stdout
    # An image over the body limit is refused where the client called.
    huge = {"messages": image_chat_messages(url="data:image/png;base64," + "A" * OVER_THE_BODY_LIMIT_BYTES)}
    too_large = ask(a.api_port, CHAT_PATH, huge)
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"

    # A stream with an image is replayed after a worker dies: the client keeps the text it has.
    undisturbed = stream(c.serve_port, CHAT_PATH, LONG_IMAGE_CHAT)
    killed = threading.Event()

    def kill_once_started(streamed: Streamed) -> None:
        if not killed.is_set() and len(streamed.events) >= KILL_AFTER_EVENTS:
            killed.set()
            kill_worker(b)

    survived = stream(c.serve_port, CHAT_PATH, LONG_IMAGE_CHAT, on_event=kill_once_started)
    assert killed.is_set() and survived.done and survived.error is None, survived.error
    seam = survived.seam()
    assert seam >= KILL_AFTER_EVENTS
    assert survived.text(seam) == undisturbed.text(seam)  # what the client had, kept (not batch-invariant after)
    assert survived.finish_reasons() == ["length"]
    assert metrics(c.serve_port)["mesh_streams_resumed_total{how=replayed}"] >= 1


def test_a_model_without_a_projector_refuses_images(start_node):
    c = start_node("c", serve=True)
    refused = ask(c.serve_port, CHAT_PATH, IMAGE_CHAT)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == NO_IMAGES_CODE and "--mmproj" in error["message"]
    # The same request without its image is answered.
    assert answer_text(ask(c.serve_port, CHAT_PATH, {**IMAGE_CHAT, "messages": [
        {"role": "user", "content": "What is in this image?"}]}))
