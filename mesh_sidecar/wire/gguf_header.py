"""A GGUF file's header: its metadata and tensor table, read without touching the weights.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata
array, so a model with a 49k-token vocabulary takes about two seconds to open,
and a node opened its model several times on every start (estimate, weight
cache, draft check). The header is small and its format simple
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md); this parser walks
it once in plain ``struct`` calls. It is pure over a buffer (``parse_header``);
``llama.gguf_file.read_header`` maps the file and hands it over.

Only little-endian GGUF version 2 and 3 files are read: what llama.cpp writes
(version 1 is long gone; big-endian files are made on request for s390x).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ModelError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
ALIGNMENT_KEY = "general.alignment"
DEFAULT_ALIGNMENT = 32


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Keyed by int, as the file stores the type (a ValueType is one).
_SCALAR_FORMATS: dict[int, str] = {
    ValueType.UINT8: "B", ValueType.INT8: "b", ValueType.UINT16: "H", ValueType.INT16: "h",
    ValueType.UINT32: "I", ValueType.INT32: "i", ValueType.FLOAT32: "f", ValueType.BOOL: "?",
    ValueType.UINT64: "Q", ValueType.INT64: "q", ValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] first
    ggml_type: int
    data_offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    fields: dict[str, Any]  # scalars as int/float/bool/str, arrays as lists
    tensors: tuple[TensorInfo, ...]


HeaderBuffer = bytes | memoryview
"""What a header is parsed from: the file's bytes, or a view of the file mapped."""


class _Cursor:
    """Little-endian reads from a buffer; ModelError (via ``_Truncated``) past its end."""

    def __init__(self, buf: HeaderBuffer) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def unpack_many(self, fmt: str, count: int) -> list[Any]:
        size = struct.calcsize("<" + fmt) * count
        if self.pos + size > len(self.buf):
            raise _Truncated
        values = list(struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos))
        self.pos += size
        return values

    def string(self) -> str:
        length = self.unpack("Q")
        if self.pos + length > len(self.buf):
            raise _Truncated
        # surrogateescape: a token that is not valid UTF-8 keeps its bytes.
        text = bytes(self.buf[self.pos:self.pos + length]).decode("utf-8", "surrogateescape")
        self.pos += length
        return text

    def value(self, kind: int) -> Any:
        if kind == ValueType.STRING:
            return self.string()
        if kind == ValueType.ARRAY:
            item_kind, count = self.unpack("I"), self.unpack("Q")
            if item_kind in _SCALAR_FORMATS:
                return self.unpack_many(_SCALAR_FORMATS[item_kind], count)
            return [self.value(item_kind) for _ in range(count)]
        if kind in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[kind])
        raise _BadValueType(kind)


class _Truncated(Exception):
    pass


class _BadValueType(Exception):
    pass


def parse_header(buf: HeaderBuffer, source: str = "the GGUF") -> GGUFHeader:
    """The header at the start of ``buf`` (bytes, or a view of the mapped file); ModelError if it is not one."""
    if bytes(buf[:len(GGUF_MAGIC)]) != GGUF_MAGIC:
        raise ModelError(f"{source} does not start with the GGUF magic: it is not a GGUF file.")
    cursor = _Cursor(buf)
    cursor.pos = len(GGUF_MAGIC)
    try:
        version = cursor.unpack("I")
        if version not in SUPPORTED_VERSIONS:
            raise ModelError(f"{source} is GGUF version {version}; only versions 2 and 3 (little-endian) "
                             "can be read. Convert it again with a current llama.cpp.")
        n_tensors, n_fields = cursor.unpack("Q"), cursor.unpack("Q")
        fields = {}
        for _ in range(n_fields):
            key = cursor.string()
            fields[key] = cursor.value(cursor.unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            n_dims = cursor.unpack("I")
            shape = tuple(cursor.unpack_many("Q", n_dims))
            infos.append((name, shape, cursor.unpack("I"), cursor.unpack("Q")))
    except _Truncated:
        raise ModelError(f"{source} ends inside its GGUF header: the file is truncated; download it again.") from None
    except _BadValueType as exc:
        raise ModelError(f"{source} has a metadata value of unknown type {exc.args[0]}: "
                         "the file is corrupt or from a newer GGUF version.") from None
    alignment = fields.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    return GGUFHeader(version, fields, tuple(_tensor(source, *info, data_start) for info in infos))


def _tensor(source: str, name: str, shape: tuple[int, ...], ggml_type: int, offset: int,
            data_start: int) -> TensorInfo:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelError(f"{source}: tensor {name} has ggml type {ggml_type}, which this version does not "
                         "know; update mesh-inference (and its gguf package).") from None
    elements = 1
    for dim in shape:
        elements *= dim
    return TensorInfo(name, shape, ggml_type, data_start + offset, elements // block_size * type_size)
