"""The client of the running node's control endpoint (control.py): what `status`, `plan`, `ticket`,
`kick` and `leave` ask.

Light on purpose: read-only commands import this, not the node, and answer at once. So it speaks
HTTP/1.1 with the standard library, to 127.0.0.1 only, with the token from ``<home>/control.json``.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from ..errors import MeshError, PlanError, UsageError
from ..home import NodeHome
from ..ports import LOOPBACK

STATUS_PATH = "/status"
PLAN_PATH = "/plan"
TICKET_PATH = "/ticket"
ROTATE_PATH = "/ticket/rotate"
KICK_PATH = "/kick"
LEAVE_PATH = "/leave"
ERROR_STATUS = 409  # the node refused: the body names the error's kind and says why
CLIENT_TIMEOUT_S = 5.0


def read_status(home: NodeHome) -> dict[str, Any]:
    """The status of the node running in ``home``; UsageError if none is."""
    return _request(home, "GET", STATUS_PATH)


def read_plan(home: NodeHome, model: Path | None, ctx_size: int | None) -> dict[str, Any]:
    """The plan the node in ``home`` would make now; PlanError with its reason if none fits."""
    params = {k: v for k, v in (("model", model and str(model)), ("ctx", ctx_size)) if v}
    return _request(home, "GET", PLAN_PATH, params=params)


def read_ticket(home: NodeHome) -> str:
    return _request(home, "GET", TICKET_PATH)["ticket"]


def rotate_secret(home: NodeHome) -> str:
    """Rotate the mesh secret through the node in ``home``; the new ticket."""
    return _request(home, "POST", ROTATE_PATH)["ticket"]


def leave(home: NodeHome) -> None:
    """Ask the node in ``home`` to leave its mesh for good (it stops)."""
    _request(home, "POST", LEAVE_PATH)


def kick(home: NodeHome, which: str) -> dict[str, str]:
    """Remove a member (name or id) through the node in ``home``; its name and the new ticket."""
    return _request(home, "POST", KICK_PATH, json_body={"node": which})


def _request(home: NodeHome, method: str, path: str, params: dict[str, Any] | None = None,
             json_body: dict[str, Any] | None = None) -> dict[str, Any]:
    not_running = UsageError(
        f"No node is running with home {home.root}. Start one with `mesh-inference` "
        "(add --home DIR if it uses another home)."
    )
    try:
        control = json.loads(home.control_file.read_text())
        port, token = int(control["port"]), str(control["token"])
    except PermissionError:
        raise UsageError(f"Cannot read {home.control_file}: run this as the user who runs the node.") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise not_running from None
    headers = {"Authorization": f"Bearer {token}"}
    payload = None
    if json_body is not None:
        payload = json.dumps(json_body).encode()
        headers["Content-Type"] = "application/json"
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=CLIENT_TIMEOUT_S)
    try:
        connection.request(method, f"{path}?{urlencode(params)}" if params else path, body=payload, headers=headers)
        response = connection.getresponse()
        body = json.loads(response.read())
    except (OSError, http.client.HTTPException, ValueError):
        raise not_running from None
    finally:
        connection.close()
    if response.status not in (http.client.OK, ERROR_STATUS) or not isinstance(body, dict):
        raise not_running
    if response.status == ERROR_STATUS:
        kinds: dict[str, type[MeshError]] = {cls.__name__: cls for cls in (PlanError, UsageError)}
        raise kinds.get(str(body.get("kind")), MeshError)(body["error"])
    return body
