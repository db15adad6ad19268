"""--mmproj: a projector checked at start (a projector, as wide as its model), its memory counted on the
serving node, images told apart from text, a model without one refusing them, its sha256 in gossip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh_sidecar.cli.prepare import identify_projectors
from mesh_sidecar.errors import ModelError, UsageError
from mesh_sidecar.llama.model_files import read_model_header
from mesh_sidecar.llama.projector import check_pair, read_projector
from mesh_sidecar.node.options import read_projectors
from mesh_sidecar.serve.api_request import ApiRequest
from mesh_sidecar.serve.catalog import mesh_catalog
from mesh_sidecar.serve.planner import NodeCapacity, assess_tiers
from mesh_sidecar.serve.routing import NO_IMAGES_CODE, MeshRouter, MeshRoutes, Refusal, Route
from mesh_sidecar.wire.gossip import MemberInfo, ServedModel
from tests.helpers.meshes import PINNED_BUILD
from tests.helpers.synthetic_projector import image_chat_messages, write_projector
from tests.unit.test_planner import estimate

DEFAULT_MODEL_EMBD = 576  # SmolLM2-135M's embedding width


@pytest.fixture(scope="module")
def projector_file(tmp_path_factory) -> Path:
    return write_projector(tmp_path_factory.mktemp("projector") / "mmproj.gguf", DEFAULT_MODEL_EMBD)


def test_a_projector_is_read_with_its_width_and_memory(projector_file) -> None:
    projector = read_projector(projector_file)
    assert (projector.projector_type, projector.width) == ("mlp", DEFAULT_MODEL_EMBD)
    assert 0 < projector.weight_bytes < projector_file.stat().st_size < projector.memory_bytes


def test_a_projector_pairs_with_its_model_and_not_with_another(projector_file, model_path, tmp_path) -> None:
    check_pair(read_projector(projector_file), model_path, read_model_header(model_path))  # no error
    narrow = read_projector(write_projector(tmp_path / "mmproj-512.gguf", 512))
    with pytest.raises(ModelError, match=r"mmproj-512.gguf makes 512-wide embeddings, but .* takes 576-wide ones "
                                         r"\(llama.embedding_length\): they do not belong together"):
        check_pair(narrow, model_path, read_model_header(model_path))


def test_a_model_given_as_projector_is_refused(model_path) -> None:
    with pytest.raises(ModelError, match=r"is not a multimodal projector \(its general.architecture is 'llama'"):
        read_projector(model_path)


def test_mmproj_is_one_per_model_on_a_serving_node(projector_file, model_path) -> None:
    with pytest.raises(UsageError, match="--mmproj works on the serving node only"):
        read_projectors([str(projector_file)], 1, serving=False)
    with pytest.raises(UsageError, match=r"Give --mmproj once per --model.*2 model\(s\), 1 projector\(s\)"):
        read_projectors([str(projector_file)], 2, serving=True)
    read = read_projectors([str(projector_file), "none"], 2, serving=True)
    assert read[1] is None and read[0] is not None and read[0].sha256 == ""
    identified = identify_projectors(read, [model_path, model_path])
    assert identified[1] is None and identified[0] is not None and len(identified[0].sha256) == 64


def test_the_plan_counts_the_projector_on_the_serving_node() -> None:
    worker, host = NodeCapacity(b"w" * 32, "w", 1000), NodeCapacity(b"s" * 32, "s", 500)
    plain = estimate(4, 100, margin=10, output=5, kv=20)
    fits = assess_tiers([("m.gguf", plain)], [worker, host])
    assert fits.plans[0].projector_bytes == 0
    with_projector = plain.__class__(**{**plain.__dict__, "projector_bytes": 450})
    assessed = assess_tiers([("m.gguf", with_projector)], [worker, host])
    plan = assessed.plans[0]
    assert plan.projector_bytes == 450 and plan.to_json()["projector_bytes"] == 450
    # Only 50 bytes of the host are left beside the projector: it holds fewer layers, or none.
    host_layers = [n for n in plan.nodes if n.name == "s"]
    assert sum(n.end - n.start for n in host_layers) < sum(n.end - n.start for n in fits.plans[0].nodes
                                                           if n.name == "s")


IMAGE_CHAT = json.dumps({"messages": image_chat_messages()}).encode()


def has_images(body: bytes) -> bool:
    return ApiRequest.parse("POST", "/v1/chat/completions", body).images


def test_images_are_told_apart_from_text() -> None:
    assert has_images(json.dumps({"messages": image_chat_messages()}).encode())
    assert not has_images(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
    assert not has_images(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
                          .encode())
    assert not has_images(b"not json") and not has_images(b'{"prompt": "x"}')


def serving_member(node_id: bytes, name: str, projector_sha256: str = "") -> MemberInfo:
    return MemberInfo(node_id=node_id, name=name, version="0", addresses=(), capacity=(), serving=True,
                      rpc_ready=True, llama_build=PINNED_BUILD,
                      serves=ServedModel("m", "ready", 1.0, 0, 100, 10, 10, projector_sha256=projector_sha256))


def test_a_model_without_a_projector_refuses_images_and_one_with_it_routes_them() -> None:
    own = MemberInfo(node_id=b"a" * 32, name="a", version="0", addresses=(), capacity=(), serving=False,
                     rpc_ready=True, llama_build=PINNED_BUILD)
    for members, refused in (([serving_member(b"c" * 32, "c")], True),
                             ([serving_member(b"c" * 32, "c", "d" * 64)], False)):
        catalog = mesh_catalog(own, members, lambda node_id: node_id.hex()[:4])
        router = MeshRouter(MeshRoutes(lambda _, catalog=catalog: catalog, lambda: 0, None, None, str),
                            1.0)
        routed = router.route(ApiRequest.parse("POST", "/v1/chat/completions", IMAGE_CHAT), forwarded=False,
                              ours=None, own_in_flight=0)
        if refused:
            assert isinstance(routed, Refusal) and (routed.status, routed.code) == (400, NO_IMAGES_CODE)
            assert catalog.openai_entries(0)[0]["capabilities"] == ["completion"]
        else:
            assert isinstance(routed, Route) and routed.images
            assert catalog.openai_entries(0)[0]["capabilities"] == ["completion", "multimodal"]
            assert catalog.to_json()[0]["vision"] is True


def test_the_projectors_sha256_travels_in_gossip_only_when_there_is_one() -> None:
    served = ServedModel("m", "ready", 1.0, 0, 100, 10, 10, projector_sha256="d" * 64)
    assert ServedModel.from_body(served.to_body(), "serves") == served
    text_only = ServedModel("m", "ready", 1.0, 0, 100, 10, 10)
    assert "projector_sha256" not in text_only.to_body()  # an older node of this wire version still reads it
    assert ServedModel.from_body(text_only.to_body(), "serves") == text_only
