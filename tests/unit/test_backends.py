"""Backends of the pinned build: detection on fake machines, the missing-toolkit message, cmake options,
cache keys (the CPU one unchanged), the backend `setup` records for the node runs."""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import pytest

from mesh_sidecar.environment import CACHE_ENV
from mesh_sidecar.errors import BuildError, SetupError, UsageError
from mesh_sidecar.llama.backends import (
    AUTO,
    BACKEND_CHOICE_NAME,
    BACKENDS,
    CPU,
    CUDA,
    GPU_KINDS,
    METAL,
    VULKAN,
    VULKAN_LOADER_GLOBS,
    Machine,
    backend_named,
    check_toolkit,
    detect_backend,
    missing_toolkit,
    record_backend,
    recorded_backend,
)
from mesh_sidecar.llama.build import (
    B2B,
    CMAKE_OPTIONS,
    PATCHES_DIR,
    READ_ONLY_CACHE_PATCH,
    SDIST_SHA256,
    STOCK,
    ninja_reporter,
    offered_source,
    place_source_archive,
    source_archive_path,
)

GPU_OPTIONS = ("-DGGML_VULKAN=ON", "-DGGML_CUDA=ON", "-DGGML_METAL=ON")
VULKAN_FILES = ("usr/include/vulkan/vulkan.hpp", "usr/lib/x86_64-linux-gnu/libvulkan.so.1",
                "usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake")


NVIDIA_SMI_LISTING = "GPU 0: NVIDIA H200 (UUID: GPU-0a1b2c3d-0000-1111-2222-333344445555)\n"
LLVMPIPE = [{"name": "llvmpipe (LLVM 15.0.6, 256 bits)", "kind": "cpu"}]
RADEON = [{"name": "AMD Radeon 780M (RADV PHOENIX)", "kind": "integrated_gpu"}, *LLVMPIPE]


def fake_machine(root: Path, programs: tuple[str, ...] = (), files: tuple[str, ...] = (),
                 platform: str = "linux", *, gpus: str = "", vulkan: list[dict[str, str]] | None = None) -> Machine:
    """A machine whose PATH holds only ``programs`` and whose /usr is ``root``/usr holding ``files``;
    its nvidia-smi -L prints ``gpus``, its Vulkan loader lists ``vulkan``."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in programs:
        printed = gpus if name == "nvidia-smi" else ""
        (bin_dir / name).write_text(f"#!/bin/sh\nprintf '%s' '{printed}'\n")
        (bin_dir / name).chmod(0o755)
    probe = bin_dir / "vulkan-probe"
    probe.write_text(f"#!/bin/sh\nprintf '%s' '{json.dumps(vulkan or [])}'\n")
    probe.chmod(0o755)
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return Machine(str(bin_dir), platform, (root / "usr",), vulkan_probe=(str(probe),))


LOADER = ("usr/lib/x86_64-linux-gnu/libvulkan.so.1",)


@pytest.mark.parametrize("programs, files, platform, gpus, vulkan, expected", [
    ((), (), "linux", "", None, CPU),
    (("nvcc", "nvidia-smi"), (), "linux", NVIDIA_SMI_LISTING, None, CUDA),
    (("nvcc", "nvidia-smi", "glslc"), VULKAN_FILES, "linux", NVIDIA_SMI_LISTING, RADEON, CUDA),  # CUDA first
    (("nvcc", "nvidia-smi"), (), "linux", "", None, CPU),  # a driver that lists no GPU
    (("nvcc",), (), "linux", NVIDIA_SMI_LISTING, None, CPU),  # a CUDA toolkit without a GPU driver
    (("nvcc", "nvidia-smi", "glslc"), VULKAN_FILES, "linux", "", RADEON, VULKAN),  # no NVIDIA GPU: Vulkan's
    (("glslc",), LOADER, "linux", "", RADEON, VULKAN),
    (("glslc",), ("usr/lib64/libvulkan.so.1",), "linux", "", RADEON, VULKAN),
    (("glslc",), LOADER, "linux", "", LLVMPIPE, CPU),  # only Mesa's software device, which ggml hides
    (("glslc",), LOADER, "linux", "", [], CPU),  # a loader without a driver
    (("glslc",), (), "linux", "", RADEON, CPU),  # no loader
    ((), LOADER, "linux", "", RADEON, CPU),  # no glslc
    (("glslc",), LOADER, "darwin", "", RADEON, METAL),
])
def test_detect_backend(tmp_path, programs, files, platform, gpus, vulkan, expected) -> None:
    assert detect_backend(fake_machine(tmp_path, programs, files, platform, gpus=gpus, vulkan=vulkan)).backend \
        == expected


def test_detection_says_what_it_found(tmp_path) -> None:
    cuda = detect_backend(fake_machine(tmp_path / "a", ("nvcc", "nvidia-smi"), gpus=NVIDIA_SMI_LISTING))
    assert cuda.found == "NVIDIA GPU NVIDIA H200 and the CUDA toolkit"
    software = detect_backend(fake_machine(tmp_path / "b", ("glslc",), LOADER, vulkan=LLVMPIPE))
    assert software.found == "the Vulkan toolkit, but no Vulkan GPU (its devices: llvmpipe (LLVM 15.0.6, 256 bits) " \
                             "(cpu))"
    nothing = detect_backend(fake_machine(tmp_path / "c", ("nvcc", "nvidia-smi")))
    assert (nothing.backend, nothing.found) == (CPU, "the CUDA toolkit, but nvidia-smi lists no GPU")


LAVAPIPE_ICD = "/usr/share/vulkan/icd.d/lvp_icd*.json"


def test_the_loader_lists_mesas_software_device_as_a_cpu() -> None:
    """The real probe through this machine's loader (scripts/test.sh installs Mesa's Vulkan drivers)."""
    if not Machine.here().has_file(*VULKAN_LOADER_GLOBS) or not glob.glob(LAVAPIPE_ICD):
        pytest.skip("no Vulkan loader or no Mesa lavapipe driver here (scripts/test.sh installs them)")
    devices = Machine.here().vulkan_devices()
    assert any(d["kind"] == "cpu" and d["name"].startswith("llvmpipe") for d in devices), devices
    assert detect_backend().backend == (VULKAN if any(d["kind"] in GPU_KINDS for d in devices) else CPU)


def test_auto_is_the_detected_backend_and_a_name_is_checked(tmp_path) -> None:
    machine = fake_machine(tmp_path, ("nvcc", "nvidia-smi"), gpus=NVIDIA_SMI_LISTING)
    assert backend_named(AUTO, machine) == CUDA
    assert backend_named("vulkan", machine) == VULKAN
    with pytest.raises(UsageError, match="--backend takes cpu, vulkan, cuda, metal or auto, not 'rocm'"):
        backend_named("rocm", machine)


def test_vulkan_toolkit_complete(tmp_path) -> None:
    machine = fake_machine(tmp_path, ("glslc",), VULKAN_FILES)
    assert missing_toolkit(VULKAN, machine) == []
    check_toolkit(VULKAN, machine)  # no error


def test_missing_vulkan_pieces_name_their_packages(tmp_path) -> None:
    machine = fake_machine(tmp_path, (), VULKAN_FILES[:2])  # no glslc, no SPIR-V headers
    with pytest.raises(BuildError) as caught:
        check_toolkit(VULKAN, machine)
    message = str(caught.value)
    assert "needs glslc (the shader compiler) (package glslc), the SPIR-V headers (package spirv-headers)" \
        in message
    assert "Vulkan headers" not in message  # present
    assert "sudo apt-get install mesa-vulkan-drivers libvulkan-dev glslc spirv-headers" in message
    assert "mesh-inference setup --backend cpu" in message


def test_missing_cuda_and_metal_toolkits(tmp_path) -> None:
    machine = fake_machine(tmp_path, ("glslc",))
    with pytest.raises(BuildError, match=r"needs nvcc .*package nvidia-cuda-toolkit.*cublas_v2.h.*nvidia-smi"):
        check_toolkit(CUDA, machine)
    toolkit = fake_machine(tmp_path / "cuda", ("nvcc", "nvidia-smi"),
                           ("usr/local/cuda-13.0/targets/x86_64-linux/include/cublas_v2.h",))
    assert missing_toolkit(CUDA, Machine(toolkit.path, "linux", (tmp_path / "cuda" / "usr" / "local",))) == []
    assert missing_toolkit(METAL, machine) == ["macOS (Metal exists only there)"]
    assert missing_toolkit(METAL, fake_machine(tmp_path / "mac", ("xcrun",), platform="darwin")) == []
    assert missing_toolkit(CPU, machine) == []


def test_cmake_options_per_backend() -> None:
    assert STOCK.cmake_options() == CMAKE_OPTIONS
    assert not set(GPU_OPTIONS) & set(CMAKE_OPTIONS)
    for backend, option in zip((VULKAN, CUDA, METAL), GPU_OPTIONS, strict=True):
        for variant in (STOCK, B2B):
            options = variant.on(backend).cmake_options()
            assert options[:len(CMAKE_OPTIONS)] == CMAKE_OPTIONS  # RPC, static, no AMX: the same
            assert [o for o in options if o in GPU_OPTIONS] == [option]


def test_cache_keys() -> None:
    # Every build carries the read-only cache patch's hash: a build from before it, or of an older patch, is
    # never taken for one with it.
    assert re.fullmatch(r"llama\.cpp-0\.3\.36-cache-ro-[0-9a-f]{12}", STOCK.key())
    assert re.fullmatch(re.escape(STOCK.key()) + r"-b2b-[0-9a-f]{12}", B2B.key())
    assert STOCK.on(CPU) == STOCK and B2B.on(CPU).key() == B2B.key()
    assert re.fullmatch(re.escape(STOCK.key()) + r"-vulkan-[0-9a-f]{12}", STOCK.on(VULKAN).key())
    assert STOCK.on(CUDA).key() == STOCK.key() + "-cuda"
    assert STOCK.on(METAL).key() == STOCK.key() + "-metal"
    assert B2B.on(VULKAN).key() == STOCK.on(VULKAN).key() + B2B.key().removeprefix(STOCK.key())
    keys = {variant.on(backend).key() for variant in (STOCK, B2B) for backend in BACKENDS.values()}
    assert len(keys) == 2 * len(BACKENDS)


def test_every_build_applies_the_read_only_cache_patch_first_and_vulkan_its_header_fix_next() -> None:
    fix = PATCHES_DIR / "llama.cpp-vulkan-headers.patch"
    assert STOCK.on(VULKAN).patches() == (READ_ONLY_CACHE_PATCH, fix)
    assert B2B.on(VULKAN).patches() == (READ_ONLY_CACHE_PATCH, fix, B2B.patch)
    assert STOCK.on(CUDA).patches() == STOCK.patches() == (READ_ONLY_CACHE_PATCH,)
    assert "#if defined(VK_EXT_layer_settings)" in fix.read_text()
    assert "mesh-inference: cache_flag is ignored" in READ_ONLY_CACHE_PATCH.read_text()


def test_setup_records_the_backend_the_nodes_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert recorded_backend() == CPU  # nothing recorded
    record_backend(VULKAN)
    assert (tmp_path / BACKEND_CHOICE_NAME).read_text() == "vulkan\n"
    assert recorded_backend() == VULKAN
    (tmp_path / BACKEND_CHOICE_NAME).write_text("rocm\n")
    with pytest.raises(SetupError, match=re.escape("'rocm'") + ".*" + re.escape("--backend cpu|vulkan|cuda|metal")):
        recorded_backend()


def test_a_sub_builds_ninja_lines_are_not_the_builds_progress() -> None:
    # As the Vulkan build prints them: the outer build's glob check, its steps, the shader generator's own.
    lines = ["[0/2] Re-checking globbed directories...", "[1/534] Building CXX object ggml.cpp.o",
             "[48/534] Performing build step for 'vulkan-shaders-gen'",
             "[1/2] Building CXX object CMakeFiles/vulkan-shaders-gen.dir/vulkan-shaders-gen.cpp.o",
             "[2/2] Linking CXX executable vulkan-shaders-gen", "[49/534] Performing install step",
             "[534/534] Linking CXX executable bin/llama-server"]
    seen: list[tuple[int, int]] = []
    report = ninja_reporter(lambda stage, done, total: seen.append((done, total)))
    for line in lines:
        report(line)
    assert seen == [(0, 2), (1, 534), (48, 534), (49, 534), (534, 534)]


def test_only_the_pinned_source_is_kept_and_offered(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert offered_source(SDIST_SHA256) is None  # none kept yet
    stranger = tmp_path / "stranger.tar.gz"
    stranger.write_bytes(b"not llama.cpp")
    with pytest.raises(BuildError, match=r"has sha256 [0-9a-f]{64}, not the pinned .*; it was discarded"):
        place_source_archive(stranger)
    assert not stranger.exists() and not source_archive_path().exists()
    source_archive_path().parent.mkdir(parents=True)
    source_archive_path().write_bytes(b"as if checked")  # kept files were checked when placed
    assert offered_source(SDIST_SHA256) == source_archive_path()
    assert offered_source("0" * 64) is None  # nothing else is offered by this name
