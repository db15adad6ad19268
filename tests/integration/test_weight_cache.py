"""The weight-cache helper (compiled on first use, run as a process), seeding, and our rpc-server's read-only
cache; zero-byte loads with real processes are in test_zero_byte_load."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from pathlib import Path

import pytest

from mesh_sidecar.llama import weight_cache
from mesh_sidecar.llama.weight_cache import HASH_THRESHOLD_BYTES, WeightCache, _Ledger, hashed_tensor_ranges
from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.wire.rpc_calibration import (
    ALLOC_BUFFER_REPLY_BYTES,
    BUFFER_BASE_REPLY_BYTES,
    RemoteBuffer,
    _tensor,
    alloc_buffer_request,
    buffer_get_base_request,
    decode_alloc_buffer,
    decode_buffer_base,
)
from mesh_sidecar.wire.rpc_framing import GET_TENSOR_CMD, REPLY_SIZE, RPC_HEADER, SET_TENSOR_CMD
from mesh_sidecar.wire.rpc_hello import HELLO_REQUEST, hello_reply_size
from mesh_sidecar.wire.rpc_outputs import GGML_TYPE_F32
from tests.helpers.llama import start_bare_rpc_server

SET_TENSOR_HASH_CMD = 7  # upstream 7.x: rpc_tensor | offset u64 | hash u64; reply u8 (1: set from the cache)


def no_progress(message: str, done: int, total: int) -> None:
    pass


@pytest.fixture(scope="module")
def tool():
    return weight_cache.ensure_tool(no_progress)


def fnv1a_64(data: bytes) -> int:
    """The reference, byte by byte (only for small inputs)."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def test_seed_names_files_by_llama_cpp_fnv1a_and_gives_their_sha256(tool, tmp_path):
    model = tmp_path / "blob.bin"
    payload = bytes(range(256)) * 700 + b"tail"
    model.write_bytes(b"HEAD" + payload + b"more")
    out = tmp_path / "out"
    out.mkdir()
    (line,) = weight_cache._run_tool(tool, "seed", str(model), str(out), f"4:{len(payload)}")
    name, size, sha256 = line.split()
    assert int(name, 16) == fnv1a_64(payload) and int(size) == len(payload)
    assert sha256 == hashlib.sha256(payload).hexdigest()
    assert fnv1a_64(b"a") == 0xAF63DC4C8601EC8C  # the published FNV-1a 64 test vector
    assert (out / name).read_bytes() == payload
    assert [p.name for p in out.iterdir()] == [name]  # its temporary file renamed


def test_seed_once_per_model_then_only_what_is_missing(tool, model_path, tmp_path):
    cache = WeightCache(tmp_path / "cache")
    sha = "ab" * 32
    written = weight_cache.seed(cache, tool, model_path, sha, no_progress)
    assert written == sum(size for _, _, size in hashed_tensor_ranges(model_path))
    (seeded,) = cache.tensor_files()
    assert _Ledger.read(cache).tensors[seeded.name].sha256 == hashlib.sha256(seeded.read_bytes()).hexdigest()
    assert weight_cache.seed(cache, tool, model_path, sha, no_progress) == 0
    assert weight_cache.verify(cache, no_progress) == 0  # seeded files count as checked
    # Altered in place: verify removes it, and the next seeding puts the model's bytes back.
    with open(seeded, "r+b") as f:
        f.write(b"\xff" * 16)
    os.utime(seeded, ns=(seeded.stat().st_atime_ns, seeded.stat().st_mtime_ns + 1_000_000_000))
    assert weight_cache.verify(cache, no_progress) == 1 and not seeded.exists()
    assert weight_cache.seed(cache, tool, model_path, sha, no_progress) == written
    assert weight_cache.verify(cache, no_progress) == 0 and seeded.exists()
    assert not (cache.root / weight_cache.STAGING_DIR_NAME).exists()


class RpcClient:
    """Just enough of llama.cpp's RPC client to write tensors into one rpc-server buffer, as any member's could."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(HELLO_REQUEST)
        self.read(hello_reply_size(self.read(REPLY_SIZE.size)))

    def read(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, "rpc-server closed the connection"
            data += chunk
        return bytes(data)

    def ask(self, request: bytes, reply_bytes: int) -> bytes:
        self.sock.sendall(request)
        (size,) = REPLY_SIZE.unpack(self.read(REPLY_SIZE.size))
        assert size == reply_bytes
        return self.read(size)

    def buffer(self, size: int) -> RemoteBuffer:
        buffer = decode_alloc_buffer(self.ask(alloc_buffer_request(0, size), ALLOC_BUFFER_REPLY_BYTES))
        assert buffer.remote_ptr
        base = decode_buffer_base(self.ask(buffer_get_base_request(buffer.remote_ptr), BUFFER_BASE_REPLY_BYTES))
        return RemoteBuffer(buffer.remote_ptr, buffer.size_bytes, base)

    def set_by_hash(self, tensor: bytes, name: str) -> bool:
        """SET_TENSOR_HASH at offset 0 with the FNV-1a ``name``: whether the server had a file for it."""
        request = tensor + struct.pack("<QQ", 0, int(name, 16))
        return self.ask(RPC_HEADER.pack(SET_TENSOR_HASH_CMD, len(request)) + request, 1) == b"\x01"


def f32_tensor(buffer: RemoteBuffer, offset: int, n_bytes: int) -> bytes:
    return _tensor(1, GGML_TYPE_F32, buffer, offset, (n_bytes // 4, 1), n_bytes, 4, "weights")


def get_tensor_request(tensor: bytes, size: int) -> bytes:
    payload = tensor + struct.pack("<QQ", 0, size)  # offset u64 | size u64
    return RPC_HEADER.pack(GET_TENSOR_CMD, len(payload)) + payload


def seed_bytes(tool, data: bytes, source: Path, into: Path) -> str:
    """``data``, written to ``source``, seeded by the tool into ``into``; its FNV-1a name."""
    source.write_bytes(data)
    into.mkdir(exist_ok=True)
    (line,) = weight_cache._run_tool(tool, "seed", str(source), str(into), f"0:{len(data)}")
    return line.split()[0]


@pytest.mark.slow
def test_rpc_server_serves_seeded_tensors_and_saves_none_from_the_network(binaries, tool, tmp_path):
    size = HASH_THRESHOLD_BYTES + 4096  # what llama.cpp's client sends by hash, asking the server to keep it
    cache = WeightCache(tmp_path / "cache")
    cache.create()
    seeded_bytes, sent_bytes = os.urandom(size), os.urandom(size)
    seeded_name = seed_bytes(tool, seeded_bytes, tmp_path / "seeded.bin", cache.tensors)
    sent_name = seed_bytes(tool, sent_bytes, tmp_path / "sent.bin", tmp_path / "elsewhere")
    port = free_tcp_port()
    server = start_bare_rpc_server(binaries, port, tmp_path / "rpc-server.log", env=cache.environment(),
                                   args=["-c"])
    try:
        client = RpcClient(port)
        buffer = client.buffer(2 * size)
        sent, served = f32_tensor(buffer, 0, size), f32_tensor(buffer, size, size)
        # SET_TENSOR with cache_flag 1, as llama.cpp's client sends a weight the server had no file for.
        payload = sent + b"\x01" + struct.pack("<Q", 0) + sent_bytes
        client.sock.sendall(RPC_HEADER.pack(SET_TENSOR_CMD, len(payload)) + payload)
        assert client.ask(get_tensor_request(sent, size), size) == sent_bytes  # applied (upstream: saved too)
        assert [p.name for p in cache.tensors.iterdir()] == [seeded_name]
        assert not client.set_by_hash(served, sent_name)
        assert client.set_by_hash(served, seeded_name)
        assert client.ask(get_tensor_request(served, size), size) == seeded_bytes
    finally:
        server.terminate()
        server.wait(10)
