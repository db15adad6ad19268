"""GGUF header parser: the same fields and tensor table as the gguf package's reader, and clear errors."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from mesh_sidecar.errors import ModelError
from mesh_sidecar.llama.model_files import read_header
from mesh_sidecar.wire.gguf_header import parse_header


def _same_as_gguf_reader(path: Path, nested: tuple[str, ...] = ()) -> None:
    """``nested``: arrays of arrays, which GGUFReader flattens and we keep as written."""
    ours, theirs = read_header(path), GGUFReader(path)
    # GGUFReader adds pseudo-fields (GGUF.version, ...) for the file's own counts.
    real = {key: field for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.fields) == list(real)
    for key, field in real.items():
        if key in nested:
            assert [x for inner in ours.fields[key] for x in inner] == field.contents(), key
        else:
            assert ours.fields[key] == field.contents(), key
    assert [(t.name, t.shape, t.ggml_type, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in theirs.tensors]


def test_default_model_reads_as_the_gguf_package_reads_it(model_path: Path) -> None:
    _same_as_gguf_reader(model_path)
    header = read_header(model_path)
    assert header.fields["general.architecture"] == "llama"
    assert len(header.fields["tokenizer.ggml.tokens"]) == 49152


def _write(path: Path, alignment: int | None = None) -> None:
    writer = GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 2.25)
    writer.add_bool("t.bool", True)
    writer.add_uint64("t.u64", 2**40)
    writer.add_string("t.str", "naïve ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("q", np.zeros((64, 96), dtype=np.float16))
    writer.add_tensor("r", np.ones((3, 5), dtype=np.float32))
    writer.add_tensor("s", np.zeros((4, 68), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)  # 2 blocks a row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_alignment(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "types.gguf"
    _write(path, alignment)
    _same_as_gguf_reader(path, nested=("t.nested",))
    header = read_header(path)
    assert header.fields["t.nested"] == [[1, 2], [3]]
    assert header.fields["t.str"] == "naïve ✓"
    assert all(t.data_offset % (alignment or 32) == 0 for t in header.tensors)


def test_truncated_header_is_a_model_error(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    _write(path)
    data = path.read_bytes()
    whole = read_header(path)
    header_end = min(t.data_offset for t in whole.tensors)
    for cut in (6, 20, header_end // 2, header_end - 40):
        with pytest.raises(ModelError, match="truncated"):
            parse_header(data[:cut], "cut.gguf")


def test_not_a_gguf_old_version_and_unknown_types(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not a GGUF"):
        parse_header(b"GGML" + bytes(60))
    with pytest.raises(ModelError, match="version 1"):
        parse_header(b"GGUF" + struct.pack("<I", 1) + bytes(60))
    key = b"k"
    bad_value = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 99)
    with pytest.raises(ModelError, match="unknown type 99"):
        parse_header(bad_value + bytes(8))
    bad_tensor = (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"t"
                  + struct.pack("<I", 1) + struct.pack("<Q", 4) + struct.pack("<IQ", 9999, 0))
    with pytest.raises(ModelError, match="ggml type 9999"):
        parse_header(bad_tensor)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelError, match="empty"):
        read_header(empty)
