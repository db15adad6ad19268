"""The devices the Vulkan loader lists, with their kind, so `setup --backend auto` builds for Vulkan
only where there is a GPU: Mesa's software device (llvmpipe, kind ``cpu``) is hidden by ggml and
gains nothing over the CPU build.

Read through the loader itself (``libvulkan.so.1``, with ctypes): `vulkaninfo` is a separate package
that machines with a working loader often lack. Run as a child process (``python -m
mesh_sidecar.llama.vulkan_devices``, printing JSON), so a driver that crashes or hangs while
enumerating costs the caller only a timeout (backends.py).
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

LOADER_NAMES = ("libvulkan.so.1", "libvulkan.so", "libvulkan.1.dylib")
STRUCTURE_TYPE_INSTANCE_CREATE_INFO = 1
SUCCESS = 0
# VkPhysicalDeviceType, by value.
DEVICE_KINDS = ("other", "integrated_gpu", "discrete_gpu", "virtual_gpu", "cpu")
# VkPhysicalDeviceProperties: apiVersion, driverVersion, vendorID, deviceID (uint32 each), then deviceType
# (uint32) and deviceName (char[256]); the limits that follow are not read. 824 bytes on every ABI; more
# room costs nothing.
DEVICE_TYPE_OFFSET = 16
DEVICE_NAME_OFFSET = 20
DEVICE_NAME_BYTES = 256
PROPERTIES_BYTES = 4096
MAX_DEVICES = 16


class _InstanceCreateInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_uint32), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.c_void_p), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


def _loader() -> ctypes.CDLL | None:
    for name in LOADER_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def list_devices() -> list[dict[str, Any]]:
    """Every physical device the loader lists: {"name", "kind"} (kind: one of DEVICE_KINDS); [] when there
    is no loader, no driver or no device."""
    vulkan = _loader()
    if vulkan is None:
        return []
    instance = ctypes.c_void_p()
    info = _InstanceCreateInfo(sType=STRUCTURE_TYPE_INSTANCE_CREATE_INFO)
    if vulkan.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != SUCCESS:
        return []
    try:
        count = ctypes.c_uint32(MAX_DEVICES)
        handles = (ctypes.c_void_p * MAX_DEVICES)()
        if vulkan.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles) < SUCCESS:
            return []
        devices = []
        for handle in handles[:count.value]:
            properties = ctypes.create_string_buffer(PROPERTIES_BYTES)
            vulkan.vkGetPhysicalDeviceProperties(ctypes.c_void_p(handle), properties)
            kind = int.from_bytes(properties.raw[DEVICE_TYPE_OFFSET:DEVICE_TYPE_OFFSET + 4], sys.byteorder)
            name = properties.raw[DEVICE_NAME_OFFSET:DEVICE_NAME_OFFSET + DEVICE_NAME_BYTES].split(b"\0")[0]
            devices.append({"name": name.decode(errors="replace"),
                            "kind": DEVICE_KINDS[kind] if kind < len(DEVICE_KINDS) else "other"})
        return devices
    finally:
        vulkan.vkDestroyInstance(instance, None)


if __name__ == "__main__":
    print(json.dumps(list_devices()))
