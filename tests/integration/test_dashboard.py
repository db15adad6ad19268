"""The /mesh page in a real browser on a real three-node mesh.

It drives Debian's Chromium with Playwright and saves a screenshot to test-artifacts/dashboard.png.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from mesh_sidecar.serve.dashboard import (
    PAGE_PATH,
)
from tests.helpers.browser import chromium, require_chromium
from tests.helpers.nodes import TICKET_LINE
from tests.helpers.waiting import wait_until
from tests.unit.test_dashboard import KEY

# --- the page in a real browser, on a real three-node mesh ---------------------------

SCREENSHOT = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard.png"
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
        except BaseException as exc:  # noqa: BLE001 - anything, the test thread reports it
            self.error = exc
        self.done_at = time.monotonic()


@pytest.mark.slow
def test_the_dashboard_shows_the_mesh_its_layer_map_and_live_speed(start_node, tmp_path):
    require_chromium()

    server = start_node("server", "--min-peers", "2", "--api-key", KEY, serve=True, wait=False)
    ticket = wait_until(lambda: TICKET_LINE.search(server.text()), 60, "the server's ticket").group(1)
    start_node("worker-a", "--join", ticket)
    start_node("worker-b", "--join", ticket)
    server.wait_ready()
    plan = wait_until(lambda: (p := planned(server)) and len(p) == 3 and p, 120, "a plan over all three nodes")

    with chromium(tmp_path / "chromium-profile", height=1000) as browser:
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
