"""The running node's local control endpoint, and the client that reads it.

The node serves JSON on 127.0.0.1 only (a free port) and writes that port,
with its pid, to ``<home>/control.json``; ``mesh-inference status`` finds the
node through that file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import httpx
from aiohttp import web

from .errors import UsageError
from .home import NodeHome
from .ports import LOOPBACK

STATUS_PATH = "/status"
CLIENT_TIMEOUT_S = 5.0


class ControlServer:
    """Serves ``GET /status`` from a snapshot callable."""

    def __init__(self, home: NodeHome, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._home = home
        self._snapshot = snapshot
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(STATUS_PATH, self._status)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, LOOPBACK, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        partial = self._home.control_file.with_suffix(".partial")
        partial.write_text(json.dumps({"pid": os.getpid(), "port": self.port}))
        partial.replace(self._home.control_file)

    async def close(self) -> None:
        # Only remove the file if it is still ours (a newer node may own the home now).
        try:
            if json.loads(self._home.control_file.read_text()).get("pid") == os.getpid():
                self._home.control_file.unlink()
        except (OSError, ValueError):
            pass
        if self._runner is not None:
            await self._runner.cleanup()

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self._snapshot())


def read_status(home: NodeHome) -> dict[str, Any]:
    """The status of the node running in ``home``; UsageError if none is."""
    not_running = UsageError(
        f"No node is running with home {home.root}. Start one with `mesh-inference` "
        "(add --home DIR if it uses another home)."
    )
    try:
        control = json.loads(home.control_file.read_text())
        port = int(control["port"])
    except (OSError, ValueError, KeyError, TypeError):
        raise not_running from None
    try:
        response = httpx.get(f"http://{LOOPBACK}:{port}{STATUS_PATH}", timeout=CLIENT_TIMEOUT_S)
        response.raise_for_status()
        return response.json()
    except httpx.HTTPError:
        raise not_running from None
