"""The running node's local control endpoint, and the client that reads it.

The node serves JSON on 127.0.0.1 only (a free port) and writes that port,
with its pid, to ``<home>/control.json``; ``mesh-inference status`` and
``mesh-inference plan`` find the node through that file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from .errors import MeshError, PlanError, UsageError
from .home import NodeHome
from .planner import Plan
from .ports import LOOPBACK

STATUS_PATH = "/status"
PLAN_PATH = "/plan"
CLIENT_TIMEOUT_S = 5.0


PlanCallable = Callable[[Path | None, int | None], Awaitable[Plan]]


class ControlServer:
    """Serves ``GET /status`` and ``GET /plan?model=PATH&ctx=N`` from the node's callables."""

    def __init__(self, home: NodeHome, snapshot: Callable[[], dict[str, Any]], plan: PlanCallable) -> None:
        self._home = home
        self._snapshot = snapshot
        self._plan = plan
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(STATUS_PATH, self._status)
        app.router.add_get(PLAN_PATH, self._plan_request)
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

    async def _plan_request(self, request: web.Request) -> web.Response:
        model = request.query.get("model")
        ctx = request.query.get("ctx")
        try:
            plan = await self._plan(Path(model) if model else None, int(ctx) if ctx else None)
        except MeshError as exc:
            return web.json_response({"error": str(exc), "kind": type(exc).__name__}, status=409)
        return web.json_response(plan.to_json())


def read_status(home: NodeHome) -> dict[str, Any]:
    """The status of the node running in ``home``; UsageError if none is."""
    return _get(home, STATUS_PATH)


def read_plan(home: NodeHome, model: Path | None, ctx_size: int | None) -> dict[str, Any]:
    """The plan the node in ``home`` would make now; PlanError with its reason if none fits."""
    params = {k: v for k, v in (("model", model and str(model)), ("ctx", ctx_size)) if v}
    body = _get(home, PLAN_PATH, params, accept=(409,))
    if "error" in body:
        raise (PlanError if body.get("kind") == PlanError.__name__ else MeshError)(body["error"])
    return body


def _get(home: NodeHome, path: str, params: dict[str, Any] | None = None,
         accept: tuple[int, ...] = ()) -> dict[str, Any]:
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
        response = httpx.get(f"http://{LOOPBACK}:{port}{path}", params=params, timeout=CLIENT_TIMEOUT_S)
        if response.status_code not in accept:
            response.raise_for_status()
        return response.json()
    except httpx.HTTPError:
        raise not_running from None
