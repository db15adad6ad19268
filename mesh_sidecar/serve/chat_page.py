"""The chat page on the API port: ``http://localhost:<api port>/``, llama-server's own web UI for any model of the mesh.

Routes, added to the API proxy's aiohttp app by ``add_routes``::

    GET  /                                       the chooser: the mesh's models, each a link    keyless, no data
    GET  /chat.js                                its script (reads /v1/models with the key)     keyless
    GET  /chat/<model>/                          llama-server's page for <model>               keyless, no data
    GET  /chat/<model>/<file>                    its files (script, icons, manifest)           keyless
    GET  /chat/<model>/props                     the serving llama-server's /props, filtered   wants the key
    GET  /chat/<model>/v1/models                 <model>'s /v1/models entry                    wants the key
    POST /chat/<model>/v1/chat/completions       a chat, <model> put in its body               wants the key
    GET|POST /chat/<model>/tools                 403, as llama-server without --tools          wants the key
    POST /chat/<model>/v1/streams/lookup         [] (no stream is kept to resume)              wants the key
    anything else under /chat/<model>/           404: /slots (other users' prompts), stream
                                                 resumption, model loading are not served

Why this shape. The pinned build compiles llama-server without its UI (``-DLLAMA_BUILD_UI=OFF``:
building it takes npm and ~1000 packages), so the page's files come from us: ``chat/ui/`` holds
llama.cpp's UI built from the pinned source (``scripts/build_chat_ui.sh``), gzipped, served as
they are. Every URL that page asks for is relative to its own location (``./props``,
``./v1/chat/completions``, ``${base}/v1/models``), so served under ``/chat/<model>/`` all of them
come back under that prefix and name the model chosen: no cookie, no query, and two tabs can talk
to two models. Its requests then go through the proxy like any API request (``forward``), so
routing by model, holds, failover, the key and the body limit are the API's own; a member that
serves nothing shows the page and its chats go to the member serving the model. ``/props`` is
asked of the serving llama-server (over the mesh when it is a member's: its API answers
``/props`` to forwarded requests only) and only the fields the page uses come back, the model's
path replaced by its id: nothing the API did not already tell.

The page keeps its API key in its own settings and sends it as ``Authorization: Bearer``; the
chooser puts there the key it was given, once this node admitted it, so the key is typed once.
Only the script rebuilding ``chat/ui/`` needs npm: the files are committed, so installs, tests and
CI need neither npm nor the network.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from aiohttp import web

from ..wire.api_forward import openai_error_body
from .dashboard import PAGE_HEADERS

CHOOSER_PATH = "/"
CHOOSER_SCRIPT_PATH = "/chat.js"
CHAT_PREFIX = "/chat/"
PROPS_PATH = "/props"
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
TOOLS_PATH = "/tools"  # llama-server's --tools (files, shell): never run for the mesh
STREAMS_LOOKUP_PATH = "/v1/streams/lookup"  # the page asks which of its streams it can resume
ASSET_DIR = Path(__file__).parent / "chat"
UI_DIR = ASSET_DIR / "ui"  # llama.cpp's UI as built, each file gzipped (NAME.gz)
UI_PAGE = "index.html"
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".json": "application/json",
                 ".webmanifest": "application/manifest+json", ".png": "image/png", ".svg": "image/svg+xml",
                 ".ico": "image/x-icon", ".txt": "text/plain", ".woff2": "font/woff2"}
# The fields of llama-server's /props the page reads; the rest (its file paths, the slot's last prompt) stay there.
PROPS_FIELDS = ("default_generation_settings", "total_slots", "modalities", "chat_template", "chat_template_caps",
                "bos_token", "eos_token", "build_info", "model_ftype", "media_marker", "ui_settings")
SETTINGS_KEPT_OUT = ("prompt", "next_token")
# The page is llama.cpp's: it runs inline scripts and styles, loads data: images and fonts and talks only to this port.
# No worker: its service worker (left out of the build) would cache API answers; the page logs the refusal, goes on.
UI_HEADERS = {
    "Content-Security-Policy": ("default-src 'self'; script-src 'self' 'unsafe-inline' 'wasm-unsafe-eval'; "
                                "style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; font-src 'self' data:; "
                                "connect-src 'self'; worker-src 'none'; base-uri 'self'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

Forward = Callable[[web.Request, bytes], Awaitable[web.StreamResponse]]


def split_chat_path(raw_path: str) -> tuple[str, str] | None:
    """``/chat/<model>/<rest>`` (raw, percent-encoded) as (model, "/<rest>"); None for another path or no model."""
    if not raw_path.startswith(CHAT_PREFIX):
        return None
    encoded, slash, rest = raw_path[len(CHAT_PREFIX):].partition("/")
    model = unquote(encoded)
    if not model:
        return None
    return model, slash + rest


def ui_files(directory: Path = UI_DIR) -> frozenset[str]:
    """The UI's file names (without ``.gz``): served by exact name only, so "keyless" reaches no other file."""
    return (frozenset(path.relative_to(directory).as_posix()[:-3] for path in directory.rglob("*.gz"))
            if directory.is_dir() else frozenset())


UI_FILES = ui_files()


def is_keyless(raw_path: str) -> bool:
    """Whether a path is the chooser or a file of the page (they hold no data); the proxy's guard asks."""
    if raw_path in (CHOOSER_PATH, CHOOSER_SCRIPT_PATH):
        return True
    parts = split_chat_path(raw_path)
    return parts is not None and (parts[1] in ("", "/") or parts[1][1:] in UI_FILES)


def props_for(model: str, props: dict[str, Any]) -> dict[str, Any]:
    """What the page gets of llama-server's /props: the fields it uses, the model named by its mesh id."""
    kept = {key: props[key] for key in PROPS_FIELDS if key in props}
    settings = kept.get("default_generation_settings")
    if isinstance(settings, dict):
        kept["default_generation_settings"] = {k: v for k, v in settings.items() if k not in SETTINGS_KEPT_OUT}
    return {**kept, "model_path": model, "model_alias": model, "role": "model", "endpoint_slots": False,
            "endpoint_props": False, "endpoint_metrics": False, "cors_proxy_enabled": False}


def with_model(body: bytes, model: str) -> bytes | None:
    """A chat request's body naming ``model`` (the page names none in its model mode); None: not a JSON object."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    return json.dumps({**request, "model": model}).encode()


def _json_of(response: web.StreamResponse) -> Any:
    """The JSON a whole answer holds (the proxy answers /props and /v1/models whole); None when it holds none."""
    if response.status != 200 or not isinstance(response, web.Response) or not isinstance(response.body, bytes):
        return None
    try:
        return json.loads(response.body)
    except ValueError:
        return None


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(openai_error_body(message, "invalid_request_error", code), status=status)


def add_routes(app: web.Application, forward: Forward) -> None:
    """Serve the chat page on ``app``; ``forward(request, body)`` answers an API request as the proxy does."""
    chooser = (ASSET_DIR / "index.html").read_bytes()
    chooser_script = (ASSET_DIR / "chat.js").read_bytes()
    ui = {name: (UI_DIR / f"{name}.gz").read_bytes() for name in UI_FILES}

    async def serve_chooser(request: web.Request) -> web.Response:
        return web.Response(body=chooser, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS)

    async def serve_chooser_script(request: web.Request) -> web.Response:
        return web.Response(body=chooser_script, content_type="text/javascript", charset="utf-8",
                            headers=PAGE_HEADERS)

    def ui_file(name: str, request: web.Request) -> web.Response:
        content_type = CONTENT_TYPES.get(Path(name).suffix, "application/octet-stream")
        headers = {**UI_HEADERS, "Vary": "Accept-Encoding"}
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(body=ui[name], content_type=content_type,
                                headers={**headers, "Content-Encoding": "gzip"})
        return web.Response(body=gzip.decompress(ui[name]), content_type=content_type, headers=headers)

    async def serve_chat(request: web.Request) -> web.StreamResponse:
        parts = split_chat_path(request.rel_url.raw_path)
        if parts is None:
            raise web.HTTPNotFound()
        model, rest = parts
        if rest == "":
            raise web.HTTPFound(request.rel_url.raw_path + "/")  # the page's relative URLs need the slash
        if rest == "/" and UI_PAGE in UI_FILES:
            return ui_file(UI_PAGE, request)
        if rest[1:] in UI_FILES and request.method == "GET":
            return ui_file(rest[1:], request)
        if rest == PROPS_PATH and request.method == "GET":
            answer = await forward(request.clone(rel_url=PROPS_PATH), json.dumps({"model": model}).encode())
            props = _json_of(answer)
            return web.json_response(props_for(model, props)) if isinstance(props, dict) else answer
        if rest == MODELS_PATH and request.method == "GET":
            answer = await forward(request.clone(rel_url=MODELS_PATH), b"")
            listed = _json_of(answer)
            if not isinstance(listed, dict):
                return answer
            entries = [entry for entry in listed.get("data", []) if entry.get("id") == model]
            return web.json_response({**listed, "data": entries})
        if rest == CHAT_PATH and request.method == "POST":
            chat = request.clone(rel_url=CHAT_PATH)  # aiohttp clones only a request not read yet
            body = with_model(await request.read(), model)
            if body is None:
                return _error(400, "The request body is not a JSON object.", "invalid_json")
            return await forward(chat, body)
        if rest == TOOLS_PATH:
            # The page reads a 403 as "tools are off" and chats without them, as with llama-server's own default.
            return web.json_response({"error": {"message": "this feature is disabled", "type": "feature_disabled"}},
                                     status=403)
        if rest == STREAMS_LOOKUP_PATH and request.method == "POST":
            return web.json_response([])  # the proxy keeps no stream to resume; a 404 would be logged as a fault
        return _error(404, f"The chat page does not serve {rest}.", "not_found")

    app.router.add_get(CHOOSER_PATH, serve_chooser)
    app.router.add_get(CHOOSER_SCRIPT_PATH, serve_chooser_script)
    app.router.add_route("*", CHAT_PREFIX + "{tail:.*}", serve_chat)

