"""The pinned rpc-server's device listing, as captured from real builds (stdout and stderr together, as
in a node's rpc-server log), read by ``capacity.parse_device_listing`` (what ``devices.list_devices``
uses): the CPU build, and the Vulkan build on Mesa's llvmpipe with and without GGML_VK_VISIBLE_DEVICES."""

from __future__ import annotations

from mesh_sidecar.llama.capacity import Device, backend_of, parse_device_listing
from mesh_sidecar.units import MIB

CPU_BUILD = """Starting RPC server v7.0.0
  endpoint       : 127.0.0.1:50991
  local cache    : n/a
Devices:
  CPU: AMD EPYC (24105 MiB, 24105 MiB free)
  transport      : TCP
"""

VULKAN_BUILD_LLVMPIPE_VISIBLE = """ggml_vulkan: Found 1 Vulkan devices:
ggml_vulkan: 0 = llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe) | uma: 0 | fp16: 1 | bf16: 0 | fp4: 0 | warp size: 8 \
| shared memory: 32768 | int dot: 0 | matrix cores: none
ggml_vulkan: Warning: Device type is CPU. This is probably not the device you want.
Starting RPC server v7.0.0
  endpoint       : 127.0.0.1:50993
  local cache    : n/a
Devices:
  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)
  transport      : TCP
"""

VULKAN_BUILD_LLVMPIPE_SKIPPED = """ggml_vulkan: No devices found.
Starting RPC server v7.0.0
  endpoint       : 127.0.0.1:50994
  local cache    : n/a
Devices:
  CPU: AMD EPYC (24105 MiB, 24105 MiB free)
  transport      : TCP
"""


def test_cpu_build() -> None:
    assert parse_device_listing(CPU_BUILD) == (Device("CPU", "AMD EPYC", 24105 * MIB, 24105 * MIB),)


def test_vulkan_build_on_llvmpipe() -> None:
    # The description keeps its own parentheses; only the last pair is the memory.
    (device,) = parse_device_listing(VULKAN_BUILD_LLVMPIPE_VISIBLE)
    assert device == Device("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", 2048 * MIB, 2048 * MIB)
    assert not device.is_cpu  # the mesh counts it as GPU memory


def test_vulkan_build_without_a_visible_device_offers_the_cpu() -> None:
    (device,) = parse_device_listing(VULKAN_BUILD_LLVMPIPE_SKIPPED)
    assert device.is_cpu and device.total_bytes == 24105 * MIB


def test_the_backend_people_see_is_the_first_gpus_family():
    def listing(*names: str) -> tuple[Device, ...]:
        return tuple(Device(name, "", MIB, MIB) for name in names)

    assert backend_of(parse_device_listing(CPU_BUILD)) == "cpu"
    assert backend_of(parse_device_listing(VULKAN_BUILD_LLVMPIPE_VISIBLE)) == "vulkan"
    assert backend_of(listing("CUDA0", "CUDA1")) == "cuda" and backend_of(listing("MTL0")) == "metal"
