"""hf: model names and the files they choose (llama/hub_models.py's pure part): no hub, no files."""

from __future__ import annotations

import pytest

from mesh_sidecar.errors import ModelError, UsageError
from mesh_sidecar.llama.hub_models import (
    HubModelName,
    choose_files,
    hub_name_of,
    parse_model_name,
    quant_of,
    repo_quants,
    transfer_note,
)

REPO = "bartowski/SmolLM2-135M-Instruct-GGUF"
QUANTS = [f"SmolLM2-135M-Instruct-{q}.gguf" for q in ("Q2_K", "Q4_K", "Q4_K_M", "q8_0", "IQ2_XXS", "f16")]


@pytest.mark.parametrize("text, name", [
    (f"hf:{REPO}", HubModelName(REPO)),
    (f"hf:{REPO}:Q8_0", HubModelName(REPO, quant="Q8_0")),
    (f"hf:{REPO}:UD-Q4_K_XL", HubModelName(REPO, quant="UD-Q4_K_XL")),
    (f"hf:{REPO}/SmolLM2.Q4_K_M.gguf", HubModelName(REPO, file="SmolLM2.Q4_K_M.gguf")),
    (f"hf:{REPO}/Q4_K_M/a-00001-of-00002.gguf", HubModelName(REPO, file="Q4_K_M/a-00001-of-00002.gguf")),
])
def test_names_parse_and_print_back(text, name):
    assert parse_model_name(text) == name
    assert str(name) == text


@pytest.mark.parametrize("text", ["model.gguf", "/models/hf:x.gguf", "HF_model.gguf"])
def test_a_path_is_no_hub_name(text):
    assert parse_model_name(text) is None


@pytest.mark.parametrize("text", ["hf:", "hf:user", "hf:/repo", "hf:user/", "hf:user/repo:", "hf:us er/repo",
                                  "hf:user/repo/model.bin", "hf:user/repo/../x.gguf", "hf:user/repo:Q4 K",
                                  "hf:user/repo//x.gguf"])
def test_malformed_hub_names_say_how_to_write_one(text):
    with pytest.raises(UsageError, match="hf:USER/REPO"):
        parse_model_name(text)


def test_the_default_quant_is_q4_k_m():
    choice = choose_files(HubModelName(REPO), QUANTS)
    assert choice.model_files == ("SmolLM2-135M-Instruct-Q4_K_M.gguf",) and choice.quant == "Q4_K_M"
    assert choice.projector is None


def test_without_q4_k_m_the_default_is_q8_0_then_the_first_gguf():
    without = [f for f in QUANTS if "Q4_K_M" not in f]
    assert choose_files(HubModelName(REPO), without).model_files == ("SmolLM2-135M-Instruct-q8_0.gguf",)
    assert choose_files(HubModelName(REPO), ["b-Q3_K_S.gguf", "a-Q5_K_M.gguf"]).model_files == ("a-Q5_K_M.gguf",)


def test_a_quant_matches_case_insensitively_and_whole():
    assert choose_files(HubModelName(REPO, "Q8_0"), QUANTS).model_files == ("SmolLM2-135M-Instruct-q8_0.gguf",)
    assert choose_files(HubModelName(REPO, "q4_k"), QUANTS).model_files == ("SmolLM2-135M-Instruct-Q4_K.gguf",)
    assert choose_files(HubModelName(REPO, "F16"), QUANTS).quant == "f16"


def test_a_missing_quant_lists_the_quants_the_repo_has():
    with pytest.raises(ModelError) as caught:
        choose_files(HubModelName(REPO, "Q6_K"), [*QUANTS, "mmproj-f16.gguf", "README.md"])
    message = str(caught.value)
    assert "no Q6_K quant" in message
    assert "f16, IQ2_XXS, Q2_K, Q4_K, Q4_K_M, q8_0." in message and "mmproj" not in message


def test_a_split_set_is_chosen_whole_by_its_first_shard():
    files = [*(f"Q4_K_M/big-Q4_K_M-0000{n}-of-00003.gguf" for n in (3, 1, 2)), "big-Q8_0.gguf"]
    choice = choose_files(HubModelName("u/big"), files)
    assert choice.model_files == tuple(f"Q4_K_M/big-Q4_K_M-0000{n}-of-00003.gguf" for n in (1, 2, 3))
    assert repo_quants(files) == ["Q4_K_M", "Q8_0"]


def test_a_split_set_missing_a_shard_is_refused():
    with pytest.raises(ModelError, match="2 of the 3 shards"):
        choose_files(HubModelName("u/big"), ["big-Q4_K_M-00001-of-00003.gguf", "big-Q4_K_M-00003-of-00003.gguf"])


def test_a_named_file_is_taken_as_named_and_a_shard_means_its_set():
    files = ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf", "x.gguf"]
    assert choose_files(HubModelName("u/r", file="x.gguf"), files).model_files == ("x.gguf",)
    assert choose_files(HubModelName("u/r", file="m-00002-of-00002.gguf"), files).model_files == tuple(files[:2])
    with pytest.raises(ModelError, match=r"no file y\.gguf"):
        choose_files(HubModelName("u/r", file="y.gguf"), files)


def test_the_projector_comes_along_unless_refused():
    files = ["vl-Q4_K_M.gguf", "vl-Q8_0.gguf", "mmproj-vl-f32.gguf", "mmproj-vl-F16.gguf"]
    assert choose_files(HubModelName("u/vl"), files).projector == "mmproj-vl-F16.gguf"
    assert choose_files(HubModelName("u/vl"), files, projector=False).projector is None
    with_quant = [*files, "mmproj-vl-Q8_0.gguf"]
    assert choose_files(HubModelName("u/vl", "Q8_0"), with_quant).projector == "mmproj-vl-Q8_0.gguf"
    assert choose_files(HubModelName("u/vl", "Q8_0"), with_quant).files == ("vl-Q8_0.gguf", "mmproj-vl-Q8_0.gguf")


def test_a_repo_without_ggufs_is_refused():
    with pytest.raises(ModelError, match="no GGUF model files"):
        choose_files(HubModelName("u/r"), ["model.safetensors", "mmproj-f16.gguf"])


@pytest.mark.parametrize("path, quant", [("a-Q4_K_M.gguf", "Q4_K_M"), ("a.IQ2_XXS.gguf", "IQ2_XXS"),
                                         ("Qwen3-UD-Q4_K_XL-00001-of-00002.gguf", "UD-Q4_K_XL"),
                                         ("model-bf16.gguf", "bf16"), ("plain.gguf", "plain")])
def test_the_quant_a_file_name_says(path, quant):
    assert quant_of(path) == quant


def test_the_transfer_note_gives_rate_and_time_left():
    assert transfer_note(0, 100, 0, 0.0) == "starting"
    assert transfer_note(50 << 20, 100 << 20, 10 << 20, 1.0) == "10.0 MiB/s, 5 s left"
    assert transfer_note(0, 1300 << 20, 10 << 20, 1.0) == "10.0 MiB/s, 2 min 10 s left"


@pytest.mark.parametrize(("path", "name"), [
    ("/c/models--bartowski--Qwen3-8B-GGUF/snapshots/abc/Qwen3-8B-Q4_K_M.gguf", "hf:bartowski/Qwen3-8B-GGUF:Q4_K_M"),
    ("/c/models--u--r/snapshots/abc/Big-Q8_0-00001-of-00002.gguf", "hf:u/r:Q8_0"),
    ("/c/models--u--r/snapshots/abc/sub/model.gguf", "hf:u/r/sub/model.gguf"),
    ("/home/me/models/Qwen3-8B-Q4_K_M.gguf", None),
    ("/c/datasets--u--r/snapshots/abc/x-Q4_0.gguf", None),
])
def test_a_file_in_the_hubs_cache_is_shown_by_its_hub_name(path, name):
    assert hub_name_of(path) == name
    if name is not None:
        assert parse_model_name(name) is not None  # a name people can give back to --model
