"""The devices an rpc-server of a given llama.cpp build exposes: name, description, total and free memory.

The pinned rpc-server prints its devices when it starts, before it binds its port
(``ggml_backend_rpc_start_server``), and serves forever after; into a pipe the
listing would stay in its stdout buffer. So ``list_devices`` starts it on a
loopback port that we hold ourselves: it lists the devices, fails to bind and
exits, and the exit flushes the complete listing. No port is opened, no client
connects, and it takes milliseconds (plus the backends' own start: a GPU's
driver, a Vulkan instance). The listing is read by ``capacity.parse_device_listing``,
the parser the node uses on its own rpc-server's log.

Which devices it lists: ggml's non-CPU devices, else the CPU (rpc-server's own rule).
ggml's Vulkan backend skips CPU-type devices, such as Mesa's llvmpipe software
device, unless ``GGML_VK_VISIBLE_DEVICES`` names them: pass it in ``env``
(``{"GGML_VK_VISIBLE_DEVICES": "0"}``).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping

from ..errors import ProcessError
from ..ports import LOOPBACK
from .build import LlamaBinaries
from .capacity import Device, parse_device_listing

DEVICE_LIST_TIMEOUT_S = 60.0  # a GPU driver's or a Vulkan instance's start, on a loaded machine


def list_devices(binaries: LlamaBinaries, env: Mapping[str, str] | None = None,
                 timeout_s: float = DEVICE_LIST_TIMEOUT_S) -> tuple[Device, ...]:
    """The devices ``binaries``' rpc-server exposes; ``env`` adds to this process's environment.

    ProcessError with its output when it lists none (it did not start, or found no device).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((LOOPBACK, 0))
        held.listen()  # its bind fails while we listen here
        port = held.getsockname()[1]
        try:
            result = subprocess.run([str(binaries.rpc_server), "-H", LOOPBACK, "-p", str(port)],
                                    capture_output=True, text=True, errors="replace", timeout=timeout_s,
                                    env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired as exc:
            raise ProcessError(f"{binaries.rpc_server} did not list its devices within {timeout_s:.0f} s: "
                               "its GPU driver may hang; check it with the vendor's tools "
                               "(nvidia-smi, vulkaninfo).") from exc
    devices = parse_device_listing(result.stdout)
    if not devices:
        output = (result.stdout + result.stderr).strip()[-2000:]
        raise ProcessError(f"{binaries.rpc_server} listed no device (exit {result.returncode}):\n{output}\n"
                           "See docs/troubleshooting.md, \"The rpc-server does not list my GPU\".")
    return devices
