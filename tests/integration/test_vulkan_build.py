"""The Vulkan build of the pinned llama.cpp on a real Vulkan device: Mesa's llvmpipe (a Vulkan device in
software) on a machine without a GPU, the GPU on one with it. Its rpc-server lists the device, and plain
llama-server with every layer on it answers a greedy request.

Skipped when the Vulkan build is not in the cache: `mesh-inference setup --backend vulkan` makes it
(scripts/test.sh does, once the Vulkan packages are there); never here, it takes minutes. llvmpipe is a
CPU-type device, which ggml's Vulkan backend skips unless GGML_VK_VISIBLE_DEVICES names it.
"""

from __future__ import annotations

import re

import httpx
import pytest

from mesh_sidecar.llama.backends import VULKAN
from mesh_sidecar.llama.build import BUILD_STAMP_NAME, STOCK, LlamaBinaries, binaries_in, pinned_build_dir
from mesh_sidecar.llama.devices import list_devices
from tests.helpers.llama import GREEDY, PROMPT, complete, plain_llama_server_answer
from tests.helpers.llama_buffers import (
    RpcServer,
    answer_over_tcp,
    check_plan_against_llama_cpp,
    served_by_one_llama_server,
)
from tests.helpers.nodes import cli
from tests.helpers.waiting import wait_until

VISIBLE_DEVICE = {"GGML_VK_VISIBLE_DEVICES": "0"}
# Every layer on the device; verbosity 4 logs where each buffer went.
ON_THE_DEVICE = ("-ngl", "99", "-lv", "4")


@pytest.fixture(scope="module")
def vulkan_binaries() -> LlamaBinaries:
    bin_dir = pinned_build_dir(STOCK.on(VULKAN)) / "bin"
    if not (bin_dir / BUILD_STAMP_NAME).exists():
        pytest.skip(f"no Vulkan build in {bin_dir.parent}: `mesh-inference setup --backend vulkan` makes it "
                    "(scripts/test.sh does when mesa-vulkan-drivers, libvulkan-dev, glslc and spirv-headers "
                    "are installed)")
    return binaries_in(bin_dir)


@pytest.mark.slow
def test_rpc_server_lists_the_vulkan_device(vulkan_binaries) -> None:
    devices = list_devices(vulkan_binaries, VISIBLE_DEVICE)
    # The GPU alone: rpc-server offers the CPU only when there is no other device.
    assert [d.name for d in devices] == ["Vulkan0"], devices
    assert 0 < devices[0].free_bytes <= devices[0].total_bytes
    if "llvmpipe" in devices[0].description:
        # What the troubleshooting page says: without the variable, ggml skips the software device.
        assert [d.name for d in list_devices(vulkan_binaries)] == ["CPU"]


@pytest.mark.slow
def test_llama_server_answers_on_the_vulkan_device(vulkan_binaries, model_path, tmp_path) -> None:
    text = plain_llama_server_answer(vulkan_binaries, model_path, tmp_path, complete, args=ON_THE_DEVICE,
                                     env=VISIBLE_DEVICE)
    assert text.strip()  # complete() checked the token count
    log = (tmp_path / "plain.log").read_text()
    assert re.search(r"offloaded (\d+)/\1 layers to GPU", log), log[-3000:]
    assert re.search(r"Vulkan0 model buffer size = +\d", log), log[-3000:]


@pytest.mark.slow
def test_a_vulkan_member_announces_its_device_in_gossip(start_node, vulkan_binaries) -> None:
    """A CPU node and a node on the Vulkan build: each sees the other's devices (status, gossip)."""
    cpu_node = start_node("a")
    gpu_node = start_node("b", "--join", cpu_node.ticket(), "--llama-bin", str(vulkan_binaries.directory),
                          env=VISIBLE_DEVICE)
    own = gpu_node.status()["node"]
    assert own["backend"] == "vulkan" and [d["name"] for d in own["devices"]] == ["Vulkan0"]
    assert cpu_node.status()["node"]["backend"] == "cpu"
    wait_until(lambda: any(p["name"] == "b" and p["devices"] for p in cpu_node.status()["peers"]), 30,
               "a hears b's devices")
    (seen,) = [p["devices"] for p in cpu_node.status()["peers"] if p["name"] == "b"]
    fields = ("name", "total_bytes", "free_bytes", "decode_bytes_per_s", "prefill_bytes_per_s")
    assert seen == [{k: d[k] for k in fields} for d in own["devices"]]
    assert "Vulkan0" in cli("status", "--home", str(cpu_node.home), "--wide", env={"COLUMNS": "300"}).stdout


@pytest.mark.slow
def test_a_mixed_mesh_gives_the_text_of_llama_servers_own_rpc_with_the_same_split(start_node, binaries,
                                                                                   vulkan_binaries, tmp_path):
    """A CPU worker, a worker on the Vulkan device and a serving node: planned per device, and the same greedy
    text as llama-server's --rpc over plain TCP with the same builds, devices and split."""
    a = start_node("a")
    start_node("b", "--join", a.ticket(), "--llama-bin", str(vulkan_binaries.directory), env=VISIBLE_DEVICE)
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", serve=True)
    served = served_by_one_llama_server(c, lambda: complete(c.serve_port))
    plan = served.plan
    assert sorted((n["name"], n["device"]) for n in plan["nodes"]) == [("a", "CPU"), ("b", "Vulkan0"), ("c", "CPU")]
    speed = httpx.post(f"http://127.0.0.1:{c.serve_port}/v1/completions", timeout=300,
                       json={"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, **GREEDY}).json()["timings"]
    print(f"\nmixed mesh decode: {speed['predicted_per_second']:.1f} tok/s (64 tokens)")
    check_plan_against_llama_cpp(plan, served.argv, open(served.log).read())
    servers = {"a": RpcServer(binaries), "b": RpcServer(vulkan_binaries, VISIBLE_DEVICE), "c": RpcServer(binaries)}
    reference = answer_over_tcp(served.argv, [servers[n["name"]] for n in plan["nodes"]], tmp_path, complete)
    assert served.answer == reference


@pytest.mark.slow
def test_a_worker_offering_two_devices_is_planned_as_two(start_node, binaries, vulkan_binaries, tmp_path):
    """The Vulkan worker offers its GPU and its CPU (--devices Vulkan0,CPU): two devices in the plan, one
    rpc-server in --rpc, and the text of llama-server's own --rpc with that rpc-server and split."""
    b = start_node("b", "--llama-bin", str(vulkan_binaries.directory), "--devices", "Vulkan0,CPU",
                   "--max-memory", "2G", env=VISIBLE_DEVICE)
    assert [d["name"] for d in b.status()["node"]["devices"]] == ["Vulkan0", "CPU"]
    c = start_node("c", "--join", b.ticket(), "--min-peers", "1", serve=True)
    served = served_by_one_llama_server(c, lambda: complete(c.serve_port))
    plan, mesh_argv = served.plan, served.argv
    assert [(n["name"], n["device"]) for n in plan["nodes"]] == [("b", "Vulkan0"), ("b", "CPU"), ("c", "CPU")]
    assert len(mesh_argv[mesh_argv.index("--rpc") + 1].split(",")) == 2  # b's rpc-server once
    assert len(mesh_argv[mesh_argv.index("--tensor-split") + 1].split(",")) == 3  # a weight per device
    check_plan_against_llama_cpp(plan, mesh_argv, open(served.log).read())
    servers = [RpcServer(vulkan_binaries, VISIBLE_DEVICE, ("Vulkan0", "CPU")), RpcServer(binaries)]
    assert served.answer == answer_over_tcp(mesh_argv, servers, tmp_path, complete)
