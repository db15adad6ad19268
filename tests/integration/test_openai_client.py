"""The `openai` Python package, unchanged, against a two-node mesh: chat, streaming, models.list."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.nodes import TICKET_LINE
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

API_KEY = "test-key-7f3a"


def test_openai_client_chat_stream_and_models(start_node, model_path):
    server = start_node("server", "--min-peers", "1", "--api-key", API_KEY, serve=True, wait=False)
    ticket = wait_until(lambda: TICKET_LINE.search(server.text()), 60, "the server's ticket").group(1)
    start_node("worker", "--join", ticket)
    server.wait_ready()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.serve_port}/v1", api_key=API_KEY)

    models = client.models.list()
    assert [m.id for m in models.data] == [model_path.stem]

    messages = [{"role": "user", "content": "Name one primary color."}]
    reply = client.chat.completions.create(model=model_path.stem, messages=messages, max_tokens=16,
                                           temperature=0, seed=42)
    text = reply.choices[0].message.content
    assert text and reply.usage.completion_tokens > 0

    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=model_path.stem, messages=messages, max_tokens=16, temperature=0, seed=42, stream=True)
        if chunk.choices]
    assert "".join(pieces) == text  # greedy: the stream says the same

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong").models.list()
