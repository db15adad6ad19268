"""Builds that do not speak the same RPC: HELLO read, compatibility rule, refusal on both
sides (with real nodes: tests/integration/test_build_match.py)."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest

from mesh_sidecar.errors import MalformedMessageError
from mesh_sidecar.mesh.exclusion import LLAMA_BUILD_MISMATCH, WEIGHTS_MISMATCH, build_mismatch, exclusion_of
from mesh_sidecar.wire.gossip import LlamaBuild, MemberInfo
from mesh_sidecar.wire.rpc_hello import (
    HELLO_REQUEST,
    OLD_HELLO_REQUEST,
    HelloReply,
    RpcVersion,
    accepts,
    decode_hello_reply,
    hello_reply_size,
)
from tests.helpers.meshes import PINNED_BUILD

V = RpcVersion.parse


# --- the HELLO exchange -------------------------------------------------------------------


def test_the_requests_are_what_llama_server_sends():
    assert bytes([14]) + struct.pack("<Q", 24) + bytes(24) == HELLO_REQUEST
    assert bytes([14]) + struct.pack("<Q", 0) == OLD_HELLO_REQUEST


@pytest.mark.parametrize("payload, reply", [
    (bytes([7, 0, 0, 0]) + bytes(24), HelloReply(RpcVersion(7, 0, 0), b2b=False)),
    (bytes([7, 0, 1, 1]) + bytes(24), HelloReply(RpcVersion(7, 0, 1), b2b=True)),  # our b2b patch
    (bytes([3, 1, 4]), HelloReply(RpcVersion(3, 1, 4), b2b=False)),  # older builds: 3 bytes
])
def test_replies_give_the_version_and_the_b2b_flag(payload, reply):
    assert hello_reply_size(struct.pack("<Q", len(payload))) == len(payload)
    assert decode_hello_reply(payload) == reply


@pytest.mark.parametrize("size", [0, 4, 27, 29, 2**64 - 1])
def test_a_reply_of_another_size_is_no_hello_reply(size):
    with pytest.raises(MalformedMessageError):
        hello_reply_size(struct.pack("<Q", size))
    with pytest.raises(MalformedMessageError):
        decode_hello_reply(bytes(min(size, 64)))


def test_versions_parse_and_print():
    assert str(V("7.0.1")) == "7.0.1" and V("7.0.1") == RpcVersion(7, 0, 1)
    for text in ("7.0", "7.0.256", "a.b.c", " 7.0.0", "7.0.0.0", ""):
        with pytest.raises(ValueError):
            V(text)


# --- llama.cpp's rule: same major, server minor not newer ----------------------------------


@pytest.mark.parametrize("client, server, ok", [
    ("7.0.0", "7.0.0", True),
    ("7.0.0", "7.0.1", True),  # patch never compared: our b2b build talks to stock and back
    ("7.0.1", "7.0.0", True),
    ("7.2.0", "7.1.5", True),  # an older minor is fine
    ("7.1.0", "7.2.0", False),  # a newer minor is not
    ("7.0.0", "6.0.0", False),
    ("6.0.0", "7.0.0", False),
    ("3.1.0", "3.0.0", True),
])
def test_a_client_accepts_a_server_of_its_major_and_no_newer_minor(client, server, ok):
    assert accepts(V(client), V(server)) is ok


def build(rpc: str | None, label: str = "llama-cpp-python 0.3.36 stock") -> LlamaBuild:
    return LlamaBuild(None if rpc is None else V(rpc), False, label)


def test_an_unknown_server_is_refused_and_an_unknown_client_judges_nobody():
    assert build_mismatch(build("7.0.0"), build(None))
    assert not build_mismatch(build(None), build("6.0.0"))


def info(name: str, llama_build: LlamaBuild = PINNED_BUILD, *, serving: bool = False, sha: str = "") -> MemberInfo:
    return MemberInfo(node_id=name.encode().ljust(32, b"\0"), name=name, addresses=(), version="0.1.0",
                      capacity=(), serving=serving, rpc_ready=True, llama_build=llama_build, model_sha256=sha)


def test_the_refusal_names_both_versions_and_what_to_do():
    worker = info("b", build("6.0.0", "llama.cpp b5000 (abc1234)"))
    serving = info("c", serving=True)
    found = exclusion_of(worker, serving)
    assert found is not None and found.reason == LLAMA_BUILD_MISMATCH
    assert found.detail == ("b's rpc-server speaks RPC 6.0.0 (llama.cpp b5000 (abc1234)), but c's llama-server "
                            "speaks RPC 7.0.0 (llama-cpp-python 0.3.36 stock) and accepts only RPC 7.0.x")
    message = found.message("b")
    assert message.startswith(f"{LLAMA_BUILD_MISMATCH}: b's rpc-server speaks RPC 6.0.0")
    assert "so no layers will be placed on b" in message and "./scripts/bootstrap.sh" in message
    # Our b2b build (7.0.1, flagged) and the stock one are no mismatch.
    assert exclusion_of(info("b", dataclasses.replace(PINNED_BUILD, rpc=V("7.0.1"), b2b=True)), serving) is None
    newer = exclusion_of(worker, info("c", build("7.2.0"), serving=True))
    assert newer is not None and newer.detail.endswith("accepts only RPC 7.0 to 7.2")
    unknown = exclusion_of(info("b", build(None)), serving)
    assert unknown is not None and "b's rpc-server answers no RPC HELLO this release reads" in unknown.detail


def test_other_weights_are_named_first():
    worker = info("b", build("6.0.0"), sha="1" * 64)
    found = exclusion_of(worker, info("c", serving=True, sha="2" * 64))
    assert found is not None and found.reason == WEIGHTS_MISMATCH
    assert found.detail == "b's model (sha256 111111111111...) is not the one c serves (sha256 222222222222...)"


def test_the_build_travels_in_gossip_and_bad_versions_are_refused():
    member = info("b", LlamaBuild(V("7.0.1"), True, "llama-cpp-python 0.3.36 b2b"))
    body = member.to_body()
    assert body["llama_build"] == {"rpc_version": "7.0.1", "b2b": True, "llama_cpp": "llama-cpp-python 0.3.36 b2b"}
    assert MemberInfo.from_body(json.loads(json.dumps(body))) == member
    unknown = dataclasses.replace(member, llama_build=build(None))
    assert MemberInfo.from_body(unknown.to_body()) == unknown
    for bad in ("7.0", 7, "7.0.300", True):
        with pytest.raises(MalformedMessageError, match=r"llama_build\.rpc_version"):
            MemberInfo.from_body({**body, "llama_build": {**body["llama_build"], "rpc_version": bad}})
    with pytest.raises(MalformedMessageError, match=r"llama_build\.llama_cpp"):
        MemberInfo.from_body({**body, "llama_build": {**body["llama_build"], "llama_cpp": "caf\u00e9"}})
