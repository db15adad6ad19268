"""The live dashboard on the API port: ``http://localhost:<serve port>/mesh``.

Routes, added to the API proxy's aiohttp app by ``add_routes``::

    GET /mesh                  the page            keyless: it holds no data
    GET /mesh/dashboard.js     its script          keyless
    GET /mesh/dashboard.css    its style           keyless
    GET /mesh/state            the state as JSON   wants the API key like /v1 (the proxy's guard)

The page polls ``/mesh/state`` about once a second and draws members, the
layer map of the current plan, live tokens per second, RTTs and recent events.
The files are plain HTML/CSS/JS shipped in ``dashboard/`` (package data): no
build step, no CDN, no external fonts.

Also here, the two live figures the page shows that ``status`` had no place for:
``TokenRate`` (the proxy feeds it streamed events) and ``RecentEvents`` (the
node feeds it every line it says to the user).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from ..llama.capacity import USABLE_KEY
from ..mesh.status import PeerView, rtt_ms
from .replay import DATA_PREFIX, DONE
from ..identity import short_id
from ..wire.ticket import TICKET_PREFIX

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

TOKEN_RATE_WINDOW_S = 2.0
# A rate over a shorter span than this is noise (one token just arrived).
TOKEN_RATE_MIN_SPAN_S = 0.5
RECENT_EVENTS_KEPT = 50
# Tickets admit machines to the mesh: the state endpoint is keyless unless --api-key is set, so
# events never carry one (`mesh-inference ticket` prints it through the token-guarded control endpoint).
_TICKET = re.compile(re.escape(TICKET_PREFIX) + r"[a-z2-7]+")
TICKET_PLACEHOLDER = "<ticket: see mesh-inference ticket>"


class TokenRate:
    """Tokens streamed per second just now (all streams together), and the last request's decode speed.

    llama-server sends one token per server-sent event, so streamed ``data:``
    events are counted over the last TOKEN_RATE_WINDOW_S and divided by the time
    they span (at least TOKEN_RATE_MIN_SPAN_S): a stream shows its speed within
    half a second, and the figure falls to 0 one window after the last token.
    Callers pass ``now`` from ``time.monotonic()``.
    """

    def __init__(self, window_s: float = TOKEN_RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._times: deque[float] = deque()
        self.last_request_tokens_per_second: float | None = None  # as llama-server timed it

    def streamed(self, event: bytes, now: float) -> None:
        """One server-sent event relayed to a client; counted if it is a data event other than [DONE]."""
        line = event.strip()
        if line.startswith(DATA_PREFIX) and line[len(DATA_PREFIX):] != DONE:
            self._times.append(now)
            self._forget(now)

    def finished(self, tokens_per_second: float) -> None:
        """A request ended and llama-server reported its decode speed."""
        self.last_request_tokens_per_second = tokens_per_second

    def per_second(self, now: float) -> float:
        self._forget(now)
        if not self._times:
            return 0.0
        return len(self._times) / max(now - self._times[0], TOKEN_RATE_MIN_SPAN_S)

    def to_json(self, now: float) -> dict[str, float | None]:
        return {"tokens_per_second_now": round(self.per_second(now), 1),
                "last_request_tokens_per_second": self.last_request_tokens_per_second}

    def _forget(self, now: float) -> None:
        while self._times and self._times[0] <= now - self._window_s:
            self._times.popleft()


class RecentEvents:
    """The last RECENT_EVENTS_KEPT lines a node said to its user, with their times, tickets left out."""

    def __init__(self, kept: int = RECENT_EVENTS_KEPT) -> None:
        self._events: deque[tuple[float, str]] = deque(maxlen=kept)

    def add(self, when: float, message: Any) -> None:
        """``message`` as given to the node's ``say``: a string, or a typed message (the plan) as its ``str``."""
        text = str(message)
        self._events.append((when, _TICKET.sub(TICKET_PLACEHOLDER, text)))

    def to_json(self) -> list[dict[str, Any]]:
        """Oldest first; ``time`` in seconds since the epoch."""
        return [{"time": round(when, 3), "message": text} for when, text in self._events]


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


@dataclass(frozen=True)
class Segment:
    """One node's share of the layer map: layers [start, end) of the plan."""

    id: str
    name: str
    start: int
    end: int
    output: bool  # it also holds the output head


def state_from(snapshot: dict[str, Any], peer_views: Sequence[PeerView]) -> dict[str, Any]:
    """What the page draws, from a node's ``status_snapshot()`` and its mesh's peer views;
    no paths, pids or secrets."""
    node, serving = snapshot["node"], snapshot["serving"] or {}
    this = Member(id=node["id"], short_id=node["short_id"], name=node["name"], state="self", health=None,
                  address=f"udp :{snapshot['mesh']['quic_port']}", path=None, rtt_ms=None, rtt_p50_ms=None,
                  capacity_bytes=(node["capacity"] or {}).get(USABLE_KEY, 0), serving=bool(serving))
    peers = [Member(id=p.node_id.hex(), short_id=short_id(p.node_id), name=p.name, state=p.state.value,
                    health=None if p.health is None else p.health.value, address=p.address, path=p.path,
                    rtt_ms=rtt_ms(p.rtt_last_s), rtt_p50_ms=rtt_ms(p.rtt_p50_s),
                    capacity_bytes=p.capacity.get(USABLE_KEY, 0), serving=p.serving)
             for p in peer_views]
    plan = serving.get("plan")
    return {
        "node": {"name": node["name"], "short_id": node["short_id"], "version": node["version"],
                 "uptime_s": node["uptime_s"]},
        "model": {"name": Path(snapshot["model"]["path"]).name, "ctx_size": snapshot["model"]["ctx_size"]},
        "members": [asdict(m) for m in (this, *peers)],
        "plan": None if plan is None else {
            "n_layers": plan["n_layers"],
            "segments": [asdict(Segment(n["id"], n["name"], *n["layers"], bool(n["output_bytes"])))
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
