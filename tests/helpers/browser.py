"""Debian's Chromium driven by Playwright, for the tests of pages people open (the dashboard, the chat page):
no browser download, a profile of the test's own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def require_chromium() -> Any:
    """Playwright's sync API; the test skipped, saying what to install, without Chromium or Playwright (call
    it first in a test that starts nodes, so that a skip costs nothing)."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium package (apt-get install chromium)")
    return pytest.importorskip("playwright.sync_api",
                               reason="playwright is in the test extra: pip install -e '.[test]'")


@contextmanager
def chromium(profile: Path, height: int) -> Iterator[Any]:
    """A headless Chromium context 1200 pixels wide, closed after (see ``require_chromium``)."""
    with require_chromium().sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1200, "height": height})
        try:
            yield browser
        finally:
            browser.close()
