"""The chat page's pure parts: its paths, what is keyless, what of /props the page gets, the model put in a chat."""

from __future__ import annotations

import json

from mesh_sidecar.serve.chat_page import UI_FILES, is_keyless, props_for, split_chat_path, with_model


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
