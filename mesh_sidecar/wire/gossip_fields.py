"""Gossip's field checks, over a message body that ``json.loads`` made: each returns the value typed, or
raises MalformedMessageError naming the field and what was expected (gossip.py's schemas use them in both
directions). Pure."""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import MalformedMessageError
from ..identity import NODE_ID_BYTES
from .rpc_hello import RpcVersion

NODE_ID_RE = re.compile(f"[0-9a-f]{{{2 * NODE_ID_BYTES}}}")
_ADDRESS_RE = re.compile(r"(?:\[[0-9A-Za-z:.%_-]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")
MAX_PORT = 65535


def field_error(what: str, expected: str) -> MalformedMessageError:
    return MalformedMessageError(f"gossip field {what}: expected {expected}")


def json_object(value: Any, what: str, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise field_error(what, "a JSON object")
    if not set(keys) <= set(value) <= set(keys) | set(optional):
        also = f", and perhaps {', '.join(optional)}" if optional else ""
        raise field_error(what, f"exactly the keys {', '.join(keys)}{also}; got {', '.join(sorted(value))}")
    return value


def bounded_list(value: Any, what: str, max_items: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > max_items:
        raise field_error(what, f"a list of at most {max_items} items")
    return value


def text(value: Any, what: str, max_chars: int, *, min_chars: int = 0) -> str:
    # isprintable() also rejects lone surrogates, which could not be re-encoded as UTF-8.
    if (
        not isinstance(value, str)
        or not min_chars <= len(value) <= max_chars
        or not value.isprintable()
    ):
        raise field_error(what, f"{min_chars} to {max_chars} printable characters")
    return value


def matching(value: Any, what: str, pattern: re.Pattern[str], expected: str) -> str:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise field_error(what, expected)
    return value


def integer(value: Any, what: str, maximum: int) -> int:
    # bool is an int in Python but not in our schema.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise field_error(what, f"an integer from 0 to {maximum}")
    return value


def boolean(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise field_error(what, "true or false")
    return value


def seconds(value: Any, what: str) -> float:
    try:
        # JSON integers have no size limit: float() of one past ~1e308 is an OverflowError.
        seconds = float(value) if isinstance(value, int | float) else math.nan
    except OverflowError:
        seconds = math.inf
    if isinstance(value, bool) or not math.isfinite(seconds):
        raise field_error(what, "a finite number of seconds")
    return seconds


def node_id(value: Any, what: str) -> bytes:
    hex_id = matching(value, what, NODE_ID_RE, f"{NODE_ID_BYTES} bytes as lowercase hex")
    return bytes.fromhex(hex_id)


def node_ids(value: Any, what: str, max_items: int) -> tuple[bytes, ...]:
    ids = tuple(node_id(v, f"{what}[{i}]") for i, v in enumerate(bounded_list(value, what, max_items)))
    if len(set(ids)) != len(ids):
        raise field_error(what, "no node id twice")
    return ids


def rpc_version(value: Any, what: str) -> RpcVersion | None:
    if value is None:
        return None
    try:
        return RpcVersion.parse(value if isinstance(value, str) else "")
    except ValueError:
        raise field_error(what, "major.minor.patch (each 0 to 255) or null") from None


def address(value: Any, what: str, max_chars: int) -> str:
    """``host:port`` (an IPv6 host in brackets) of at most ``max_chars`` characters, port 1 to 65535."""
    match = _ADDRESS_RE.fullmatch(value) if isinstance(value, str) and len(value) <= max_chars else None
    if match is None or not 1 <= int(match.group(1)) <= MAX_PORT:
        raise field_error(what, f"host:port of at most {max_chars} characters")
    return match.group(0)


def port(value: Any, what: str) -> int:
    """A TCP or UDP port, 1 to 65535."""
    number = integer(value, what, MAX_PORT)
    if number < 1:
        raise field_error(what, f"a port, 1 to {MAX_PORT}")
    return number
