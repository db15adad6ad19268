"""A speed calibration as a client speaks it to an rpc-server: the requests, and the replies they get.

A node measures each device its own rpc-server offers once, right after starting it (rpc-server
serves one client at a time: nobody else is connected yet). The work is what a token asks of a
device: matrix products over quantized weights that stream from its memory. Nothing is uploaded:
one buffer holds every tensor and is cleared to zeros, which cost the same to multiply as weights.

One buffer on the device, each part at an aligned offset (GET_ALIGNMENT)::

    +----------+----------+-- - --+----------+----------------------+----------------------+
    | weight 0 | weight 1 |  ...  | weight 7 | input: f32 x columns | output: f32 x columns|
    +----------+----------+-- - --+----------+----------------------+----------------------+
     Q8_0 4096 x 4096 each (17 MiB; 136 MiB in all: more than a GPU's L2 or most CPUs' L3 holds, so
     the passes read memory, as a model's layers do). The input and output have room for
     PREFILL_COLUMNS columns; a decode graph uses the first column only.

The graph: ``passes`` MUL_MAT nodes, pass i over weight ``i % WEIGHT_MATRICES``, all reading the
one input and writing the one output area (distinct ids: rpc-server counts uses per id)::

    weight 0 --\\                weight 1 --\\                      weight (n-1) % 8 --\\
                MUL_MAT -> out 0             MUL_MAT -> out 1  ...                     MUL_MAT -> out n-1
    input -----/                input ------/                      input -------------/

GRAPH_COMPUTE payload (cmd 10; rpc-server builds the graph, runs it, keeps it for GRAPH_RECOMPUTE)::

    0            4             8                  8+8n            12+8n
    +------------+-------------+------------------+---------------+------------------------------+
    | device u32 | n_nodes u32 | node ids u64[n]  | n_tensors u32 | rpc_tensor[n_tensors]        |
    +------------+-------------+------------------+---------------+------------------------------+

rpc_tensor (296 bytes, packed, little-endian; ggml-rpc.cpp ``struct rpc_tensor``)::

    0       8         12          20         36         52      56               120       124
    | id u64 | type u32 | buffer u64 | ne u32[4] | nb u32[4] | op u32 | op_params[64] | flags i32 |
    124              204           212            220       228          292             296
    | src u64[10]    | view_src u64 | view_offs u64 | data u64 | name[64]   | use_count i32 |

``buffer`` is the remote buffer as ALLOC_BUFFER named it, ``data`` an address inside it (its base
from BUFFER_GET_BASE plus the offset): rpc-server asserts that a tensor lies within its buffer,
and a graph it cannot compute aborts it (GGML_ASSERT), so every tensor here is consistent (ne, nb,
sources, sizes, the COMPUTE flag without which a backend skips a node; checked against the CPU backend).

Timing (the caller's): GRAPH_RECOMPUTE (cmd 16, no reply) re-runs the stored graph; a GET_ALIGNMENT
sent right behind it answers only once it is done, so the pair's round trip is the graph's time
plus one loopback round trip, which enough passes make small. The other commands and replies are in
RPC_NOTES' table; replies are ``size u64 | payload``. Pure: bytes in, values or WireErrors out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import MalformedMessageError
from .rpc_framing import ALLOC_BUFFER_CMD, REPLY_SIZE, REPLY_SIZE_BYTES, RPC_HEADER, RPC_TENSOR_BYTES
from .rpc_outputs import GGML_TYPE_F32

# Upstream 7.x command numbers (ggml-rpc.cpp, enum rpc_cmd); rpc_framing.py names the others.
GET_ALIGNMENT_CMD = 1
BUFFER_GET_BASE_CMD = 3
FREE_BUFFER_CMD = 4
BUFFER_CLEAR_CMD = 5
GRAPH_COMPUTE_CMD = 10
GRAPH_RECOMPUTE_CMD = 16
# The RPC major whose command numbers these are (the 7.x protocol also freezes ggml's op numbers:
# ggml-rpc.cpp static_asserts GGML_OP_COUNT for each patch version).
CALIBRATION_RPC_MAJOR = 7

# ggml's values, from the pinned ggml/include/ggml.h and ggml/src/ggml-common.h.
GGML_TYPE_Q8_0 = 8  # enum ggml_type
GGML_OP_MUL_MAT = 29  # enum ggml_op
GGML_TENSOR_FLAG_COMPUTE = 16  # enum ggml_tensor_flag: backends skip a node without it
GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS_BYTES = 64
GGML_MAX_NAME_BYTES = 64
Q8_0_BLOCK_VALUES = 32  # QK8_0
Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK_VALUES  # block_q8_0: an f16 scale, then one int8 per value
F32_BYTES = 4

# The work: a 7B-class layer's square projection, quantized as people commonly run them.
MATRIX_INPUTS = 4096  # ne0 of a weight: a multiple of Q8_0_BLOCK_VALUES
MATRIX_OUTPUTS = 4096  # ne1 of a weight
WEIGHT_MATRICES = 8
WEIGHT_ROW_BYTES = MATRIX_INPUTS // Q8_0_BLOCK_VALUES * Q8_0_BLOCK_BYTES
WEIGHT_BYTES = WEIGHT_ROW_BYTES * MATRIX_OUTPUTS  # one pass reads this much
DECODE_COLUMNS = 1  # one token
PREFILL_COLUMNS = 64  # a batch of prompt tokens
MAX_PASSES = 256  # nodes in one graph: enough to make a fast GPU's round trip small

ALIGNMENT_REPLY_BYTES = 8  # u64
ALLOC_BUFFER_REPLY_BYTES = 16  # remote_ptr u64 | remote_size u64
BUFFER_BASE_REPLY_BYTES = 8  # u64

_DEVICE = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ALLOC_BUFFER = struct.Struct("<IQ")  # device u32 | size u64
_ALLOC_REPLY = struct.Struct("<QQ")
_BUFFER_CLEAR = struct.Struct("<QB")  # remote_ptr u64 | value u8
_GRAPH_HEAD = struct.Struct("<II")  # device u32 | n_nodes u32
_RPC_TENSOR = struct.Struct(
    f"<QIQ{GGML_MAX_DIMS}I{GGML_MAX_DIMS}II{GGML_MAX_OP_PARAMS_BYTES}si{GGML_MAX_SRC}QQQQ{GGML_MAX_NAME_BYTES}si")
assert _RPC_TENSOR.size == RPC_TENSOR_BYTES
# Tensor ids within one graph message: weights 1..8, the input next, then one per node.
_INPUT_ID = WEIGHT_MATRICES + 1
_FIRST_NODE_ID = WEIGHT_MATRICES + 2


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """Where each tensor sits in the calibration's one buffer, for a device's alignment."""

    alignment: int
    """The device's buffer alignment (GET_ALIGNMENT), a power of two."""

    def _aligned(self, offset: int) -> int:
        return -(-offset // self.alignment) * self.alignment

    def weight_offset(self, index: int) -> int:
        """Weight ``index``'s offset in the buffer."""
        return index * self._aligned(WEIGHT_BYTES)

    @property
    def input_offset(self) -> int:
        return self.weight_offset(WEIGHT_MATRICES)

    @property
    def output_offset(self) -> int:
        return self.input_offset + self._aligned(MATRIX_INPUTS * PREFILL_COLUMNS * F32_BYTES)

    @property
    def size_bytes(self) -> int:
        """What to ALLOC_BUFFER."""
        return self.output_offset + MATRIX_OUTPUTS * PREFILL_COLUMNS * F32_BYTES


@dataclass(frozen=True, slots=True)
class RemoteBuffer:
    """A buffer rpc-server allocated for us."""

    remote_ptr: int
    """Its handle, as ALLOC_BUFFER named it (0: the device had no room)."""
    size_bytes: int
    """Its size, as ALLOC_BUFFER said."""
    base: int = 0
    """Its data's address on the server (BUFFER_GET_BASE)."""


def _request(cmd: int, payload: bytes) -> bytes:
    return RPC_HEADER.pack(cmd, len(payload)) + payload


def get_alignment_request(device: int) -> bytes:
    """GET_ALIGNMENT of ``device``; the calibration also sends it as a sync point (its reply waits)."""
    return _request(GET_ALIGNMENT_CMD, _DEVICE.pack(device))


def alloc_buffer_request(device: int, size_bytes: int) -> bytes:
    return _request(ALLOC_BUFFER_CMD, _ALLOC_BUFFER.pack(device, size_bytes))


def buffer_get_base_request(remote_ptr: int) -> bytes:
    return _request(BUFFER_GET_BASE_CMD, _U64.pack(remote_ptr))


def buffer_clear_request(remote_ptr: int) -> bytes:
    """Set every byte of the buffer to zero (no reply)."""
    return _request(BUFFER_CLEAR_CMD, _BUFFER_CLEAR.pack(remote_ptr, 0))


def free_buffer_request(remote_ptr: int) -> bytes:
    """Free the buffer (no reply in 7.x); rpc-server also frees it when the connection closes."""
    return _request(FREE_BUFFER_CMD, _U64.pack(remote_ptr))


def graph_recompute_request(device: int) -> bytes:
    """Run ``device``'s stored graph again (no reply)."""
    return _request(GRAPH_RECOMPUTE_CMD, _DEVICE.pack(device))


def _tensor(tensor_id: int, ggml_type: int, buffer: RemoteBuffer, offset: int, ne: tuple[int, int],
            row_bytes: int, element_bytes: int, name: str, op: int = 0, src: tuple[int, ...] = ()) -> bytes:
    """One 2-D rpc_tensor (ne2 = ne3 = 1) of contiguous rows in ``buffer`` at ``offset``; a node with ``op``."""
    nb = (element_bytes, row_bytes, row_bytes * ne[1], row_bytes * ne[1])
    flags = GGML_TENSOR_FLAG_COMPUTE if op else 0
    return _RPC_TENSOR.pack(tensor_id, ggml_type, buffer.remote_ptr, ne[0], ne[1], 1, 1, *nb, op, b"", flags,
                            *src, *(0,) * (GGML_MAX_SRC - len(src)), 0, 0, buffer.base + offset,
                            name.encode(), 0)


def graph_compute_request(device: int, buffer: RemoteBuffer, layout: BufferLayout, columns: int,
                          passes: int) -> bytes:
    """GRAPH_COMPUTE of ``passes`` MUL_MAT nodes over an input of ``columns`` (the module docstring's graph)."""
    if not 1 <= columns <= PREFILL_COLUMNS or not 1 <= passes <= MAX_PASSES:
        raise ValueError(f"{columns} columns and {passes} passes: at most {PREFILL_COLUMNS} and {MAX_PASSES}")
    weights = [_tensor(1 + i, GGML_TYPE_Q8_0, buffer, layout.weight_offset(i), (MATRIX_INPUTS, MATRIX_OUTPUTS),
                       WEIGHT_ROW_BYTES, Q8_0_BLOCK_BYTES, f"calibration.w{i}") for i in range(WEIGHT_MATRICES)]
    source = _tensor(_INPUT_ID, GGML_TYPE_F32, buffer, layout.input_offset, (MATRIX_INPUTS, columns),
                     MATRIX_INPUTS * F32_BYTES, F32_BYTES, "calibration.in")
    node_ids = [_FIRST_NODE_ID + i for i in range(passes)]
    nodes = [_tensor(node_id, GGML_TYPE_F32, buffer, layout.output_offset, (MATRIX_OUTPUTS, columns),
                     MATRIX_OUTPUTS * F32_BYTES, F32_BYTES, f"calibration.out{i}", GGML_OP_MUL_MAT,
                     (1 + i % WEIGHT_MATRICES, _INPUT_ID)) for i, node_id in enumerate(node_ids)]
    tensors = weights + [source] + nodes
    payload = b"".join((_GRAPH_HEAD.pack(device, passes), *map(_U64.pack, node_ids), _DEVICE.pack(len(tensors)),
                        *tensors))
    return _request(GRAPH_COMPUTE_CMD, payload)


def reply_size(size_field: bytes, expected: int, what: str) -> int:
    """A reply's payload size from its first 8 bytes; MalformedMessageError unless it is ``expected``."""
    (size,) = REPLY_SIZE.unpack(size_field[:REPLY_SIZE_BYTES])
    if size != expected:
        raise MalformedMessageError(f"the rpc-server's {what} reply has {size} bytes, not {expected}")
    return int(size)


def decode_alignment(payload: bytes) -> int:
    """GET_ALIGNMENT's reply: a power of two."""
    alignment = _u64(payload, "GET_ALIGNMENT")
    if alignment < 1 or alignment & (alignment - 1):
        raise MalformedMessageError(f"the rpc-server's alignment {alignment} is not a power of two")
    return alignment


def decode_alloc_buffer(payload: bytes) -> RemoteBuffer:
    """ALLOC_BUFFER's reply; ``remote_ptr`` 0 when the device had no room."""
    if len(payload) != ALLOC_BUFFER_REPLY_BYTES:
        raise MalformedMessageError(f"an ALLOC_BUFFER reply of {len(payload)} bytes, not {ALLOC_BUFFER_REPLY_BYTES}")
    remote_ptr, size_bytes = _ALLOC_REPLY.unpack(payload)
    return RemoteBuffer(remote_ptr, size_bytes)


def decode_buffer_base(payload: bytes) -> int:
    """BUFFER_GET_BASE's reply: the buffer's data address, never 0."""
    base = _u64(payload, "BUFFER_GET_BASE")
    if not base:
        raise MalformedMessageError("the rpc-server gave a buffer whose base address is 0")
    return base


def _u64(payload: bytes, what: str) -> int:
    if len(payload) != _U64.size:
        raise MalformedMessageError(f"a {what} reply of {len(payload)} bytes, not {_U64.size}")
    return int(_U64.unpack(payload)[0])
