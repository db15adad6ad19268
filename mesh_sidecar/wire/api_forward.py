"""An HTTP request forwarded to a member's API over a QUIC stream, and its answer. Pure: no I/O.

A node whose API gets a request for a model another member serves sends it on an
API_FORWARD stream (wire/stream_kind.py); that member's sidecar makes the same
request to its own API on loopback and streams the answer back as it comes::

    API_FORWARD stream, after its kind byte:

    request    0        1        2        3        4        5
               +--------+--------+--------+--------+--------+---------- - -  +------------- - -
               |version |   head length (u32, big-endian)   | head (JSON)    | body
               +--------+--------+--------+--------+--------+---------- - -  +------------- - -
               then nothing more until the whole answer is in: the requester's FIN (or a
               reset) before that means its client went away, and the answer is cancelled

    answer     version u8 | head length u32 BE | head (JSON) | body bytes until FIN

    request head   {"method": str, "target": str, "headers": [[name, value], ...], "body_bytes": int}
    answer head    {"status": int, "headers": [[name, value], ...]}

    version      FORWARD_VERSION; anything else is ProtocolVersionError
    head length  at most MAX_FORWARD_HEAD_BYTES; the head is one UTF-8 JSON object with
                 exactly the keys shown (a new key means a new version)
    method       an HTTP token ("POST")
    target       path and query as sent on the request line: starts with "/", visible ASCII
    headers      at most MAX_FORWARDED_HEADERS; names are HTTP tokens, values what HTTP carries
                 (no CR, LF or other control character; each character one byte, as Latin-1);
                 never hop-by-hop ones (HOP_BY_HOP_HEADERS: each end drops them)
    body_bytes   how many body bytes follow the head, at most MAX_FORWARDED_BODY_BYTES
    status       100 to 599

An answer's body is the HTTP body as sent (any Content-Encoding kept); its end is the
stream's FIN, so it carries no Content-Length. A stream reset before the FIN means the
answer broke off. Any error here is a WireError subclass whose message names what was wrong.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import FrameTooLargeError, MalformedMessageError, ProtocolVersionError
from ..units import KIB, MIB

FORWARD_VERSION = 1
PREFIX = struct.Struct("!BI")  # version u8 | head length u32
MAX_FORWARD_HEAD_BYTES = 64 * KIB
# The API port refuses larger bodies (serve/access.py takes this limit), so any it accepted can be forwarded.
MAX_FORWARDED_BODY_BYTES = 8 * MIB
MAX_FORWARDED_HEADERS = 64
MIN_STATUS, MAX_STATUS = 100, 599
# Sent by the forwarding member's sidecar with its mesh's token, so the serving member's API
# knows the request came from an admitted member. A value a peer sent is dropped, never passed on.
FORWARDED_TOKEN_HEADER = "Mesh-Forwarded"
# Headers that describe one hop, not the message (RFC 9110 section 7.6.1), and those each
# HTTP client recomputes for its own hop. A forwarded body ends at FIN: no Content-Length.
HOP_BY_HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length",
})

_TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET_RE = re.compile(r"/[\x21-\x7e]*")
# HTTP's field-value (h11's rule): visible characters and obs-text, spaces and tabs only between them.
_VALUE_RE = re.compile(r"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?")
_REQUEST_KEYS = frozenset({"method", "target", "headers", "body_bytes"})
_ANSWER_KEYS = frozenset({"status", "headers"})

Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the forwarding member received it."""

    method: str  # "POST"
    target: str  # path and query: "/v1/chat/completions"
    headers: Headers  # (name, value) pairs in their order, repeats kept
    body: bytes


@dataclass(frozen=True)
class ForwardedResponseHead:
    """The status line and headers of the serving member's answer; its body follows on the stream."""

    status: int
    headers: Headers


def openai_error_body(message: str, error_type: str, code: str) -> dict[str, Any]:
    """An error in the shape OpenAI clients parse: what a node's API answers, whole or as a stream's last
    event, wherever the error arose (this node, or the member a request was forwarded to)."""
    return {"error": {"message": message, "type": error_type, "code": code}}


def encode_request(request: ForwardedRequest) -> bytes:
    """The request's bytes on the stream (after the kind byte); a WireError if it breaks a rule above."""
    _check_method(request.method)
    _check_target(request.target)
    _check_headers(request.headers, "request")
    _check_body_bytes(len(request.body))
    head = {"method": request.method, "target": request.target,
            "headers": [list(pair) for pair in request.headers], "body_bytes": len(request.body)}
    return _encode_head(head, "request") + request.body


def encode_response_head(head: ForwardedResponseHead) -> bytes:
    """The answer's first bytes; its body follows as is. A WireError if it breaks a rule above."""
    _check_status(head.status)
    _check_headers(head.headers, "answer")
    return _encode_head({"status": head.status, "headers": [list(pair) for pair in head.headers]}, "answer")


class RequestDecoder:
    """A forwarded request out of a stream's bytes, however they were split.

    ``feed`` returns None until the whole request is in, then the request, once. Bytes
    after the body are not part of it: version 1 gives them no meaning. Those that came
    in the same ``feed`` as the body's last byte are kept in ``leftover`` (the server
    ignores them); ``feed`` after the request is a caller's mistake (RuntimeError).
    At most the head and body, and one fed chunk, are ever held.
    """

    def __init__(self) -> None:
        self._head = _HeadReader("request")
        self._request: tuple[str, str, Headers, int] | None = None  # the head, decoded
        self._done = False
        self.leftover = b""

    def feed(self, data: bytes) -> ForwardedRequest | None:
        if self._done:
            raise RuntimeError("RequestDecoder.feed() after the request was complete")
        if self._request is None:
            if (fields := self._head.feed(data)) is None:
                return None
            self._request = _request_fields(fields)
            data = b""
        method, target, headers, body_bytes = self._request
        if (buffer := self._head.take_rest(data, body_bytes)) is None:
            return None
        self._done = True
        self.leftover = buffer[body_bytes:]
        return ForwardedRequest(method, target, headers, buffer[:body_bytes])

    def feed_eof(self) -> None:
        """The stream ended: a MalformedMessageError naming where, unless the request was complete."""
        if not self._done:
            where = "head" if self._request is None else "body"
            raise MalformedMessageError(
                f"the forwarded request ended in its {where}, after {self._head.received} bytes")


class ResponseHeadDecoder:
    """A forwarded answer's head out of a stream's bytes, however they were split.

    ``feed`` returns None until the head is in, then (head, the body bytes that came with
    it), once; every later byte on the stream is body. ``feed`` after that is a caller's
    mistake (RuntimeError).
    """

    def __init__(self) -> None:
        self._head = _HeadReader("answer")
        self._done = False

    def feed(self, data: bytes) -> tuple[ForwardedResponseHead, bytes] | None:
        if self._done:
            raise RuntimeError("ResponseHeadDecoder.feed() after the head was complete")
        if (fields := self._head.feed(data)) is None:
            return None
        self._done = True
        _check_keys(fields, _ANSWER_KEYS, "answer")
        status = _int_field(fields, "status", "answer")
        _check_status(status)
        head = ForwardedResponseHead(status, _headers_field(fields["headers"], "answer"))
        return head, self._head.rest()

    def feed_eof(self) -> None:
        """The stream ended: a MalformedMessageError unless the head was complete."""
        if not self._done:
            raise MalformedMessageError(
                f"the forwarded answer ended in its head, after {self._head.received} bytes")


class _HeadReader:
    """The version, head length and JSON head that open both directions; then what follows, buffered."""

    def __init__(self, what: str) -> None:
        self._what = what  # "request" or "answer", for messages
        self._buffer = bytearray()
        self._head_bytes: int | None = None
        self.received = 0  # bytes fed so far

    def feed(self, data: bytes) -> dict[str, Any] | None:
        """The head's JSON object once it is all in (the bytes after it stay buffered), else None."""
        self._buffer += data
        self.received += len(data)
        if self._head_bytes is None:
            if self._buffer and self._buffer[0] != FORWARD_VERSION:
                raise ProtocolVersionError(
                    f"a forwarded {self._what} of version {self._buffer[0]}; this node speaks {FORWARD_VERSION}")
            if len(self._buffer) < PREFIX.size:
                return None
            _, self._head_bytes = PREFIX.unpack_from(self._buffer)
            _check_head_bytes(self._head_bytes, self._what)
        end = PREFIX.size + self._head_bytes
        if len(self._buffer) < end:
            return None
        fields = _decode_head(bytes(self._buffer[PREFIX.size:end]), self._what)
        del self._buffer[:end]
        return fields

    def take_rest(self, data: bytes, needed: int) -> bytes | None:
        """Once ``needed`` bytes follow the head: all of them buffered (:meth:`rest`), else None."""
        self._buffer += data
        self.received += len(data)
        return self.rest() if len(self._buffer) >= needed else None

    def rest(self) -> bytes:
        """What is buffered after the head, the buffer emptied."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest


def _encode_head(fields: dict[str, object], what: str) -> bytes:
    head = json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()
    _check_head_bytes(len(head), what)
    return PREFIX.pack(FORWARD_VERSION, len(head)) + head


def _decode_head(head: bytes, what: str) -> dict[str, Any]:
    try:
        fields = json.loads(head.decode(), object_pairs_hook=_no_repeated_keys)
    except UnicodeDecodeError as exc:
        raise MalformedMessageError(f"a forwarded {what}'s head is not UTF-8 ({exc.reason})") from None
    except ValueError as exc:  # json.JSONDecodeError, or a key given twice
        raise MalformedMessageError(f"a forwarded {what}'s head is not a JSON object ({exc})") from None
    except RecursionError:
        raise MalformedMessageError(f"a forwarded {what}'s head nests too deep") from None
    if not isinstance(fields, dict):
        raise MalformedMessageError(f"a forwarded {what}'s head is JSON but not an object")
    return fields


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    fields = dict(pairs)
    if len(fields) != len(pairs):
        raise ValueError("a key given twice")
    return fields


def _request_fields(fields: dict[str, Any]) -> tuple[str, str, Headers, int]:
    _check_keys(fields, _REQUEST_KEYS, "request")
    method, target = fields["method"], fields["target"]
    if not isinstance(method, str) or not isinstance(target, str):
        raise MalformedMessageError("a forwarded request's method and target must be strings")
    _check_method(method)
    _check_target(target)
    body_bytes = _int_field(fields, "body_bytes", "request")
    _check_body_bytes(body_bytes)
    return method, target, _headers_field(fields["headers"], "request"), body_bytes


def _check_keys(fields: dict[str, Any], keys: frozenset[str], what: str) -> None:
    if fields.keys() != keys:
        missing, extra = sorted(keys - fields.keys()), sorted(fields.keys() - keys)
        raise MalformedMessageError(f"a forwarded {what}'s head lacks {missing} or has unknown keys {extra}")


def _int_field(fields: dict[str, Any], key: str, what: str) -> int:
    value = fields[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedMessageError(f"a forwarded {what}'s {key} is not an integer: {value!r:.40}")
    return value


def _headers_field(value: Any, what: str) -> Headers:
    if not isinstance(value, list):
        raise MalformedMessageError(f"a forwarded {what}'s headers are not a list")
    if len(value) > MAX_FORWARDED_HEADERS:
        raise MalformedMessageError(f"a forwarded {what} has {len(value)} headers, over {MAX_FORWARDED_HEADERS}")
    headers = []
    for pair in value:
        if (not isinstance(pair, list) or len(pair) != 2
                or not isinstance(pair[0], str) or not isinstance(pair[1], str)):
            raise MalformedMessageError(f"a forwarded {what} has a header that is not [name, value]: {pair!r:.60}")
        headers.append((pair[0], pair[1]))
    result = tuple(headers)
    _check_headers(result, what)
    return result


def _check_head_bytes(size: int, what: str) -> None:
    if size > MAX_FORWARD_HEAD_BYTES:
        raise FrameTooLargeError(f"a forwarded {what}'s head of {size} bytes is over {MAX_FORWARD_HEAD_BYTES}")


def _check_method(method: str) -> None:
    if not _TOKEN_RE.fullmatch(method):
        raise MalformedMessageError(f"a forwarded request's method {method!r:.40} is not an HTTP token")


def _check_target(target: str) -> None:
    if not _TARGET_RE.fullmatch(target):
        raise MalformedMessageError(
            f"a forwarded request's target {target!r:.80} does not start with '/' or has a character "
            "other than visible ASCII")


def _check_body_bytes(size: int) -> None:
    if size < 0:
        raise MalformedMessageError(f"a forwarded request's body_bytes is negative ({size})")
    if size > MAX_FORWARDED_BODY_BYTES:
        raise FrameTooLargeError(f"a forwarded request's body of {size} bytes is over {MAX_FORWARDED_BODY_BYTES}")


def _check_status(status: int) -> None:
    if not MIN_STATUS <= status <= MAX_STATUS:
        raise MalformedMessageError(f"a forwarded answer's status {status} is not within {MIN_STATUS}-{MAX_STATUS}")


def _check_headers(headers: Headers, what: str) -> None:
    if len(headers) > MAX_FORWARDED_HEADERS:
        raise MalformedMessageError(f"a forwarded {what} has {len(headers)} headers, over {MAX_FORWARDED_HEADERS}")
    for name, value in headers:
        if not _TOKEN_RE.fullmatch(name):
            raise MalformedMessageError(f"a forwarded {what}'s header name {name!r:.40} is not an HTTP token")
        if not _VALUE_RE.fullmatch(value):
            raise MalformedMessageError(
                f"a forwarded {what}'s header {name!r} has a value HTTP does not carry (CR, LF or another "
                f"control character, a character over \\xff, or a space at an end): {value!r:.60}")
