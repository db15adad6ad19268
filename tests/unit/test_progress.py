"""Progress where there is no terminal: plain lines, the ninja and llama-server parsers.

Callbacks fed in memory, real lines captured from a llama.cpp build and a llama-server
load (the log hook fed by a real child: tests/integration/test_progress.py).
"""

from __future__ import annotations

from mesh_sidecar.cli import prepare
from mesh_sidecar.llama.build import ninja_progress
from mesh_sidecar.llama.launch import LLAMA_SERVER_LOAD_STAGES, llama_server_load_stage
from mesh_sidecar.progress import PlainProgress
from mesh_sidecar.units import MIB


def _reporter(**kwargs) -> tuple[PlainProgress, list[str]]:
    lines: list[str] = []
    return PlainProgress(lines.append, **kwargs), lines


def test_one_line_per_tenth_and_the_end() -> None:
    progress, lines = _reporter()
    progress("Compiling llama.cpp", 0, 0)
    for done in range(1, 338):  # a ninja build of 337 steps, every step reported
        progress("Compiling llama.cpp", done, 337)
    assert lines == ["Compiling llama.cpp"] + [f"Compiling llama.cpp: {p}%" for p in range(10, 101, 10)]


def test_a_stage_with_a_length_opens_with_its_percentage_and_skips_tenths_it_jumps() -> None:
    progress, lines = _reporter()
    for done in (0, 1, 2, 55, 56, 97, 100, 100):  # sparse reports: 55 of 100 covers 10%..50% at once
        progress("Unpacking llama.cpp source", done, 100)
    assert lines == ["Unpacking llama.cpp source: 0%", "Unpacking llama.cpp source: 55%",
                     "Unpacking llama.cpp source: 97%", "Unpacking llama.cpp source: 100%"]


def test_stages_without_a_length_say_their_name_once() -> None:
    progress, lines = _reporter()
    for _ in range(3):
        progress("Configuring llama.cpp", 0, 0)
    progress("Downloading the default model", 0, 0)
    assert lines == ["Configuring llama.cpp", "Downloading the default model"]


def test_a_new_stage_starts_over_and_a_returning_one_is_said_again() -> None:
    progress, lines = _reporter()
    progress("A", 5, 10)
    progress("B", 10, 10)
    progress("A", 5, 10)
    assert lines == ["A: 50%", "B: 100%", "A: 50%"]


def test_bytes_are_shown_in_mib_and_nothing_follows_the_end() -> None:
    progress, lines = _reporter(in_bytes=True)
    total = 300 * MIB
    for done in range(0, total + 1, MIB):
        progress("Fetching the model from c", done, total)
    progress("Fetching the model from c", total, total)
    assert len(lines) == 11
    assert lines[0] == "Fetching the model from c: 0% (0 of 300 MiB)"
    assert lines[4] == "Fetching the model from c: 40% (120 of 300 MiB)"
    assert lines[-1] == "Fetching the model from c: 100% (300 of 300 MiB)"


def test_ninja_status_lines() -> None:
    # Real lines from ninja building ggml-rpc-server and llama-server.
    assert ninja_progress("[1/337] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o\n") == (1, 337)
    assert ninja_progress("[337/337] Linking CXX executable bin/llama-server") == (337, 337)
    assert ninja_progress("ninja: Entering directory `/tmp/cache/llama.cpp-0.3.36/build'") is None
    assert ninja_progress("In file included from /src/ggml/src/ggml.c:1: [1/2]") is None
    assert ninja_progress("[0/0] nothing") is None


# Captured from a real llama-server load (SmolLM2-135M over one rpc-server), in log order,
# with lines between them that start no stage.
REAL_LOAD_LOG = """\
0.00.015.057 I srv    load_model: loading model '/root/.cache/mesh-inference/models/SmolLM2-135M-Instruct.Q4_1.gguf'
0.00.175.045 I llama_model_loader: loaded meta data with 33 key-value pairs and 272 tensors from /root/.cache/mesh-inference/models/SmolLM2-135M-Instruct.Q4_1.gguf (version GGUF V3 (latest))
0.00.271.333 I print_info: max token length      = 162
0.00.272.327 I load_tensors: loading model tensors, this can take a while... (load_mode = mmap)
0.00.298.551 I load_tensors: offloaded 31/31 layers to GPU
0.00.298.586 I load_tensors: RPC0[127.0.0.1:41443] model buffer size =    92.10 MiB
0.00.471.571 I llama_context: constructing llama_context
0.00.479.352 I llama_kv_cache: RPC0[127.0.0.1:41443] KV buffer size =    90.00 MiB
0.00.561.131 I cmn  common_init_: warming up the model with an empty run - please wait ... (--no-warmup to disable)
0.00.626.100 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 4096, kv_unified = 'true'
0.00.630.505 I srv  llama_server: model loaded
0.00.630.531 I srv  llama_server: listening on http://127.0.0.1:49785
0.00.630.710 I srv  update_slots: all slots are idle
"""


def test_llama_server_load_stages_from_a_real_log() -> None:
    stages = [s for line in REAL_LOAD_LOG.encode().splitlines() if (s := llama_server_load_stage(line))]
    assert stages == [stage for _, stage in LLAMA_SERVER_LOAD_STAGES]
    progress, lines = _reporter()
    for stage in stages:
        progress(stage, 0, 0)
    assert lines[0] == "Loading the model: reading its metadata"
    assert lines[-1] == "Loading the model: done"


def test_setup_reports_plain_lines_without_a_terminal(capsys) -> None:
    assert not prepare.err_console.is_terminal  # pytest captures stderr
    with prepare.setup_progress() as progress:
        progress("Configuring llama.cpp", 0, 0)
        progress("Compiling llama.cpp", 5, 10)
    assert isinstance(progress, PlainProgress)
    assert capsys.readouterr().err.splitlines() == ["Configuring llama.cpp", "Compiling llama.cpp: 50%"]
