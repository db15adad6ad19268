"""llama.cpp RPC HELLO as a client speaks it: the request, the reply's version and b2b flag, who accepts whom.

A node asks its own rpc-server this once, right after starting it, and announces
the answer in gossip (``LlamaBuild``). Request, client -> server::

    0        1             9
    +--------+-------------+----------+
    | 14 u8  | size u64 LE | caps[24] |   upstream 7.x: size 24, caps all zero (no RDMA)
    +--------+-------------+----------+
    | 14 u8  | 0 u64 LE    |              the b2b fork 3.x and older upstream builds
    +--------+-------------+

Reply, server -> client (rpc_framing.py draws it too)::

    +-------------+----------+----------+----------+----------+----------+
    | size u64 LE | major u8 | minor u8 | patch u8 | flags u8 | caps[24] |   7.x, size 28
    +-------------+----------+----------+----------+----------+----------+
    | size u64 LE | major u8 | minor u8 | patch u8 |                          older, size 3
    +-------------+----------+----------+----------+

A server answers a HELLO of the wrong size by closing the connection, so a client
that does not know the server's age tries the 7.x request first, then the old one.

Compatibility (ggml-rpc.cpp, ``negotiate_hello``): a client accepts a server whose
major equals its own and whose minor is not newer than its own; the patch number
is never compared. Anything else makes llama-server give up on the endpoint and abort.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import MalformedMessageError
from .rpc_framing import (
    B2B_HELLO_FLAG,
    FORK_HELLO_REPLY_BYTES,
    HELLO_CMD,
    HELLO_REPLY_CAPS_OFFSET,
    HELLO_REPLY_FLAGS_OFFSET,
    REPLY_SIZE,
    REPLY_SIZE_BYTES,
    RPC_CONN_CAPS_BYTES,
    RPC_HEADER,
)

HELLO_REQUEST = RPC_HEADER.pack(HELLO_CMD, RPC_CONN_CAPS_BYTES) + bytes(RPC_CONN_CAPS_BYTES)
OLD_HELLO_REQUEST = RPC_HEADER.pack(HELLO_CMD, 0)
HELLO_REPLY_BYTES = HELLO_REPLY_CAPS_OFFSET + RPC_CONN_CAPS_BYTES
_REPLY_SIZES = (HELLO_REPLY_BYTES, FORK_HELLO_REPLY_BYTES)
_VERSION_PART_MAX = 255  # each part is a u8 on the wire
_VERSION_RE = re.compile(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})")


@dataclass(frozen=True, order=True)
class RpcVersion:
    """An RPC protocol version, as a HELLO reply states it."""

    major: int
    minor: int
    patch: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @classmethod
    def parse(cls, text: str) -> RpcVersion:
        """From "major.minor.patch"; ValueError if it is not three numbers of 0 to 255."""
        match = _VERSION_RE.fullmatch(text)
        if match is None or any(int(part) > _VERSION_PART_MAX for part in match.groups()):
            raise ValueError(f"not an RPC version (major.minor.patch, each 0 to 255): {text!r}")
        return cls(*(int(part) for part in match.groups()))


@dataclass(frozen=True)
class HelloReply:
    """What a server said about itself in its HELLO reply."""

    version: RpcVersion
    b2b: bool
    """The reply carried our b2b patch's flag (llama/patches/llama.cpp-b2b.patch)."""


def hello_reply_size(size_field: bytes) -> int:
    """The payload size from a reply's first 8 bytes; MalformedMessageError unless it is a HELLO reply's."""
    size: int = REPLY_SIZE.unpack(size_field[:REPLY_SIZE_BYTES])[0]
    if size not in _REPLY_SIZES:
        raise MalformedMessageError(
            f"the rpc-server's reply has {size} bytes, not a HELLO reply's {' or '.join(map(str, _REPLY_SIZES))}")
    return size


def decode_hello_reply(payload: bytes) -> HelloReply:
    """A HELLO reply's payload (after its size) -> version and b2b flag."""
    if len(payload) not in _REPLY_SIZES:
        raise MalformedMessageError(f"a HELLO reply of {len(payload)} bytes is neither the 7.x nor the old form")
    flags = payload[HELLO_REPLY_FLAGS_OFFSET] if len(payload) > HELLO_REPLY_FLAGS_OFFSET else 0
    return HelloReply(RpcVersion(payload[0], payload[1], payload[2]), bool(flags & B2B_HELLO_FLAG))


def accepts(client: RpcVersion, server: RpcVersion) -> bool:
    """Whether a llama-server speaking ``client`` talks to an rpc-server speaking ``server``."""
    return server.major == client.major and server.minor <= client.minor
