"""The API port's access rules: bearer key, no CORS by default, a body size limit.

Against a stand-in llama-server on a real socket that records what reaches it and,
like the real one, answers with ``Access-Control-Allow-Origin: *`` (a real node with ``--api-key``:
tests/integration/test_api_security.py).
"""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from mesh_sidecar.errors import UsageError
from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve.access import MAX_REQUEST_BODY_BYTES, ApiAccess
from mesh_sidecar.serve.metrics import Metrics
from mesh_sidecar.serve.proxy import ApiProxy, ProxyOptions
from tests.helpers.stand_ins import start_stand_in

KEY = "s3cret-key-0123456789"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
ORIGIN = "https://chat.example.org"


@pytest.fixture
async def upstream():
    """A stand-in llama-server: answers everything with 200 and records the request headers."""
    seen: list[dict[str, str]] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        await request.read()
        return web.json_response({"choices": [{"message": {"content": "Hello"}}]},
                                 headers={"Access-Control-Allow-Origin": "*",
                                          "Access-Control-Allow-Headers": "*"})

    app = web.Application(client_max_size=4 * MAX_REQUEST_BODY_BYTES)
    app.router.add_route("*", "/{tail:.*}", anything)
    runner, url = await start_stand_in(app)
    yield url, seen
    await runner.cleanup()


async def _proxy(upstream_url: str, access: ApiAccess):
    proxy = ApiProxy(Metrics(lambda: ()), ProxyOptions(access=access))
    port = free_tcp_port()
    await proxy.start(port)
    proxy.serve(upstream_url)
    return proxy, f"http://127.0.0.1:{port}"


@pytest.fixture
async def keyed(upstream):
    url, seen = upstream
    proxy, base = await _proxy(url, ApiAccess(api_key=KEY))
    yield base, seen
    await proxy.close()


@pytest.fixture
async def open_proxy(upstream):
    url, seen = upstream
    proxy, base = await _proxy(url, ApiAccess())
    yield base, seen
    await proxy.close()


def assert_invalid_key(response: httpx.Response) -> None:
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["message"] and KEY not in response.text


async def test_a_request_without_the_key_gets_401_in_openai_format(keyed):
    base, seen = keyed
    async with httpx.AsyncClient() as client:
        assert_invalid_key(await client.post(f"{base}/v1/chat/completions", json=CHAT))
        assert_invalid_key(await client.get(f"{base}/v1/models"))
    assert seen == []  # nothing reached llama-server


@pytest.mark.parametrize("authorization", [f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", f"Basic {KEY}",
                                           KEY, f"Bearer {KEY} {KEY}", "Bearer ключ".encode()])
async def test_a_wrong_key_gets_401(keyed, authorization):
    base, seen = keyed
    async with httpx.AsyncClient() as client:
        assert_invalid_key(await client.post(f"{base}/v1/chat/completions", json=CHAT,
                                             headers={"Authorization": authorization}))
    assert seen == []


async def test_the_right_key_is_forwarded_without_the_authorization_header(keyed):
    base, seen = keyed
    async with httpx.AsyncClient() as client:
        for authorization in (f"Bearer {KEY}", f"bearer {KEY}"):
            response = await client.post(f"{base}/v1/chat/completions", json=CHAT,
                                         headers={"Authorization": authorization})
            assert response.status_code == 200 and response.json()["choices"]
    assert len(seen) == 2
    assert all("authorization" not in {name.lower() for name in headers} for headers in seen)


async def test_health_is_open_and_metrics_need_the_key(keyed):
    base, _ = keyed
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{base}/health")).status_code == 200
        assert_invalid_key(await client.get(f"{base}/metrics"))
        metrics = await client.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert metrics.status_code == 200 and "mesh_" in metrics.text
        assert_invalid_key(await client.get(f"{base}/no-such-path"))  # unknown paths reveal nothing either


async def test_without_a_key_configured_no_header_is_needed(open_proxy):
    base, seen = open_proxy
    async with httpx.AsyncClient() as client:
        assert (await client.post(f"{base}/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await client.get(f"{base}/metrics")).status_code == 200
        # A stray key is not passed on either.
        await client.post(f"{base}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer x"})
    assert all("authorization" not in {name.lower() for name in headers} for headers in seen)


def assert_no_cors(response: httpx.Response) -> None:
    assert not [name for name in response.headers if name.lower().startswith("access-control-")]


async def test_no_cors_headers_by_default_even_when_llama_server_sends_them(open_proxy, keyed):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    async with httpx.AsyncClient() as client:
        for base, _ in (open_proxy, keyed):
            assert_no_cors(await client.options(f"{base}/v1/chat/completions", headers=preflight))
            response = await client.post(f"{base}/v1/chat/completions", json=CHAT,
                                         headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
            assert response.status_code == 200
            assert_no_cors(response)
            assert_no_cors(await client.get(f"{base}/health", headers={"Origin": ORIGIN}))


async def test_an_allowed_origin_gets_a_preflight_and_only_it(upstream):
    url, _ = upstream
    proxy, base = await _proxy(url, ApiAccess(api_key=KEY, cors_origin=ORIGIN))
    try:
        async with httpx.AsyncClient() as client:
            preflight = await client.options(f"{base}/v1/chat/completions", headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
            assert preflight.status_code == 204  # answered without the key, as browsers send none
            assert preflight.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert "Authorization" in preflight.headers["Access-Control-Allow-Headers"]
            response = await client.post(f"{base}/v1/chat/completions", json=CHAT,
                                         headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
            assert response.headers["Access-Control-Allow-Origin"] == ORIGIN  # not llama-server's "*"
            assert "Access-Control-Allow-Headers" not in response.headers
            other = await client.options(f"{base}/v1/chat/completions", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            assert_invalid_key(other)
            assert_no_cors(other)
    finally:
        await proxy.close()


async def test_a_body_over_the_limit_gets_413_in_openai_format(open_proxy):
    base, seen = open_proxy
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{base}/v1/chat/completions", content=b"x" * (MAX_REQUEST_BODY_BYTES + 1),
                                     headers={"Content-Type": "application/json"})
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
        # Just under the limit still passes.
        near = await client.post(f"{base}/v1/embeddings", content=b"x" * MAX_REQUEST_BODY_BYTES)
        assert near.status_code == 200
    assert len(seen) == 1


def test_the_key_is_checked_and_never_shown():
    assert KEY not in repr(ApiAccess(api_key=KEY))
    for bad in ("", "has space", "ключ", "tab\there"):
        with pytest.raises(UsageError):
            ApiAccess(api_key=bad)
