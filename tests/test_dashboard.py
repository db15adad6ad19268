"""The /mesh dashboard: its routes and key rule, its live figures, and (slow) the page in a real browser.

The fast tests run the API proxy on a real socket with the dashboard's routes and a
stand-in snapshot; the browser test starts a three-node mesh and drives Debian's
Chromium with Playwright, saving a screenshot to test-artifacts/dashboard.png.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from mesh_sidecar.serve import dashboard
from mesh_sidecar.serve.dashboard import (KEYLESS_PATHS, PAGE_PATH, STATE_PATH, TICKET_PLACEHOLDER, RecentEvents,
                                    TokenRate)
from mesh_sidecar.mesh.health import HealthState
from mesh_sidecar.mesh.membership import MemberState
from mesh_sidecar.mesh.status import PeerView, peers_json
from mesh_sidecar.serve.metrics import Metrics
from mesh_sidecar.serve.supervisor import PlanAnnouncement
from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve.access import ApiAccess
from mesh_sidecar.serve.proxy import ApiProxy
from tests.conftest import TICKET_LINE
from tests.waiting import wait_until

KEY = "dash-key-0123456789"
TICKET = "meshinfabcdefghijklmnopqrstuvwxyz234567"
SERVER_ID, WORKER_ID = "aa" * 32, "bb" * 32


WORKER = PeerView(node_id=bytes.fromhex(WORKER_ID), name="worker", state=MemberState.CONNECTED,
                  address="127.0.0.1:47471", path="direct", via=None, health=HealthState.CONNECTED, rtt_last_s=0.0008, rtt_p50_s=0.0007,
                  rtt_p95_s=0.0012, quic_rtt_s=0.001, datagram_bytes=1452, missed_heartbeats=0, tunnel_port=40000,
                  rpc_server_up=True, serving=False, capacity={"usable_bytes": 2_000_000_000}, model_sha256="",
                  secret_epoch=0, refused=None, learned_via=None)


def a_snapshot(events: RecentEvents) -> dict:
    """A serving node's ``status_snapshot()`` with one peer, in the shape node.py builds it."""
    return {
        "node": {"id": SERVER_ID, "short_id": "aaaaaaaa", "name": "server", "version": "0.1.0",
                 "home": "/home/someone/.local/share/mesh-inference", "uptime_s": 12.5,
                 "capacity": {"usable_bytes": 3_000_000_000, "free_ram_bytes": 3_500_000_000,
                              "device_free_bytes": 0, "max_memory_bytes": 0}},
        "model": {"path": "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "bytes": 1, "ctx_size": 4096},
        "processes": [{"name": "rpc-server", "pid": 123, "running": True, "port": 5000, "log": "/x.log"}],
        "serving": {
            "api": {"port": 8080, "url": "http://localhost:8080/v1", "requires_key": True},
            "plan": {"nodes": [
                {"id": WORKER_ID, "name": "worker", "layers": [0, 14], "weights_bytes": 1, "kv_bytes": 1,
                 "output_bytes": 0, "needed_bytes": 2, "free_bytes": 2_000_000_000},
                {"id": SERVER_ID, "name": "server", "layers": [14, 30], "weights_bytes": 1, "kv_bytes": 1,
                 "output_bytes": 1, "needed_bytes": 3, "free_bytes": 3_000_000_000}],
                "left_out": [], "refused": [], "n_layers": 30, "tensor_split": [14, 17]},
            "refusal": None, "speculation": None, "llama_server_restarts": 0,
            "live": {"tokens_per_second_now": 21.5, "last_request_tokens_per_second": 19.0},
            "counters": {"requests": 3, "failovers": 0, "retries": 0, "restarts": 0},
        },
        "mesh": {"quic_port": 47470, "secret_epoch": 0, "removed": [], "ignored_datagrams": 0, "model_sha256": None},
        "peers": peers_json([WORKER]),
        "events": events.to_json(),
    }


@pytest.fixture
async def keyed_dashboard():
    events = RecentEvents()
    events.add(1_700_000_000.0, f"Node ticket: {TICKET}")
    events.add(1_700_000_001.0, "Connected to peer worker (bbbbbbbb)")
    proxy = ApiProxy(Metrics(lambda: [WORKER]), lambda reason: None, access=ApiAccess(api_key=KEY))
    dashboard.add_routes(proxy.app, lambda: a_snapshot(events), lambda: [WORKER])
    port = free_tcp_port()
    await proxy.start(port)
    yield f"http://127.0.0.1:{port}"
    await proxy.close()


async def test_the_page_and_its_files_are_keyless_and_the_state_wants_the_key(keyed_dashboard):
    async with httpx.AsyncClient(base_url=keyed_dashboard) as client:
        page = await client.get(PAGE_PATH)
        assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["Content-Security-Policy"]
        for path in sorted(KEYLESS_PATHS - {PAGE_PATH}):
            assert path in page.text  # the page loads each file it is allowed to
            asset = await client.get(path)
            assert asset.status_code == 200 and asset.content, path
        assert (await client.get(f"{PAGE_PATH}/dashboard.js")).headers["Content-Type"].startswith("text/javascript")
        assert (await client.get(f"{PAGE_PATH}/dashboard.css")).headers["Content-Type"].startswith("text/css")

        assert (await client.get(STATE_PATH)).status_code == 401
        assert (await client.get(STATE_PATH, headers={"Authorization": "Bearer wrong"})).status_code == 401
        # Only the named files are keyless, not whatever sits under /mesh.
        assert (await client.get(f"{PAGE_PATH}/index.html")).status_code == 401
        state = await client.get(STATE_PATH, headers={"Authorization": f"Bearer {KEY}"})
        assert state.status_code == 200 and state.headers["Cache-Control"] == "no-store"


async def test_the_state_has_members_plan_live_figures_and_events_but_no_secrets(keyed_dashboard):
    async with httpx.AsyncClient() as client:
        response = await client.get(keyed_dashboard + STATE_PATH, headers={"Authorization": f"Bearer {KEY}"})
    state = response.json()
    assert state["node"]["name"] == "server"
    assert state["model"] == {"name": "SmolLM2-135M-Instruct.Q4_1.gguf", "ctx_size": 4096}
    assert [(m["name"], m["state"], m["capacity_bytes"], m["serving"]) for m in state["members"]] == [
        ("server", "self", 3_000_000_000, True), ("worker", "connected", 2_000_000_000, False)]
    assert state["members"][1]["rtt_ms"] == 0.8 and state["members"][1]["address"] == "127.0.0.1:47471"
    assert state["members"][1]["rtt_p50_ms"] == 0.7 and state["members"][1]["health"] == "connected"
    assert state["plan"]["n_layers"] == 30
    assert [(s["name"], s["start"], s["end"], s["output"]) for s in state["plan"]["segments"]] == [
        ("worker", 0, 14, False), ("server", 14, 30, True)]
    assert state["live"] == {"tokens_per_second_now": 21.5, "last_request_tokens_per_second": 19.0}
    assert state["counters"]["requests"] == 3
    assert [e["message"] for e in state["events"]] == [
        f"Node ticket: {TICKET_PLACEHOLDER}", "Connected to peer worker (bbbbbbbb)"]
    for secret_or_path in (TICKET, "/home/someone", "/x.log", "/models/"):
        assert secret_or_path not in response.text


def test_token_rate_follows_the_stream_and_falls_to_zero_after_it():
    rate = TokenRate(window_s=2.0)
    assert rate.per_second(100.0) == 0.0
    for i in range(20):  # 20 tokens a second for one second
        rate.streamed(b'data: {"choices": [{"text": "a"}]}\n\n', 100.0 + i * 0.05)
    rate.streamed(b"data: [DONE]\n\n", 101.0)  # not a token
    rate.streamed(b": keep-alive comment\n\n", 101.0)  # nor is this
    assert rate.per_second(101.0) == pytest.approx(20.0)
    assert 0 < rate.per_second(102.5) < 20.0  # fading: the window still holds part of the stream
    assert rate.per_second(103.0) == 0.0
    rate.finished(18.7)
    assert rate.to_json(103.0) == {"tokens_per_second_now": 0.0, "last_request_tokens_per_second": 18.7}


def test_recent_events_are_bounded_show_a_plan_in_one_line_and_never_hold_a_ticket():
    events = RecentEvents(kept=3)
    events.add(1.0, f"On another machine, run: mesh-inference --join {TICKET}")
    events.add(2.0, PlanAnnouncement({"n_layers": 30, "nodes": [{"name": "w", "layers": [0, 14]},
                                                                {"name": "s", "layers": [14, 30]}]},
                                     title="Plan for model.gguf"))
    events.add(3.0, "Connected to peer b")
    events.add(4.0, "Connected to peer c")
    assert events.to_json() == [
        {"time": 2.0, "message": "Plan for model.gguf: 30 layers over w [0, 14), s [14, 30)"},
        {"time": 3.0, "message": "Connected to peer b"},
        {"time": 4.0, "message": "Connected to peer c"},
    ]
    events.add(5.0, f"Node ticket: {TICKET}")
    assert events.to_json()[-1]["message"] == f"Node ticket: {TICKET_PLACEHOLDER}"


async def test_the_proxy_feeds_the_token_rate_from_a_relayed_stream():
    """A stand-in llama-server streams five tokens and its timings; the proxy counts and keeps them."""
    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(5):
            await response.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        await response.write(b'data: {"choices": [], "timings": {"predicted_per_second": 42.5}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    upstream = web.Application()
    upstream.router.add_post("/v1/completions", stream)
    runner = web.AppRunner(upstream, shutdown_timeout=0.5)
    await runner.setup()
    upstream_port, port = free_tcp_port(), free_tcp_port()
    await web.TCPSite(runner, "127.0.0.1", upstream_port).start()
    proxy = ApiProxy(Metrics(lambda: ()), lambda reason: None)
    await proxy.start(port)
    proxy.serve(f"http://127.0.0.1:{upstream_port}")
    try:
        async with httpx.AsyncClient() as client:
            response = await client.post(f"http://127.0.0.1:{port}/v1/completions",
                                         json={"prompt": "x", "stream": True})
        assert response.text.count("data: ") == 7
        live = proxy.token_rate.to_json(time.monotonic())
        # Six data events (five tokens, then the timings) over the minimum span.
        assert live["tokens_per_second_now"] == pytest.approx(6 / dashboard.TOKEN_RATE_MIN_SPAN_S)
        assert live["last_request_tokens_per_second"] == 42.5
    finally:
        await proxy.close()
        await runner.cleanup()


# --- the page in a real browser, on a real three-node mesh ---------------------------

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = Path(__file__).resolve().parent.parent / "test-artifacts" / "dashboard.png"
STREAM_TOKENS = 256
NAMES = ("server", "worker-a", "worker-b")
SAMPLE_S = 0.25  # the page updates about once a second
SCREENSHOT_AFTER_MOVING_SAMPLES = 8


def planned(node) -> list[tuple[str, int, int]]:
    plan = node.status()["serving"]["plan"]
    return [(n["name"], *n["layers"]) for n in plan["nodes"]] if plan else []


class Stream(threading.Thread):
    """A streamed completion in the background; counts the tokens it receives and when."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.tokens = 0
        self.first_at: float | None = None
        self.done_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
                "temperature": 0}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=300,
                              headers={"Authorization": f"Bearer {KEY}"}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                        self.tokens += 1
                        self.first_at = self.first_at or time.monotonic()
        except BaseException as exc:  # reported by the test thread
            self.error = exc
        self.done_at = time.monotonic()


@pytest.mark.slow
def test_the_dashboard_shows_the_mesh_its_layer_map_and_live_speed(start_node, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium package (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is in the test extra: pip install -e '.[test]'")

    server = start_node("server", "--min-peers", "2", "--api-key", KEY, serve=True, wait=False)
    ticket = wait_until(lambda: TICKET_LINE.search(server.text()), 60, "the server's ticket").group(1)
    start_node("worker-a", "--join", ticket)
    start_node("worker-b", "--join", ticket)
    server.wait_ready()
    plan = wait_until(lambda: (p := planned(server)) and len(p) == 3 and p, 120, "a plan over all three nodes")

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1200, "height": 1000})
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{server.serve_port}{PAGE_PATH}")
            page.locator("#key-input").fill(KEY)  # the state wants the key; the page asks for it
            page.locator("#key-form button").click()
            # Predicates as functions: a string would be eval'd in the page, which its CSP forbids.
            page.wait_for_function("() => document.querySelectorAll('#members tbody tr').length === 3"
                                   " && document.querySelectorAll('.segment').length === 3", timeout=15_000)

            rows = page.eval_on_selector_all("#members tbody tr",
                                             "rows => rows.map(r => [r.dataset.node, r.dataset.state])")
            assert sorted(map(tuple, rows)) == [("server", "self"), ("worker-a", "connected"),
                                                ("worker-b", "connected")]
            segments = page.eval_on_selector_all(
                ".segment", "els => els.map(e => [e.dataset.node, +e.dataset.start, +e.dataset.end, e.textContent])")
            assert [tuple(s[:3]) for s in segments] == plan
            assert [s[3] for s in segments] == [f"{name}: {start}–{end}" for name, start, end in plan]
            assert {name for name, *_ in plan} == set(NAMES)

            assert page.text_content("#tps-now") == "0.0"  # nothing streams yet
            stream = Stream(server.serve_port)
            stream.start()
            seen: list[float] = []
            SCREENSHOT.parent.mkdir(exist_ok=True)
            SCREENSHOT.unlink(missing_ok=True)
            while stream.is_alive():
                seen.append(float(page.text_content("#tps-now")))
                if sum(v > 0 for v in seen) == SCREENSHOT_AFTER_MOVING_SAMPLES:  # mid-stream, a few updates in
                    page.screenshot(path=str(SCREENSHOT), full_page=True)
                time.sleep(SAMPLE_S)
            stream.join()
            assert stream.error is None, stream.error
            assert stream.tokens > STREAM_TOKENS // 2, stream.tokens
            client_rate = (stream.tokens - 1) / (stream.done_at - stream.first_at)
            moving = [v for v in seen if v > 0]
            assert moving, f"tokens/s never moved during a {stream.done_at - stream.first_at:.1f} s stream"
            assert len(set(seen)) >= 2
            # The figure is the stream's speed, not just any number.
            assert any(client_rate / 3 <= v <= client_rate * 3 for v in moving), (moving, client_rate)
            page.wait_for_function("() => document.getElementById('tps-last').textContent !== '–'", timeout=5_000)
            events = page.text_content("#events")
            assert "Connected to peer" in events and "meshinf" not in events
            if not SCREENSHOT.exists():  # a stream shorter than the samples above
                page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
