"""The calibration's RPC requests and replies: layouts, sizes, a graph rpc-server can build, parse errors.

The graph is read back here with the rpc_tensor offsets of ggml-rpc.cpp (the module docstring's drawing),
independently of the encoder's struct, and checked the way rpc-server checks it: every tensor inside its
buffer, every source a tensor of the message, the strides a Q8_0 or F32 tensor must have.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pytest

from mesh_sidecar.errors import MalformedMessageError, WireError
from mesh_sidecar.wire.rpc_calibration import (
    BUFFER_CLEAR_CMD,
    BUFFER_GET_BASE_CMD,
    FREE_BUFFER_CMD,
    GET_ALIGNMENT_CMD,
    GGML_OP_MUL_MAT,
    GGML_TENSOR_FLAG_COMPUTE,
    GGML_TYPE_Q8_0,
    GRAPH_COMPUTE_CMD,
    GRAPH_RECOMPUTE_CMD,
    MATRIX_INPUTS,
    MATRIX_OUTPUTS,
    MAX_PASSES,
    PREFILL_COLUMNS,
    WEIGHT_BYTES,
    WEIGHT_MATRICES,
    BufferLayout,
    RemoteBuffer,
    alloc_buffer_request,
    buffer_clear_request,
    buffer_get_base_request,
    decode_alignment,
    decode_alloc_buffer,
    decode_buffer_base,
    free_buffer_request,
    get_alignment_request,
    graph_compute_request,
    graph_recompute_request,
    reply_size,
)
from mesh_sidecar.wire.rpc_framing import ALLOC_BUFFER_CMD, RPC_HEADER, RPC_TENSOR_BYTES, RPC_TENSOR_NAME_OFFSET
from mesh_sidecar.wire.rpc_outputs import GGML_TYPE_F32

ALIGNMENT = 64
BASE = 0x7F00_0000_1000
LAYOUT = BufferLayout(ALIGNMENT)
BUFFER = RemoteBuffer(0x5555_0000_0040, LAYOUT.size_bytes, BASE)


@dataclass
class Tensor:
    """The rpc_tensor fields rpc-server reads, at ggml-rpc.cpp's packed offsets."""

    id: int
    type: int
    buffer: int
    ne: tuple[int, ...]
    nb: tuple[int, ...]
    op: int
    flags: int
    src: tuple[int, ...]
    data: int
    name: str

    @classmethod
    def parse(cls, raw: bytes) -> Tensor:
        assert len(raw) == RPC_TENSOR_BYTES
        return cls(id=struct.unpack_from("<Q", raw, 0)[0], type=struct.unpack_from("<I", raw, 8)[0],
                   buffer=struct.unpack_from("<Q", raw, 12)[0], ne=struct.unpack_from("<4I", raw, 20),
                   nb=struct.unpack_from("<4I", raw, 36), op=struct.unpack_from("<I", raw, 52)[0],
                   flags=struct.unpack_from("<i", raw, 120)[0], src=struct.unpack_from("<10Q", raw, 124),
                   data=struct.unpack_from("<Q", raw, 220)[0],
                   name=raw[RPC_TENSOR_NAME_OFFSET:RPC_TENSOR_NAME_OFFSET + 64].rstrip(b"\0").decode())

    @property
    def nbytes(self) -> int:
        return self.nb[3] * self.ne[3]


def split(request: bytes) -> tuple[int, bytes]:
    cmd, size = RPC_HEADER.unpack_from(request)
    payload = request[RPC_HEADER.size:]
    assert len(payload) == size
    return cmd, payload


def parse_graph(request: bytes) -> tuple[int, list[int], dict[int, Tensor]]:
    cmd, payload = split(request)
    assert cmd == GRAPH_COMPUTE_CMD
    device, n_nodes = struct.unpack_from("<II", payload)
    nodes = list(struct.unpack_from(f"<{n_nodes}Q", payload, 8))
    (n_tensors,) = struct.unpack_from("<I", payload, 8 + 8 * n_nodes)
    start = 12 + 8 * n_nodes
    assert len(payload) == start + n_tensors * RPC_TENSOR_BYTES
    tensors = [Tensor.parse(payload[start + i * RPC_TENSOR_BYTES:start + (i + 1) * RPC_TENSOR_BYTES])
               for i in range(n_tensors)]
    by_id = {t.id: t for t in tensors}
    assert len(by_id) == n_tensors and 0 not in by_id  # ids unique; 0 means "no tensor"
    return device, nodes, by_id


# --- requests ---------------------------------------------------------------------------


def test_small_requests_have_upstream_layouts() -> None:
    assert split(get_alignment_request(2)) == (GET_ALIGNMENT_CMD, struct.pack("<I", 2))
    assert split(alloc_buffer_request(1, 5 << 30)) == (ALLOC_BUFFER_CMD, struct.pack("<IQ", 1, 5 << 30))
    assert split(buffer_get_base_request(0xABC)) == (BUFFER_GET_BASE_CMD, struct.pack("<Q", 0xABC))
    assert split(buffer_clear_request(0xABC)) == (BUFFER_CLEAR_CMD, struct.pack("<QB", 0xABC, 0))
    assert split(free_buffer_request(0xABC)) == (FREE_BUFFER_CMD, struct.pack("<Q", 0xABC))
    assert split(graph_recompute_request(3)) == (GRAPH_RECOMPUTE_CMD, struct.pack("<I", 3))
    assert get_alignment_request(0) == bytes([1]) + (4).to_bytes(8, "little") + bytes(4)


@pytest.mark.parametrize("alignment", [1, 32, 64, 4096])
def test_the_buffer_layout_is_aligned_and_nothing_overlaps(alignment: int) -> None:
    layout = BufferLayout(alignment)
    offsets = [layout.weight_offset(i) for i in range(WEIGHT_MATRICES)] + [layout.input_offset, layout.output_offset]
    assert all(offset % alignment == 0 for offset in offsets)
    ends = [layout.weight_offset(i) + WEIGHT_BYTES for i in range(WEIGHT_MATRICES)]
    ends += [layout.input_offset + MATRIX_INPUTS * PREFILL_COLUMNS * 4, layout.size_bytes]
    assert all(end <= start for end, start in zip(ends, offsets[1:], strict=False))
    assert layout.size_bytes == layout.output_offset + MATRIX_OUTPUTS * PREFILL_COLUMNS * 4
    assert WEIGHT_BYTES == 4096 * 4096 // 32 * 34  # Q8_0: 34 bytes a block of 32
    assert WEIGHT_MATRICES * WEIGHT_BYTES > 100 * 2**20  # more than the caches it must miss


@pytest.mark.parametrize(("columns", "passes"), [(1, 1), (1, 8), (PREFILL_COLUMNS, 3), (PREFILL_COLUMNS, MAX_PASSES)])
def test_the_graph_is_one_rpc_server_can_build(columns: int, passes: int) -> None:
    request = graph_compute_request(1, BUFFER, LAYOUT, columns, passes)
    device, nodes, tensors = parse_graph(request)
    assert device == 1 and len(nodes) == passes
    assert len(request) == 9 + 12 + 8 * passes + (WEIGHT_MATRICES + 1 + passes) * RPC_TENSOR_BYTES
    for tensor in tensors.values():
        # rpc-server's deserialize_tensor asserts this; and the buffer field must be the buffer it named.
        assert tensor.buffer == BUFFER.remote_ptr
        assert BASE <= tensor.data <= BASE + BUFFER.size_bytes - tensor.nbytes
        assert (tensor.data - BASE) % ALIGNMENT == 0
        assert tensor.ne[2:] == (1, 1) and tensor.nb[2] == tensor.nb[1] * tensor.ne[1] == tensor.nb[3]
        assert all(src == 0 or src in tensors for src in tensor.src)
    for i, node_id in enumerate(nodes):
        node = tensors[node_id]
        weight, source = tensors[node.src[0]], tensors[node.src[1]]
        assert node.op == GGML_OP_MUL_MAT and node.flags & GGML_TENSOR_FLAG_COMPUTE and node.src[2:] == (0,) * 8
        assert node.type == GGML_TYPE_F32 and node.ne[:2] == (MATRIX_OUTPUTS, columns)
        assert node.nb[:2] == (4, MATRIX_OUTPUTS * 4) and node.data == BASE + LAYOUT.output_offset
        # ggml's MUL_MAT: the weight's rows are the input's length, the output has the weight's row count.
        assert weight.type == GGML_TYPE_Q8_0 and weight.ne[:2] == (MATRIX_INPUTS, MATRIX_OUTPUTS)
        assert weight.nb[:2] == (34, MATRIX_INPUTS // 32 * 34) and weight.data == BASE + LAYOUT.weight_offset(
            i % WEIGHT_MATRICES)
        assert source.type == GGML_TYPE_F32 and source.ne[:2] == (MATRIX_INPUTS, columns)
        assert source.nb[:2] == (4, MATRIX_INPUTS * 4) and source.data == BASE + LAYOUT.input_offset
        assert weight.op == source.op == 0 and weight.flags == source.flags == 0  # leaves
    assert len({tensors[n].src[0] for n in nodes}) == min(passes, WEIGHT_MATRICES)  # passes spread over weights
    assert all(t.name.startswith("calibration.") for t in tensors.values())


@pytest.mark.parametrize(("columns", "passes"), [(0, 1), (PREFILL_COLUMNS + 1, 1), (1, 0), (1, MAX_PASSES + 1)])
def test_a_graph_out_of_bounds_is_refused(columns: int, passes: int) -> None:
    with pytest.raises(ValueError):
        graph_compute_request(0, BUFFER, LAYOUT, columns, passes)


# --- replies ----------------------------------------------------------------------------


def test_replies_decode() -> None:
    assert reply_size((16).to_bytes(8, "little"), 16, "ALLOC_BUFFER") == 16
    assert decode_alignment(struct.pack("<Q", 32)) == 32
    assert decode_alloc_buffer(struct.pack("<QQ", 0xABC, 1 << 20)) == RemoteBuffer(0xABC, 1 << 20)
    assert decode_alloc_buffer(bytes(16)).remote_ptr == 0  # no room: the caller gives up, no error
    assert decode_buffer_base(struct.pack("<Q", BASE)) == BASE


@pytest.mark.parametrize(("decode", "payload"), [
    (lambda p: reply_size(p, 8, "GET_ALIGNMENT"), (16).to_bytes(8, "little")),  # another reply's size
    (lambda p: reply_size(p, 8, "GET_ALIGNMENT"), b"\xff" * 8),
    (decode_alignment, struct.pack("<Q", 0)),
    (decode_alignment, struct.pack("<Q", 48)),  # not a power of two
    (decode_alignment, struct.pack("<I", 32)),  # short
    (decode_alloc_buffer, struct.pack("<Q", 1)),
    (decode_alloc_buffer, bytes(17)),
    (decode_buffer_base, bytes(8)),  # base 0
    (decode_buffer_base, bytes(9)),
])
def test_bad_replies_are_malformed_messages(decode, payload: bytes) -> None:
    with pytest.raises(MalformedMessageError) as caught:
        decode(payload)
    assert isinstance(caught.value, WireError)
