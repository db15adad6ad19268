"""Builds that do not speak the same RPC: HELLO read, compatibility rule, refusal on both sides, real nodes."""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
from pathlib import Path

import psutil
import pytest

from mesh_sidecar.errors import MalformedMessageError
from mesh_sidecar.llama.build import LLAMA_SERVER_BINARY, RPC_SERVER_BINARY
from mesh_sidecar.mesh.refusal import LLAMA_BUILD_MISMATCH, WEIGHTS_MISMATCH, build_mismatch, refusal
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
from tests.conftest import TICKET_LINE, cli, complete
from tests.meshes import PINNED_BUILD
from tests.waiting import wait_until

V = RpcVersion.parse


# --- the HELLO exchange -------------------------------------------------------------------


def test_the_requests_are_what_llama_server_sends():
    assert HELLO_REQUEST == bytes([14]) + struct.pack("<Q", 24) + bytes(24)
    assert OLD_HELLO_REQUEST == bytes([14]) + struct.pack("<Q", 0)


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
    found = refusal(worker, serving)
    assert found is not None and found.reason == LLAMA_BUILD_MISMATCH
    assert found.detail == ("b's rpc-server speaks RPC 6.0.0 (llama.cpp b5000 (abc1234)), but c's llama-server "
                            "speaks RPC 7.0.0 (llama-cpp-python 0.3.36 stock) and accepts only RPC 7.0.x")
    message = found.message("b")
    assert message.startswith(f"{LLAMA_BUILD_MISMATCH}: b's rpc-server speaks RPC 6.0.0")
    assert "so no layers will be placed on b" in message and "./scripts/bootstrap.sh" in message
    # Our b2b build (7.0.1, flagged) and the stock one are no mismatch.
    assert refusal(info("b", dataclasses.replace(PINNED_BUILD, rpc=V("7.0.1"), b2b=True)), serving) is None
    newer = refusal(worker, info("c", build("7.2.0"), serving=True))
    assert newer is not None and newer.detail.endswith("accepts only RPC 7.0 to 7.2")
    unknown = refusal(info("b", build(None)), serving)
    assert unknown is not None and "b's rpc-server answers no RPC HELLO this release reads" in unknown.detail


def test_other_weights_are_named_first():
    worker = info("b", build("6.0.0"), sha="1" * 64)
    found = refusal(worker, info("c", serving=True, sha="2" * 64))
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
        with pytest.raises(MalformedMessageError, match="llama_build.rpc_version"):
            MemberInfo.from_body({**body, "llama_build": {**body["llama_build"], "rpc_version": bad}})
    with pytest.raises(MalformedMessageError, match="llama_build.llama_cpp"):
        MemberInfo.from_body({**body, "llama_build": {**body["llama_build"], "llama_cpp": "caf\u00e9"}})


# --- with real processes: a member whose rpc-server answers HELLO with 6.0.0 -----------------


FAKE_RPC_SERVER = Path(__file__).resolve().parent / "fake_rpc_server.py"


@pytest.fixture
def other_rpc_build(tmp_path, binaries) -> Path:
    """A --llama-bin directory: the real llama-server beside an rpc-server that speaks RPC 6.0.0."""
    directory = tmp_path / "other-build"
    directory.mkdir()
    (directory / LLAMA_SERVER_BINARY).symlink_to(binaries.llama_server)
    fake = directory / RPC_SERVER_BINARY
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_RPC_SERVER}" "$@"\n')
    fake.chmod(0o755)
    return directory


def rpc_endpoints(node) -> list[str]:
    llama = next(p for p in node.status()["processes"] if p["name"] == "llama-server")
    argv = psutil.Process(llama["pid"]).cmdline()
    return argv[argv.index("--rpc") + 1].split(",")


@pytest.mark.slow
def test_a_member_of_another_rpc_version_is_left_out_and_told_why(start_node, other_rpc_build):
    serving = start_node("c", "--min-peers", "2", serve=True, wait=False)
    ticket = wait_until(lambda: TICKET_LINE.search(serving.text()), 60, "c prints its ticket").group(1)
    good = start_node("a", "--join", ticket)
    other = start_node("b", "--join", ticket, "--llama-bin", str(other_rpc_build))
    serving.wait_ready()  # llama-server's first start comes after both joined (--min-peers 2)
    serving.extra_pids = serving.child_pids()

    both_versions = ("b's rpc-server speaks RPC 6.0.0", "c's llama-server speaks RPC 7.0.")
    planned = cli("plan", "--home", str(serving.home), "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert [r["name"] for r in plan["refused"]] == ["b"] and plan["refused"][0]["reason"] == LLAMA_BUILD_MISMATCH
    assert all(part in plan["refused"][0]["detail"] for part in both_versions), plan["refused"]
    status = serving.status()
    assert [n["name"] for n in status["serving"]["plan"]["nodes"]] == ["a", "c"]
    peers = {p["name"]: p for p in status["peers"]}
    assert peers["b"]["refused"] == LLAMA_BUILD_MISMATCH and peers["a"]["refused"] is None
    assert all(part in peers["b"]["refused_detail"] for part in both_versions)
    # llama-server never gets b's tunnel; a's and c's own rpc-server are all it uses.
    endpoints = rpc_endpoints(serving)
    assert f"127.0.0.1:{peers['b']['tunnel_port']}" not in endpoints
    assert endpoints[0] == f"127.0.0.1:{peers['a']['tunnel_port']}" and len(endpoints) == 2
    assert complete(serving.serve_port)

    # b's own output and status say it was left out, and why.
    line = wait_until(lambda: next((l for l in other.text().splitlines() if l.startswith(LLAMA_BUILD_MISMATCH)),
                                   None), 30, "b says it is left out")
    assert all(part in line for part in both_versions) and "./scripts/bootstrap.sh" in line
    own = other.status()
    assert own["node"]["llama_build"].startswith("RPC 6.0.0")
    row = next(p for p in own["peers"] if p["name"] == "c")
    assert row["refused"] == LLAMA_BUILD_MISMATCH and all(part in row["refused_detail"] for part in both_versions)
    shown = cli("status", "--home", str(other.home))
    assert shown.returncode == 0 and "llama.cpp: RPC 6.0.0" in shown.stdout, shown.stdout
    assert f"c: {LLAMA_BUILD_MISMATCH}: b's rpc-server" in shown.stdout, shown.stdout
    assert good.proc.poll() is None and LLAMA_BUILD_MISMATCH not in good.text()
