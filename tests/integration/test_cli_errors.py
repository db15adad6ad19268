"""Bad input gets one clear error line and a non-zero exit, before anything starts."""

from __future__ import annotations

import socket
from pathlib import Path

from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.wire.ticket import PeerAddress, Ticket, encode_ticket
from tests.helpers.nodes import cli


def assert_clean_error(result, *phrases: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error:"), result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


def test_missing_model(tmp_path: Path) -> None:
    result = cli("--home", str(tmp_path), "--model", str(tmp_path / "nope.gguf"))
    assert_clean_error(result, "does not exist", "nope.gguf")


def test_non_gguf_model(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model\n")
    result = cli("--home", str(tmp_path), "--model", str(fake))
    assert_clean_error(result, "is not a GGUF model")


def test_llama_bin_without_binaries(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "llama-server").chmod(0o755)
    result = cli("--home", str(tmp_path), "--llama-bin", str(tmp_path / "bin"))
    assert_clean_error(result, "ggml-rpc-server", "--llama-bin")
    assert "no executable ggml-rpc-server" in result.stderr


def test_llama_bin_from_environment(tmp_path: Path) -> None:
    result = cli("setup", env={"MESH_LLAMA_BIN": str(tmp_path)})
    assert_clean_error(result, "ggml-rpc-server or llama-server")


def test_plan_by_takes_speed_or_memory(tmp_path: Path) -> None:
    result = cli("--home", str(tmp_path), "--serve", str(free_tcp_port()), "--plan-by", "fast")
    assert_clean_error(result, "--plan-by takes 'speed' or 'memory'", "'fast'")


def test_serve_port_taken(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = cli("--home", str(tmp_path), "--serve", str(port))
    assert_clean_error(result, f"Port {port}", "already in use")


def test_status_without_a_node(tmp_path: Path) -> None:
    result = cli("status", "--home", str(tmp_path))
    assert_clean_error(result, "No node is running")


def test_malformed_ticket(tmp_path: Path) -> None:
    result = cli("--home", str(tmp_path), "--join", "meshinf-not-a-ticket!")
    assert_clean_error(result, "ticket")


def test_truncated_ticket(tmp_path: Path) -> None:
    whole = encode_ticket(Ticket(b"\x01" * 32, b"\x02" * 32, (PeerAddress("127.0.0.1", 47470),)))
    result = cli("--home", str(tmp_path), "--join", whole[:-20])
    assert_clean_error(result, "truncated")


def test_brackets_in_a_message_are_printed_as_they_are(tmp_path: Path) -> None:
    """An IPv6 address ("[fd00::2]:47470") or any bracketed text must survive the error printer."""
    result = cli("--home", str(tmp_path), "--max-memory", "[fd00::2]:4G")
    assert result.returncode == 1
    assert "[fd00::2]:4G" in result.stderr


def test_cache_type_llama_cpp_does_not_know(tmp_path: Path) -> None:
    result = cli("--home", str(tmp_path), "--cache-type-v", "q8")
    assert_clean_error(result, "--cache-type-v takes one of", "q8_0, q4_0", "not 'q8'")


def test_cache_type_on_a_worker(tmp_path: Path) -> None:
    result = cli("--home", str(tmp_path), "--cache-type-k", "q8_0")
    assert_clean_error(result, "serving node only", "--serve PORT")


def test_devices_llama_cpp_could_not_name(tmp_path: Path) -> None:
    result = cli("--home", str(tmp_path), "--devices", "Vulkan 0,CPU")
    assert_clean_error(result, "--devices takes distinct device names", "Vulkan0,CPU")


def test_a_device_the_rpc_server_does_not_have(tmp_path: Path) -> None:
    result = cli("--home", str(tmp_path), "--no-mdns", "--port", "0", "--devices", "CUDA7")
    assert_clean_error(result, "--devices CUDA7: this rpc-server has no such device; it has: CPU")
