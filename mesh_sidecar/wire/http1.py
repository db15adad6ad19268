"""HTTP/1.0 as bytes, for putting a forwarded request to this node's API server in memory. Pure: no I/O.

A member's forwarded request (wire/api_forward.py) is answered by this node's own
API server without a socket: net/api_forward.py hands the server's protocol the
request's HTTP/1.0 bytes and reads the answer it writes. HTTP/1.0, so the answer
needs no de-chunking: its head, then the body as is until the server closes.
"""

from __future__ import annotations

from ..errors import FrameTooLargeError, MalformedMessageError
from ..units import KIB
from .api_forward import HOP_BY_HOP_HEADERS, ForwardedRequest, ForwardedResponseHead, Headers

MAX_RESPONSE_HEAD_BYTES = 64 * KIB
_HEAD_END = b"\r\n\r\n"


def http1_request(request: ForwardedRequest, extra_headers: Headers = ()) -> bytes:
    """``request`` as an HTTP/1.0 request, with ``extra_headers`` after its own.

    Its fields passed wire/api_forward.py's checks (tokens, no CR or LF in a value), so
    nothing in them can start another header or request.
    """
    lines = [f"{request.method} {request.target} HTTP/1.0", "Host: mesh",
             f"Content-Length: {len(request.body)}"]
    lines += [f"{name}: {value}" for name, value in (*request.headers, *extra_headers)
              if name.lower() not in HOP_BY_HOP_HEADERS]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + request.body


class ResponseHeadReader:
    """An HTTP/1.x answer's head out of the bytes a server writes, however they were split.

    ``feed`` returns None until the head is in, then the head (hop-by-hop headers left out)
    and the body bytes that came with it, once. A MalformedMessageError for anything that is
    not an HTTP/1.x status line and headers; FrameTooLargeError past MAX_RESPONSE_HEAD_BYTES.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._done = False

    def feed(self, data: bytes) -> tuple[ForwardedResponseHead, bytes] | None:
        if self._done:
            raise RuntimeError("the head was already read")
        self._buffer += data
        end = self._buffer.find(_HEAD_END)
        if end < 0:
            if len(self._buffer) > MAX_RESPONSE_HEAD_BYTES:
                raise FrameTooLargeError(f"an answer's head is over {MAX_RESPONSE_HEAD_BYTES} bytes")
            return None
        self._done = True
        head = _parse_head(bytes(self._buffer[:end]).decode("latin-1"))
        return head, bytes(self._buffer[end + len(_HEAD_END):])


def _parse_head(text: str) -> ForwardedResponseHead:
    status_line, *header_lines = text.split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise MalformedMessageError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers: list[tuple[str, str]] = []
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise MalformedMessageError(f"not an HTTP header line: {line[:80]!r}")
        if name.lower() not in HOP_BY_HOP_HEADERS:
            headers.append((name, value.strip(" \t")))
    return ForwardedResponseHead(int(parts[1]), tuple(headers))
