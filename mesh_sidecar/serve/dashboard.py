"""The live dashboard on the API port: ``http://localhost:<serve port>/mesh``.

Routes, added to the API proxy's aiohttp app by ``add_routes``::

    GET /mesh                  the page            keyless: it holds no data
    GET /mesh/dashboard.js     its script          keyless
    GET /mesh/dashboard.css    its style           keyless
    GET /mesh/state            the state as JSON   wants the API key like /v1 (the proxy's guard)

The page polls ``/mesh/state`` about once a second and draws members, the
models served in the mesh (who serves each, its state, requests in flight), the
layer map of the current plan, live tokens per second, RTTs and recent events.
The files are plain HTML/CSS/JS shipped in ``dashboard/`` (package data): no
build step, no CDN, no external fonts.

The live tokens per second and the recent events it shows come from the node's
status (activity.py keeps them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from ..identity import short_id
from ..llama.capacity import USABLE_KEY
from ..mesh.status import PeerView, devices_json, rtt_ms
from ..units import devices_line

PAGE_PATH = "/mesh"
STATE_PATH = "/mesh/state"
ASSET_DIR = Path(__file__).parent / "dashboard"
PAGE_FILE = "index.html"
# Served by exact name only (no directory route), so "keyless" can never reach another file.
ASSET_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
KEYLESS_PATHS = frozenset({PAGE_PATH, *(f"{PAGE_PATH}/{name}" for name in ASSET_TYPES)})
# The page loads only our own files and talks only to this port.
PAGE_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # a new version of the sidecar serves its own page at once
}


@dataclass(frozen=True)
class Member:
    """One row of the members table: this node or a peer it knows of."""

    id: str
    short_id: str
    name: str
    state: str  # "self", or the membership state: connected, lost, left...
    health: str | None  # connected / degraded / lost, from heartbeats; None for this node
    address: str | None
    path: str | None  # "direct" for a peer this node holds a connection to; None for itself or a lost one
    rtt_ms: float | None  # the last heartbeat's
    rtt_p50_ms: float | None
    capacity_bytes: int  # what it offers the planner
    serving: bool
    devices: str  # what its rpc-server offers, e.g. "Vulkan0 2.0 GiB, CPU 23.1 GiB"


@dataclass(frozen=True)
class Segment:
    """One node's share of the layer map: layers [start, end) of the plan."""

    id: str
    name: str
    start: int
    end: int
    output: bool  # it also holds the output head


def models_from(models: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The status' "models", field by field (ids, names, states, counts): a field added there later
    reaches the page only once it is named here."""
    def node(entry: dict[str, Any]) -> dict[str, str]:
        return {"id": entry["id"], "name": entry["name"]}

    return [{"id": model["id"], "state": model["state"], "default": bool(model.get("default")),
             "vision": bool(model.get("vision")),
             "replicas": [{"node": node(replica["node"]), "local": bool(replica.get("local")),
                           "state": replica.get("state", model["state"]), "in_flight": replica.get("in_flight", 0),
                           "members": [node(member) for member in replica.get("members", [])]}
                          for replica in model.get("replicas") or []]}
            for model in models or []]


def state_from(snapshot: dict[str, Any], peer_views: Sequence[PeerView]) -> dict[str, Any]:
    """What the page draws, from a node's ``status_snapshot()`` and its mesh's peer views;
    no paths, pids or secrets."""
    node, serving = snapshot["node"], snapshot["serving"] or {}
    this = Member(id=node["id"], short_id=node["short_id"], name=node["name"], state="self", health=None,
                  address=f"udp :{snapshot['mesh']['quic_port']}", path=None, rtt_ms=None, rtt_p50_ms=None,
                  capacity_bytes=(node["capacity"] or {}).get(USABLE_KEY, 0), serving=bool(serving),
                  devices=devices_line(node.get("devices") or ()))
    peers = [Member(id=p.node_id.hex(), short_id=short_id(p.node_id), name=p.name, state=p.state.value,
                    health=None if p.health is None else p.health.value, address=p.address, path=p.path,
                    rtt_ms=rtt_ms(p.rtt_last_s), rtt_p50_ms=rtt_ms(p.rtt_p50_s),
                    capacity_bytes=p.capacity.get(USABLE_KEY, 0), serving=p.serving,
                    devices=devices_line(devices_json(p.devices)))
             for p in peer_views]
    plan = serving.get("plan")
    return {
        "node": {"name": node["name"], "short_id": node["short_id"], "version": node["version"],
                 "uptime_s": node["uptime_s"]},
        "model": {"name": Path(path).name if (path := snapshot["model"]["path"]) else "no model file (a worker)",
                  "ctx_size": snapshot["model"]["ctx_size"]},
        "members": [asdict(m) for m in (this, *peers)],
        "models": models_from(snapshot.get("models")),
        "plan": None if plan is None else {
            "n_layers": plan["n_layers"],
            "segments": [asdict(Segment(n["id"], n["name"], n["layers"][0], n["layers"][1], bool(n["output_bytes"])))
                         for n in plan["nodes"]],
            "left_out": [n["name"] for n in plan["left_out"]],
            "refused": [{"name": n["name"], "reason": n["reason"], "detail": n["detail"]} for n in plan["refused"]],
        },
        "refusal": serving.get("refusal"),
        "live": serving.get("live"),
        "counters": serving.get("counters"),
        "events": snapshot["events"],
    }


def add_routes(app: web.Application, snapshot: Callable[[], dict[str, Any]],
               peer_views: Callable[[], Sequence[PeerView]]) -> None:
    """Serve the dashboard on ``app``; ``snapshot`` returns the node's ``status_snapshot()``,
    ``peer_views`` its mesh's ``peer_views()``."""
    # Read once: the files are part of the installed package and never change under a running node.
    page = (ASSET_DIR / PAGE_FILE).read_bytes()
    assets = {name: (ASSET_DIR / name).read_bytes() for name in ASSET_TYPES}

    async def serve_page(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS)

    def asset_handler(name: str) -> Callable[[web.Request], Any]:
        async def serve_asset(request: web.Request) -> web.Response:
            return web.Response(body=assets[name], content_type=ASSET_TYPES[name], charset="utf-8",
                                headers=PAGE_HEADERS)
        return serve_asset

    async def serve_state(request: web.Request) -> web.Response:
        return web.json_response(state_from(snapshot(), peer_views()), headers={"Cache-Control": "no-store"})

    app.router.add_get(PAGE_PATH, serve_page)
    for name in ASSET_TYPES:
        app.router.add_get(f"{PAGE_PATH}/{name}", asset_handler(name))
    app.router.add_get(STATE_PATH, serve_state)
