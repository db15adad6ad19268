"""Speculative decoding: draft selection and the draft length (with real
processes: tests/integration/test_speculation.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import pytest

from mesh_sidecar.errors import ModelError
from mesh_sidecar.serve.speculation import check_pair, choose, find_draft, tokenizer_fingerprint


def tiny_gguf(path: Path, tokens: list[str]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_draft_with_another_vocabulary_is_refused(model_path, tmp_path):
    check_pair(model_path, model_path)
    other = tiny_gguf(tmp_path / "other.gguf", ["a", "b", "c"])
    with pytest.raises(ModelError, match="another tokenizer"):
        check_pair(model_path, other)
    same_words_other_order = tiny_gguf(tmp_path / "swapped.gguf", ["b", "a", "c"])
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(same_words_other_order)


def test_auto_picks_the_smallest_model_with_the_same_tokenizer(model_path, tmp_path):
    tiny_gguf(tmp_path / "unrelated.gguf", ["x", "y"])
    with pytest.raises(ModelError, match="nothing to pick"):
        find_draft(model_path, tmp_path)
    # A bigger "target" with the same tokenizer: the default model is then the draft.
    target = tmp_path / "target.gguf"
    shutil.copy(model_path, target)
    with open(target, "ab") as f:
        f.write(b"\0" * 4096)
    shutil.copy(model_path, tmp_path / "draft.gguf")
    assert find_draft(target, tmp_path) == tmp_path / "draft.gguf"


def test_draft_length_grows_with_the_round_trip():
    assert choose(None, None, 0).kind == "none"
    assert choose(None, 0.5, 2).kind == "none"  # fast links: plain decoding
    assert choose(Path("d.gguf"), 50.0, 2, allowed=False).kind == "none"
    ngram = choose(None, 20.0, 2)
    assert ngram.kind == "ngram" and "--spec-type" in ngram.llama_server_args()
    lengths = [choose(Path("d.gguf"), rtt, 2).draft_max for rtt in (0.5, 5.0, 20.0)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    args = choose(Path("d.gguf"), 20.0, 2).llama_server_args()
    assert args[args.index("--spec-draft-device") + 1] == "none"  # the draft stays on this node's CPU
