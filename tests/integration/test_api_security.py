"""The API key with real processes: read from the environment by the CLI, enforced by a running node."""

from __future__ import annotations

import httpx
import pytest

from mesh_sidecar.ports import free_tcp_port
from tests.helpers.llama import GREEDY
from tests.helpers.nodes import cli
from tests.unit.test_api_security import KEY, assert_invalid_key, assert_no_cors


def test_the_key_can_come_from_the_environment(tmp_path):
    # Checked before anything is built or started, so a bad key fails fast.
    result = cli("--home", str(tmp_path), "--serve", str(free_tcp_port()), env={"MESH_API_KEY": "two words"})
    assert result.returncode == 1 and "MESH_API_KEY" in result.stderr and "two words" not in result.stderr


@pytest.mark.slow
def test_a_node_with_an_api_key_refuses_requests_without_it(start_node):
    node = start_node("keyed", "--api-key", KEY, serve=True)  # /health stays open, so readiness is seen
    url = f"http://127.0.0.1:{node.serve_port}/v1/chat/completions"
    request = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, **GREEDY}
    refused = httpx.post(url, json=request, timeout=30)
    assert_invalid_key(refused)
    answered = httpx.post(url, json=request, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert answered.status_code == 200
    assert answered.json()["choices"][0]["message"]["content"]
    assert_no_cors(answered)  # llama-server's own "Access-Control-Allow-Origin: *" is gone
    assert "requires the API key" in node.text() and KEY not in node.text()
    assert node.status()["api"]["requires_key"] is True
    logs = "".join(path.read_text(errors="replace") for path in (node.home / "logs").glob("*.log"))
    assert KEY not in logs
