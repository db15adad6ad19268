"""Which tensors each worker fetches from the hub (serve/layer_share.py), and the messages that say so
(wire/layer_share.py): pure, no hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh_sidecar.errors import MalformedMessageError
from mesh_sidecar.llama.weight_cache import SeededTensor
from mesh_sidecar.serve.layer_share import planned_shares
from mesh_sidecar.serve.planner import Plan, PlannedNode
from mesh_sidecar.wire.gguf_header import TensorInfo
from mesh_sidecar.wire.gossip import decode_message, encode_message
from mesh_sidecar.wire.layer_share import LayerShare, SharedTensor

A, B, C = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32
SHA = "5" * 64
COMMIT = "c" * 40
SNAPSHOT = Path("/hub/models--u--big-GGUF/snapshots") / COMMIT
MIB = 1 << 20


def node(node_id: bytes, start: int, end: int, device: str = "CPU") -> PlannedNode:
    return PlannedNode(node_id, node_id.hex()[:2], start, end, 0, 0, 0, 0, 0, device=device)


def seeded(names: list[str], file: Path = SNAPSHOT / "big-Q8_0.gguf") -> list[SeededTensor]:
    return [SeededTensor(file, TensorInfo(name, (1,), 0, 1000 + 100 * MIB * i, 20 * MIB), f"{i:016x}", f"{i:064x}")
            for i, name in enumerate(names)]


TENSORS = seeded(["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.1.attn_q.weight",
                  "blk.2.attn_q.weight", "blk.10.attn_q.weight", "output.weight"])


def test_each_worker_is_given_the_tensors_of_its_own_layers():
    plan = Plan((node(A, 0, 2), node(B, 2, 11), node(C, 11, 12)), (), 12)
    shares = planned_shares(plan, TENSORS, SHA, lambda node_id: node_id != C)
    assert set(shares) == {A, B}
    assert [t.cache_name for t in shares[A].tensors] == [f"{i:016x}" for i in (1, 2, 3)]
    assert [t.cache_name for t in shares[B].tensors] == [f"{i:016x}" for i in (4, 5)]  # blk.10 is not blk.1
    share = shares[A]
    assert (share.repo, share.revision, share.files, share.model_sha256) == ("u/big-GGUF", COMMIT,
                                                                            ("big-Q8_0.gguf",), SHA)
    assert share.tensors[0] == SharedTensor(0, 1000 + 100 * MIB, 20 * MIB, f"{1:016x}", f"{1:064x}")
    assert share.total_bytes == 3 * 20 * MIB
    assert decode_message(encode_message(share)) == share


def test_a_member_holding_the_file_or_a_model_outside_the_hub_gets_no_share():
    plan = Plan((node(A, 0, 2), node(C, 2, 12)), (), 12)
    assert planned_shares(plan, TENSORS, SHA, lambda node_id: False) == {}
    elsewhere = seeded(["blk.0.attn_q.weight"], Path("/models/big-Q8_0.gguf"))
    assert planned_shares(plan, elsewhere, SHA, lambda node_id: True) == {}


def test_a_member_with_two_devices_gets_one_share_and_a_split_set_names_its_shards():
    shards = [*seeded(["blk.0.attn_q.weight"], SNAPSHOT / "big-00001-of-00002.gguf"),
              *seeded(["blk.1.attn_q.weight"], SNAPSHOT / "big-00002-of-00002.gguf")]
    plan = Plan((node(A, 0, 1, "CUDA0"), node(A, 1, 2, "CUDA1"), node(C, 2, 3)), (), 3)
    (share,) = planned_shares(plan, shards, SHA, lambda node_id: node_id == A).values()
    assert share.files == ("big-00001-of-00002.gguf", "big-00002-of-00002.gguf")
    assert [t.file for t in share.tensors] == [0, 1]


@pytest.mark.parametrize("change", [
    {"revision": "main"},  # a branch could move under the fetch: only a commit
    {"files": ["../etc/passwd.gguf"]},
    {"files": []},
    {"repo": "no-slash"},
    {"tensors": [[1, 0, 10, "0" * 16, "0" * 64]]},  # names a file the share does not list
    {"tensors": [[0, 0, 10, "XYZ", "0" * 64]]},
])
def test_a_malformed_share_is_refused(change):
    body = {**LayerShare(SHA, "u/r", COMMIT, ("m.gguf",), ()).to_body(), **change}
    payload = encode_message(LayerShare(SHA, "u/r", COMMIT, ("m.gguf",), ()))[:2] + json.dumps(body).encode()
    with pytest.raises(MalformedMessageError):
        decode_message(payload)
