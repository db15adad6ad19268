"""The decode benchmark's pure parts: the direct setup's argvs, taken from the mesh's."""

import pytest

from benchmarks.report import round_ratios
from benchmarks.setup import LoopbackHost, direct_llama_argv, direct_rpc_argv, host_port


def test_direct_runs_the_meshs_own_llama_server_argv_over_tcp():
    mesh = ["/cache/cuda/bin/llama-server", "-m", "/m.gguf", "--host", "127.0.0.1", "--port", "41234",
            "--rpc", "127.0.0.1:40001,127.0.0.1:40002,127.0.0.1:40003", "-ngl", "999",
            "--tensor-split", "0,3,3,2", "--api-key-file", "/home/c/key", "--cache-ram", "0"]
    direct = direct_llama_argv(mesh, ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"], 8081)
    assert direct == ["/cache/cuda/bin/llama-server", "-m", "/m.gguf", "--host", "127.0.0.1", "--port", "8081",
                      "--rpc", "10.0.0.1:50052,10.0.0.2:50052,10.0.0.3:50052", "-ngl", "999",
                      "--tensor-split", "0,3,3,2", "--cache-ram", "0"]
    assert "--api-key-file" in mesh  # the mesh's own argv is left as it was


def test_direct_rpc_servers_run_the_meshs_own_flags_on_their_host_address():
    mesh = ["/cache/cuda/bin/ggml-rpc-server", "-H", "127.0.0.1", "-p", "40117", "-c", "-d", "CUDA0", "-t", "1"]
    assert direct_rpc_argv(mesh, "10.0.0.2", 50053) == [
        "/cache/cuda/bin/ggml-rpc-server", "-H", "10.0.0.2", "-p", "50053", "-c", "-d", "CUDA0", "-t", "1"]


def test_hosts_on_one_loopback_get_ports_of_their_own():
    assert [host_port(50052, name) for name in "abc"] == [50052, 50053, 50054]
    assert LoopbackHost("a").exec_argv("ss", "-Hltn") == ["ss", "-Hltn"]


def test_each_rounds_ratio_is_taken_within_the_round():
    def reps(*tok_s: float) -> dict:
        return {"reps": [{"tok_s": t} for t in tok_s]}

    ratios = round_ratios(reps(9, 45, 20), reps(10, 50, 40), lambda r: r["tok_s"])
    assert ratios["median"] == pytest.approx(0.9)  # not 20/40: each mesh round against its own direct round
    assert ratios["q1"] <= ratios["median"] <= ratios["q3"]
