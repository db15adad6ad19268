"""The chat page at ``/`` on a member that serves nothing, with real processes: its routes reach the serving
member's llama-server over the mesh with the key, and llama-server's own page, in Chromium, answers a message.

    server   serves SmolLM2-135M alone; the API wants a key
    member   joins and serves nothing: every request of the page is forwarded to the server
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from mesh_sidecar.serve.chat_page import UI_FILES
from tests.helpers.browser import chromium
from tests.helpers.mesh_api import listed_models
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

KEY = "chat-key-2718"
KEYED = {"Authorization": f"Bearer {KEY}"}
READY_TIMEOUT_S = 120.0
MAX_TOKENS = 48
SCREENSHOT = Path(__file__).resolve().parents[2] / "test-artifacts" / "chat.png"


@pytest.fixture
def member_of_a_served_mesh(start_node, model_path):
    """(the member's API port, the model's id) once the member lists the server's model as ready."""
    server = start_node("server", "--api-key", KEY, serve=True, spread=False)
    member = start_node("member", "--join", server.ticket(), "--api-key", KEY)
    model = model_path.stem
    wait_until(lambda: listed_models(member.api_port, KEYED).get(model, {}).get("status") == "ready",
               READY_TIMEOUT_S, "the member lists the server's model as ready")
    return member.api_port, model


def test_the_page_routes_reach_the_serving_member_with_the_key(member_of_a_served_mesh):
    port, model = member_of_a_served_mesh
    base = f"http://127.0.0.1:{port}"
    chat = f"{base}/chat/{quote(model, safe='')}"
    with httpx.Client(timeout=120) as client:
        assert client.get(f"{base}/").status_code == 200  # the chooser: keyless, it holds no data
        assert client.get(f"{base}/chat.js").status_code == 200
        assert client.get(chat).status_code == 302  # the page's relative URLs need the slash
        if "index.html" in UI_FILES:  # built by scripts/build_chat_ui.sh
            page = client.get(f"{chat}/")
            assert page.status_code == 200 and "<html" in page.text.lower()
        for keyed in ("props", "v1/models"):
            assert client.get(f"{chat}/{keyed}").status_code == 401
        assert client.post(f"{chat}/v1/chat/completions", json={"messages": []}).status_code == 401

        props = client.get(f"{chat}/props", headers=KEYED)
        assert props.status_code == 200, props.text
        shown = props.json()
        assert shown["model_path"] == model and shown["role"] == "model"
        assert shown["default_generation_settings"]["n_ctx"] > 0
        assert "/" not in json.dumps(shown["model_path"]) and ".cache" not in props.text
        listed = client.get(f"{chat}/v1/models", headers=KEYED).json()
        assert [entry["id"] for entry in listed["data"]] == [model]

        # llama-server's own endpoints are not the API's: not to clients, nor under the page.
        assert client.get(f"{base}/props", headers=KEYED).status_code == 404
        assert client.get(f"{chat}/slots", headers=KEYED).status_code == 404

        body = {"messages": [{"role": "user", "content": "Say hello."}], "stream": True, "max_tokens": 8,
                "temperature": 0}  # no model: the page's model mode names none
        text = ""
        with client.stream("POST", f"{chat}/v1/chat/completions", json=body, headers=KEYED) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
        assert text.strip()


def streamed_text(sse: str) -> str:
    """The assistant's text an OpenAI chat stream carried."""
    return "".join(choice["delta"].get("content") or "" for line in sse.splitlines() if line.startswith("data: {")
                   for choice in json.loads(line[6:])["choices"])


def test_llama_servers_page_answers_a_message_in_chromium(member_of_a_served_mesh, tmp_path):
    if "index.html" not in UI_FILES:
        pytest.skip("mesh_sidecar/serve/chat/ui/ holds no page: run scripts/build_chat_ui.sh")
    port, model = member_of_a_served_mesh
    with chromium(tmp_path / "chromium-profile", height=900) as browser:
        page = browser.new_page()
        refused: list[str] = []  # what the page asked for and was refused, but what it may do without
        page.on("response", lambda r: refused.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        # The member serves nothing; its chooser asks for the key, then lists the server's model.
        page.goto(f"http://127.0.0.1:{port}/")
        # The page asks for no limit (it stops at the context's end: minutes on a CPU, should the model
        # not stop); a limit set in its settings, which the chooser keeps when it hands over the key.
        page.evaluate("limit => localStorage.setItem('LlamaCppWebui.config', JSON.stringify({max_tokens: limit}))",
                      MAX_TOKENS)
        page.locator("#key-input").fill(KEY)
        page.locator("#key-form button[type=submit]").click()
        page.locator(f"a[data-model='{model}']").click()
        page.wait_for_url(f"**/chat/{quote(model, safe='')}/")
        box = page.locator("textarea").first
        box.wait_for(timeout=30_000)
        box.fill("Say hello.")
        with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions"), timeout=60_000) as sent:
            box.press("Enter")
        answer = sent.value
        assert answer.status == 200 and answer.headers["content-type"].startswith("text/event-stream")
        assert answer.request.headers.get("authorization") == f"Bearer {KEY}"  # the key the chooser took
        sent_body = json.loads(answer.request.post_data or "{}")
        assert sent_body["messages"][-1]["content"] == "Say hello." and sent_body["max_tokens"] == MAX_TOKENS
        assert answer.finished() is None, "the stream ended with an error"
        text = streamed_text(answer.text())
        assert text.strip(), "the model's answer was empty"
        # The page shows the streamed answer (its markdown rendered: compared word by word).
        words = text.split()
        page.wait_for_function(
            "words => [...document.querySelectorAll('.markdown-content, .prose')].some(e => {"
            " const shown = e.textContent.split(/\\s+/).join(' ');"
            " return words.every(w => shown.includes(w.replace(/[*_`#]/g, ''))); })",
            arg=words, timeout=60_000)
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        # A 401 under /chat/ would mean the key did not reach llama.cpp's page (the chooser's first
        # /v1/models is one: it asks for the key); a 403 is /tools, which the page does without.
        assert not [line for line in refused if line.startswith("401") and "/chat/" in line], refused
