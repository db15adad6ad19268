"""The chat page: its paths, what is keyless, what of /props the page gets, the model put in a chat, and its routes
on the API proxy (the page in a real browser on a real mesh is in tests/integration/test_chat_page.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve import dashboard
from mesh_sidecar.serve.access import ApiAccess
from mesh_sidecar.serve.chat_page import UI_FILES, UI_PAGE, is_keyless, props_for, split_chat_path, with_model
from mesh_sidecar.serve.metrics import Metrics
from mesh_sidecar.serve.proxy import ApiProxy, ProxyOptions


def test_a_chat_path_names_its_model_percent_encoded():
    assert split_chat_path("/chat/tiny/props") == ("tiny", "/props")
    assert split_chat_path("/chat/user%2Frepo%3AQ4_K_M/v1/chat/completions") == ("user/repo:Q4_K_M",
                                                                                  "/v1/chat/completions")
    assert split_chat_path("/chat/tiny") == ("tiny", "")
    assert split_chat_path("/chat//props") is None
    assert split_chat_path("/v1/models") is None


def test_only_the_pages_and_their_files_are_keyless():
    assert is_keyless("/") and is_keyless("/chat.js")
    assert is_keyless("/chat/tiny/") and is_keyless("/chat/tiny")
    for name in UI_FILES:
        assert is_keyless(f"/chat/tiny/{name}")
    for keyed in ("/chat/tiny/props", "/chat/tiny/v1/models", "/chat/tiny/v1/chat/completions", "/chat/tiny/slots",
                  "/chat/tiny/../v1/models", "/chat.js/x", "/props"):
        assert not is_keyless(keyed), keyed


def test_props_keep_what_the_page_reads_and_name_the_model_by_its_id():
    props = {"model_path": "/home/me/models/tiny.gguf", "model_alias": "/home/me/models/tiny.gguf",
             "total_slots": 4, "modalities": {"vision": False}, "role": "model", "endpoint_slots": True,
             "default_generation_settings": {"n_ctx": 2048, "prompt": "someone else's", "next_token": {},
                                             "params": {"temperature": 0.8}},
             "api_key": "secret", "is_sleeping": False}
    shown = props_for("tiny", props)
    assert shown["model_path"] == shown["model_alias"] == "tiny"
    assert shown["default_generation_settings"] == {"n_ctx": 2048, "params": {"temperature": 0.8}}
    assert shown["endpoint_slots"] is False and shown["total_slots"] == 4
    assert "/home/me" not in json.dumps(shown) and "secret" not in json.dumps(shown)


def test_a_chat_names_the_chosen_model():
    assert json.loads(with_model(b'{"messages": [], "model": "other"}', "tiny")) == {"messages": [], "model": "tiny"}
    assert with_model(b"[1]", "tiny") is None and with_model(b"{", "tiny") is None


# --- the routes on the API proxy, on a real loopback socket (with a mesh: tests/integration/test_chat_page.py) --

KEY = "chat-key-0123456789"
KEYED = {"Authorization": f"Bearer {KEY}"}
CHAT = "/chat/tiny"


@pytest.fixture
async def keyed_proxy():
    proxy = ApiProxy(Metrics(list), ProxyOptions(access=ApiAccess(api_key=KEY)))
    port = free_tcp_port()
    await proxy.start(port)
    yield f"http://127.0.0.1:{port}"
    await proxy.close()


async def test_the_pages_and_files_are_keyless_and_the_data_wants_the_key(keyed_proxy):
    async with httpx.AsyncClient(base_url=keyed_proxy) as client:
        chooser = await client.get("/")
        assert chooser.status_code == 200 and 'href="/mesh"' in chooser.text  # and back to the dashboard
        assert (await client.get("/chat.js")).status_code == 200
        assert (await client.get(CHAT)).headers["Location"] == f"{CHAT}/"  # relative URLs need the slash
        if UI_PAGE not in UI_FILES:
            pytest.skip("mesh_sidecar/serve/chat/ui/ holds no page: run scripts/build_chat_ui.sh")
        page = await client.get(f"{CHAT}/")  # httpx asks for gzip and inflates it
        assert page.status_code == 200 and page.headers["Content-Encoding"] == "gzip" and "<html" in page.text
        plain = await client.get(f"{CHAT}/{UI_PAGE}", headers={"Accept-Encoding": "identity"})
        assert "Content-Encoding" not in plain.headers and plain.text == page.text
        for name in UI_FILES:
            assert (await client.get(f"{CHAT}/{name}")).status_code == 200, name

        for path in ("props", "v1/models", "tools", "slots"):
            assert (await client.get(f"{CHAT}/{path}")).status_code == 401, path
        for path in ("v1/chat/completions", "v1/streams/lookup"):
            assert (await client.post(f"{CHAT}/{path}", json={})).status_code == 401, path
        # With the key: tools off as on llama-server without --tools, no stream to resume, no /slots.
        tools = await client.get(f"{CHAT}/tools", headers=KEYED)
        assert tools.status_code == 403 and tools.json()["error"]["type"] == "feature_disabled"
        lookup = await client.post(f"{CHAT}/v1/streams/lookup", json={"conversation_ids": ["c"]}, headers=KEYED)
        assert lookup.status_code == 200 and lookup.json() == []
        assert (await client.get(f"{CHAT}/slots", headers=KEYED)).status_code == 404
        assert (await client.get("/props", headers=KEYED)).status_code == 404  # a member's forwarded only


def test_the_dashboard_links_to_the_chat_page():
    assert 'href="/"' in (Path(dashboard.__file__).parent / "dashboard" / "index.html").read_text()
