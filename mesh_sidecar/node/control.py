"""The running node's local control endpoint (control_client.py reads it).

The node serves JSON on 127.0.0.1 only (a free port) and writes that port,
its pid and a random token to ``<home>/control.json`` (mode 0600, in a 0700
home). Every request must carry the token: another local user can reach the
port but cannot read the file, and the endpoint hands out the mesh ticket.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from ..errors import MeshError, UsageError
from ..home import NodeHome, write_private_file
from ..llama.hub_models import hub_name_of
from ..ports import LOOPBACK
from ..serve.planner import Plan
from .control_client import (
    ERROR_STATUS,
    KICK_PATH,
    LEAVE_PATH,
    PLAN_PATH,
    ROTATE_PATH,
    STATUS_PATH,
    TICKET_PATH,
)

TOKEN_BYTES = 32
MAX_CONTROL_BODY_BYTES = 64 * 1024  # requests are a few short fields


class ControlledNode(Protocol):
    """What the control endpoint asks of the node."""

    def status_snapshot(self) -> dict[str, Any]: ...

    async def plan_snapshot(self, model: Path | None, ctx_size: int | None) -> Plan: ...

    def model_paths(self) -> list[Path]: ...

    def ticket(self) -> str: ...

    def rotate_secret(self) -> str: ...

    def kick(self, which: str) -> tuple[str, str]: ...

    def leave(self) -> None: ...


class ControlServer:
    """Serves status, plan, ticket, rotation and kick to the local CLI."""

    def __init__(self, home: NodeHome, node: ControlledNode) -> None:
        self._home = home
        self._node = node
        self._token = secrets.token_hex(TOKEN_BYTES)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application(middlewares=[self._check_token], client_max_size=MAX_CONTROL_BODY_BYTES)
        app.router.add_get(STATUS_PATH, self._status)
        app.router.add_get(PLAN_PATH, self._plan_request)
        app.router.add_get(TICKET_PATH, self._ticket)
        app.router.add_post(ROTATE_PATH, self._rotate)
        app.router.add_post(KICK_PATH, self._kick)
        app.router.add_post(LEAVE_PATH, self._leave)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, LOOPBACK, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        write_private_file(self._home.control_file,
                           json.dumps({"pid": os.getpid(), "port": self.port, "token": self._token}))

    async def close(self) -> None:
        # Only remove the file if it is still ours (a newer node may own the home now).
        try:
            if json.loads(self._home.control_file.read_text()).get("pid") == os.getpid():
                self._home.control_file.unlink()
        except (OSError, ValueError):
            pass
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _check_token(self, request: web.Request, handler) -> web.StreamResponse:
        offered = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(offered.encode(), self._token.encode()):
            return web.json_response({"error": "missing or wrong control token", "kind": "AuthError"},
                                     status=401)
        return await handler(request)

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self._node.status_snapshot())

    async def _plan_request(self, request: web.Request) -> web.Response:
        model = request.query.get("model")
        ctx = request.query.get("ctx")
        try:
            plan = await self._node.plan_snapshot(Path(model) if model else None, int(ctx) if ctx else None)
        except MeshError as exc:
            return _error(exc)
        paths = [Path(model)] if model else self._node.model_paths()
        # The plan names the file; a model fetched from the hub is also shown by its hf: name.
        name = next((hub_name_of(path) for path in paths if path.name == plan.model), None) or plan.model_name
        return web.json_response(dataclasses.replace(plan, model_name=name or "").to_json())

    async def _ticket(self, request: web.Request) -> web.Response:
        return web.json_response({"ticket": self._node.ticket()})

    async def _rotate(self, request: web.Request) -> web.Response:
        return web.json_response({"ticket": self._node.rotate_secret()})

    async def _kick(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            which = body["node"]
            if not isinstance(which, str):
                raise TypeError("node must be a string")
            removed, ticket = self._node.kick(which)
        except (ValueError, KeyError, TypeError) as exc:
            return _error(UsageError(f"bad kick request: {exc}"))
        except MeshError as exc:
            return _error(exc)
        return web.json_response({"removed": removed, "ticket": ticket})

    async def _leave(self, request: web.Request) -> web.Response:
        self._node.leave()
        return web.json_response({"leaving": True})


def _error(exc: MeshError) -> web.Response:
    return web.json_response({"error": str(exc), "kind": type(exc).__name__}, status=ERROR_STATUS)
