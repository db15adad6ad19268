"""The compute backends the pinned llama.cpp is built with, which one a machine has, and which one its nodes run.

Every build has RPC and the CPU; a GPU backend adds one ggml backend beside them
(``-DGGML_VULKAN=ON``, ``-DGGML_CUDA=ON``, ``-DGGML_METAL=ON``), in a build directory of
its own (``build.BuildVariant.key``). ``detect_backend`` picks a GPU backend only for a GPU, in
this order: ``nvcc`` and ``nvidia-smi`` on PATH and a GPU that ``nvidia-smi -L`` lists: cuda;
macOS: metal (its native GPU API; Vulkan there is a translation layer); the Vulkan loader and
``glslc`` and a GPU among the loader's devices (vulkan_devices.py): vulkan; else cpu. A
toolkit is not a GPU: nvcc without a driver (a container image, a build machine) builds for
no GPU (``GGML_NATIVE`` builds for the GPUs it finds), and Mesa's software Vulkan device
(llvmpipe), the only one on many machines with the loader, is hidden by ggml and would cost
a six-minute build for nothing.

A build's toolkit is checked before cmake runs (``check_toolkit``): a missing one is a
``BuildError`` that names the packages to install, not cmake's error a hundred lines up.

Which build a node runs: the backend the last ``mesh-inference setup`` built, recorded
in the cache (``<cache>/llama-backend``, ``record_backend``); nothing recorded: cpu.
``--llama-bin`` still names any build of one's own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import environment
from ..errors import BuildError, SetupError, UsageError
from ..home import cache_root

AUTO = "auto"  # `setup --backend auto`: what detect_backend finds
BACKEND_CHOICE_NAME = "llama-backend"  # in the cache root: the backend `setup` built last, one word
# Where toolkits are installed, besides $VULKAN_SDK (LunarG's SDK).
SYSTEM_PREFIXES = (Path("/usr"), Path("/usr/local"))
VULKAN_LOADER_GLOBS = ("lib/libvulkan.so*", "lib64/libvulkan.so*", "lib/*/libvulkan.so*", "lib/libvulkan*.dylib")
# Asking a driver for its devices: a hung one must not hang `setup`.
PROBE_TIMEOUT_S = 20.0
VULKAN_PROBE = (sys.executable, "-m", "mesh_sidecar.llama.vulkan_devices")
GPU_KINDS = frozenset({"integrated_gpu", "discrete_gpu", "virtual_gpu"})  # of vulkan_devices.DEVICE_KINDS
_NVIDIA_GPU_LINE = re.compile(r"^GPU \d+: (.+?)(?: \(UUID: [^)]*\))?$", re.MULTILINE)


@dataclass(frozen=True)
class Backend:
    """A ggml compute backend: its cmake options, and the fix (a patch in ``llama/patches``) the pinned
    source needs to build with it, if any."""

    name: str
    cmake_options: tuple[str, ...] = ()
    patch_name: str | None = None


CPU = Backend("cpu")
# The pinned ggml-vulkan.cpp needs headers with VK_EXT_layer_settings; the patch guards that block
# (patches/README.md) so older headers (Debian 12's 1.3.239) build it too.
VULKAN = Backend("vulkan", ("-DGGML_VULKAN=ON",), "llama.cpp-vulkan-headers.patch")
CUDA = Backend("cuda", ("-DGGML_CUDA=ON",))
METAL = Backend("metal", ("-DGGML_METAL=ON",))
BACKENDS = {backend.name: backend for backend in (CPU, VULKAN, CUDA, METAL)}


@dataclass(frozen=True)
class Machine:
    """Where a toolkit is looked for: programs on ``path`` (like $PATH), files under install ``prefixes``.
    ``Machine.here()`` is this machine; tests build fake ones in temporary directories."""

    path: str | None
    platform: str
    prefixes: tuple[Path, ...]
    vulkan_probe: tuple[str, ...] = VULKAN_PROBE  # prints the loader's devices as JSON (vulkan_devices.py)

    @classmethod
    def here(cls) -> Machine:
        sdk = environment.vulkan_sdk_dir()
        return cls(None, sys.platform, SYSTEM_PREFIXES + ((sdk,) if sdk is not None else ()))

    def has_program(self, name: str) -> bool:
        return shutil.which(name, path=self.path) is not None

    def has_file(self, *globs: str) -> bool:
        """Whether any install prefix holds a file matching one of ``globs`` (relative to the prefix)."""
        return any(next(prefix.glob(pattern), None) is not None for prefix in self.prefixes for pattern in globs)

    def output(self, *argv: str) -> str | None:
        """What ``argv`` (its program looked up on ``path``) prints; None if it is missing, fails or hangs."""
        program = argv[0] if Path(argv[0]).is_absolute() else shutil.which(argv[0], path=self.path)
        if program is None:
            return None
        try:
            done = subprocess.run([program, *argv[1:]], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    def nvidia_gpus(self) -> list[str]:
        """The GPUs ``nvidia-smi -L`` lists, by name."""
        return _NVIDIA_GPU_LINE.findall(self.output("nvidia-smi", "-L") or "")

    def vulkan_devices(self) -> list[dict[str, str]]:
        """The Vulkan loader's devices: {"name", "kind"} (vulkan_devices.py)."""
        try:
            devices = json.loads(self.output(*self.vulkan_probe) or "[]")
        except ValueError:
            return []
        return devices if isinstance(devices, list) else []


@dataclass(frozen=True)
class _Requirement:
    """One piece of a toolkit: a program on PATH or a file under a prefix, and the Debian/Ubuntu package with it."""

    what: str
    package: str
    program: str | None = None
    globs: tuple[str, ...] = ()

    def met(self, machine: Machine) -> bool:
        return machine.has_program(self.program) if self.program else machine.has_file(*self.globs)


_SPIRV_CONFIG = "cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake"
_REQUIREMENTS = {
    VULKAN.name: (
        _Requirement("glslc (the shader compiler)", "glslc", program="glslc"),
        _Requirement("the Vulkan headers", "libvulkan-dev", globs=("include/vulkan/vulkan.hpp",)),
        _Requirement("the Vulkan loader", "libvulkan-dev", globs=VULKAN_LOADER_GLOBS),
        _Requirement("the SPIR-V headers", "spirv-headers",
                     globs=(f"share/{_SPIRV_CONFIG}", f"lib/{_SPIRV_CONFIG}", f"lib/*/{_SPIRV_CONFIG}")),
    ),
    CUDA.name: (
        _Requirement("nvcc (the CUDA toolkit's compiler)", "nvidia-cuda-toolkit", program="nvcc"),
        _Requirement("the cuBLAS headers (cublas_v2.h)", "nvidia-cuda-toolkit",
                     globs=("include/cublas_v2.h", "cuda*/include/cublas_v2.h", "cuda*/targets/*/include/cublas_v2.h")),
        # The build is made for the GPUs it finds (GGML_NATIVE): without a driver there are none.
        _Requirement("an NVIDIA GPU with its driver (nvidia-smi)", "nvidia-driver", program="nvidia-smi"),
    ),
    METAL.name: (_Requirement("xcrun (the Xcode command line tools)", "", program="xcrun"),),
}
_INSTALL_HINTS = {
    VULKAN.name: "On Debian/Ubuntu: sudo apt-get install mesa-vulkan-drivers libvulkan-dev glslc spirv-headers "
                 "(mesa-vulkan-drivers only for Mesa's drivers, such as its llvmpipe software device; a GPU "
                 "vendor's driver brings its own). Elsewhere: LunarG's Vulkan SDK, with VULKAN_SDK set.",
    CUDA.name: "Install NVIDIA's driver and CUDA toolkit (https://developer.nvidia.com/cuda-downloads; on "
               "Debian/Ubuntu also sudo apt-get install nvidia-driver nvidia-cuda-toolkit) and put the toolkit's "
               "bin/ directory, with nvcc, on PATH.",
    METAL.name: "Install them with: xcode-select --install",
}


def missing_toolkit(backend: Backend, machine: Machine) -> list[str]:
    """What the build of ``backend`` needs and ``machine`` lacks, for people (empty: all there)."""
    if backend == METAL and machine.platform != "darwin":
        return ["macOS (Metal exists only there)"]
    return [f"{r.what}{f' (package {r.package})' if r.package else ''}"
            for r in _REQUIREMENTS.get(backend.name, ()) if not r.met(machine)]


def check_toolkit(backend: Backend, machine: Machine | None = None) -> None:
    """BuildError naming what is missing and the packages to install, before any compiling starts."""
    missing = missing_toolkit(backend, machine or Machine.here())
    if missing:
        raise BuildError(
            f"The {backend.name} build of llama.cpp needs {', '.join(missing)}, which this machine lacks. "
            f"{_INSTALL_HINTS[backend.name]} Or build for another backend: mesh-inference setup --backend cpu.")


@dataclass(frozen=True)
class Detection:
    """The backend `setup --backend auto` builds, and what it found that decided it (for people)."""

    backend: Backend
    found: str


def detect_backend(machine: Machine | None = None) -> Detection:
    """The backend for this machine's GPU (cuda: the CUDA toolkit and a GPU nvidia-smi lists; macOS: metal;
    vulkan: the loader, glslc and a GPU among the loader's devices), else cpu; and what decided it."""
    machine = machine or Machine.here()
    notes = []
    if machine.has_program("nvcc") and machine.has_program("nvidia-smi"):
        if gpus := machine.nvidia_gpus():
            return Detection(CUDA, f"NVIDIA GPU {', '.join(gpus)} and the CUDA toolkit")
        notes.append("the CUDA toolkit, but nvidia-smi lists no GPU")
    if machine.platform == "darwin":
        return Detection(METAL, "macOS")
    if machine.has_file(*VULKAN_LOADER_GLOBS) and machine.has_program("glslc"):
        devices = machine.vulkan_devices()
        if gpus := [d["name"] for d in devices if d.get("kind") in GPU_KINDS]:
            return Detection(VULKAN, f"Vulkan GPU {', '.join(gpus)}")
        others = ", ".join(f"{d['name']} ({d.get('kind')})" for d in devices) or "none"
        notes.append(f"the Vulkan toolkit, but no Vulkan GPU (its devices: {others})")
    return Detection(CPU, "; ".join(notes) or "no GPU toolkit")


def backend_named(name: str, machine: Machine | None = None) -> Backend:
    """The backend ``name`` (``auto``: the detected one); UsageError listing the choices for another word."""
    if name == AUTO:
        return detect_backend(machine).backend
    if name not in BACKENDS:
        raise UsageError(f"--backend takes {', '.join(BACKENDS)} or {AUTO}, not {name!r}.")
    return BACKENDS[name]


def record_backend(backend: Backend) -> None:
    """Make ``backend`` the one this machine's nodes run (what `setup` does once its build is complete)."""
    path = cache_root() / BACKEND_CHOICE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(backend.name + "\n")


def recorded_backend() -> Backend:
    """The backend the last `setup` built; cpu when none did."""
    path = cache_root() / BACKEND_CHOICE_NAME
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        return CPU
    if name not in BACKENDS:
        raise SetupError(f"{path} names no backend this version knows ({name!r}). Choose one again: "
                         f"mesh-inference setup --backend {'|'.join(BACKENDS)}")
    return BACKENDS[name]
