"""Who may use the API port: an optional bearer key, an optional CORS origin, a body limit.

With an API key, every path but ``/health`` (and the keyless pages and files of the dashboard and
the chat page) wants ``Authorization: Bearer KEY`` (401 otherwise); the header stops at the proxy and never reaches
llama-server. CORS is off unless one origin is allowed: no ``Access-Control-*`` header leaves
the proxy, whatever llama-server set. Bodies over MAX_REQUEST_BODY_BYTES get a 413. Every
such refusal is an OpenAI-style error (:func:`openai_error`).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Middleware

from .. import environment
from ..errors import UsageError
from ..units import MIB
from ..wire.api_forward import FORWARDED_TOKEN_HEADER, MAX_FORWARDED_BODY_BYTES, openai_error_body
from .chat_page import is_keyless
from .dashboard import KEYLESS_PATHS
from .receipt import CONTINUE_AT_HEADER

# About two million tokens of text: far beyond any context, small enough to hold in memory; the
# same limit as a request forwarded to another member, so any body accepted here can be forwarded.
MAX_REQUEST_BODY_BYTES = MAX_FORWARDED_BODY_BYTES
# Not forwarded: the client's key is for this proxy (llama-server has none), and where to continue
# an answer is the proxy's to carry out.
CLIENT_ONLY_HEADERS = frozenset({"authorization", CONTINUE_AT_HEADER.lower(), FORWARDED_TOKEN_HEADER.lower()})
# Open without a key: readiness only, and load balancers and scripts probe it keyless.
# /metrics is not open: it reveals usage (request counts, paths, speeds). Nor is the dashboard's
# state; its page and files hold no data.
OPEN_PATHS = frozenset({"/health"}) | KEYLESS_PATHS
CORS_PREFLIGHT_MAX_AGE_S = 600

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openai_error(status: int, message: str, error_type: str, code: str,
                 headers: dict[str, str] | None = None) -> web.Response:
    """An error body in the shape OpenAI clients parse."""
    return web.json_response(openai_error_body(message, error_type, code), status=status, headers=headers)


@dataclass(frozen=True)
class ApiAccess:
    """Who may use the API port: an optional bearer key and an optional CORS origin."""

    api_key: str | None = field(default=None, repr=False)  # never in a repr, so never in a log
    cors_origin: str | None = None  # e.g. "https://chat.example.org"; None: no CORS header at all

    def __post_init__(self) -> None:
        key = self.api_key
        if key is not None and (not key or not key.isascii() or not key.isprintable() or " " in key):
            raise UsageError(f"The API key (--api-key or {environment.API_KEY_ENV}) must be non-empty printable ASCII "
                             "without spaces; for example, use the output of: openssl rand -hex 32")

    def admits(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries the key (always, when there is none)."""
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        # Compared as bytes in constant time: the answer must not leak how much of a guess was right.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(errors="replace"), self.api_key.encode())


OPEN_ACCESS = ApiAccess()  # no key, no CORS: the default


def guard(access: ApiAccess, forwarded: Callable[[web.Request], bool] = lambda request: False,
          public: bool = True) -> Middleware:
    """The middleware that turns away requests without the key, and bodies over the limit.

    ``forwarded`` tells a request a member forwarded (net/api_forward.py): the member's node checked
    its client's key already. ``public`` False (``--no-api`` on a serving node): only those are served.
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if forwarded(request):
            return await _limited(request, handler)
        if not public:
            return openai_error(404, "The API is off on this node (--no-api); call it on another member.",
                                "invalid_request_error", "api_off")
        if _is_allowed_preflight(access, request):
            return web.Response(status=204)  # browsers send preflights without the key; cors() answers it
        if (request.path not in OPEN_PATHS and not is_keyless(request.rel_url.raw_path)
                and not access.admits(request.headers.get("Authorization"))):
            message = ("Missing API key: send it as 'Authorization: Bearer KEY'."
                       if "Authorization" not in request.headers else "Incorrect API key provided.")
            return openai_error(401, message, "invalid_request_error", "invalid_api_key",
                                headers={"WWW-Authenticate": 'Bearer realm="mesh-inference"'})
        return await _limited(request, handler)

    return middleware


async def _limited(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return openai_error(413, f"The request body is over the {MAX_REQUEST_BODY_BYTES // MIB} MiB limit.",
                            "invalid_request_error", "request_too_large")


def _is_allowed_preflight(access: ApiAccess, request: web.Request) -> bool:
    return (request.method == "OPTIONS" and access.cors_origin is not None
            and request.headers.get("Origin") == access.cors_origin
            and "Access-Control-Request-Method" in request.headers)


def cors(access: ApiAccess) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """The response hook that drops every CORS header (llama-server sends ``Allow-Origin: *``) and
    allows only the chosen origin."""

    async def hook(request: web.Request, response: web.StreamResponse) -> None:
        for name in {name for name in response.headers if name.lower().startswith("access-control-")}:
            response.headers.popall(name)
        if access.cors_origin is None:
            return
        response.headers.add("Vary", "Origin")
        if request.headers.get("Origin") != access.cors_origin:
            return
        response.headers["Access-Control-Allow-Origin"] = access.cors_origin
        if _is_allowed_preflight(access, request):
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
            response.headers["Access-Control-Max-Age"] = str(CORS_PREFLIGHT_MAX_AGE_S)

    return hook
