"""Fuzz the RPC stream filter with atheris: ``.venv/bin/python -m benchmarks.fuzz_rpc_framing``.

Input layout (see benchmarks/fuzzing.py for the run)::

    +-----------+-----------+-------------+---------------------------------------------+
    | handshake | read size | reply after | rest                                        |
    | u8        | u8 (+1)   | u8 (reads)  |                                             |
    +-----------+-----------+-------------+---------------------------------------------+

    handshake < len(DIALECTS): that row's HELLO request goes before the rest (the client
               stream) and its HELLO reply is the server's bytes: valid handshakes, random frames
    otherwise: the next byte n, n server bytes, then the client stream: the handshake itself
               is fuzzed (flipped sizes, versions, caps)

The client stream is fed read by read, the server's bytes after the chosen read. The
resolver answers by peer id: nothing, an endpoint, one too long in bytes, one too long in
characters. Only WireError may escape, and no more bytes may leave than came in (a rewrite
keeps the frame's size).
"""

from __future__ import annotations

import struct

from mesh_sidecar.wire.rpc_framing import (
    DIALECTS,
    HELLO_CMD,
    HELLO_REPLY_CAPS_OFFSET,
    HELLO_REPLY_FLAGS_OFFSET,
    REGISTER_PEER_ENDPOINT_BYTES,
    RpcDialect,
    RpcStreamFilter,
)

from .fuzzing import Input, chunks, run

_HEADER = struct.Struct("<BQ")
_REPLY_SIZE = struct.Struct("<Q")
_PATCH = 0
# Resolver answers by peer_id % 4; the last two do not fit the field (bytes, then characters).
_ENDPOINTS = (None, "127.0.0.1:41001", "x" * 200, "\u00fc" * 100)


def rpc_frame(cmd: int, payload: bytes) -> bytes:
    """One client command: cmd, size, payload."""
    return _HEADER.pack(cmd, len(payload)) + payload


def dialect_handshake(dialect: RpcDialect) -> tuple[bytes, bytes]:
    """A HELLO request and the server's reply (size included) that select ``dialect``."""
    reply = bytearray(dialect.hello_reply_bytes)
    reply[:3] = bytes((dialect.major, dialect.min_minor, _PATCH))
    if dialect.hello_reply_bytes > HELLO_REPLY_CAPS_OFFSET:
        caps_bytes = dialect.hello_reply_bytes - HELLO_REPLY_CAPS_OFFSET
        reply[HELLO_REPLY_CAPS_OFFSET:] = dialect.required_caps.to_bytes(caps_bytes, "little")
        reply[HELLO_REPLY_FLAGS_OFFSET] = dialect.required_flags
    request = rpc_frame(HELLO_CMD, bytes(dialect.hello_request_bytes))
    return request, _REPLY_SIZE.pack(len(reply)) + bytes(reply)


def _resolve(peer_id: int) -> str | None:
    return _ENDPOINTS[peer_id % len(_ENDPOINTS)]


def fuzz_one(data: bytes) -> None:
    """Run one input through a filter; raises WireError or, on a bug, anything."""
    src = Input(data)
    handshake, read_bytes, reply_after = src.byte(), src.byte() + 1, src.byte()
    if handshake < len(DIALECTS):
        request, server = dialect_handshake(DIALECTS[handshake])
        client = request + src.rest()
    else:
        server = src.take(src.byte())
        client = src.rest()
    reads = chunks(client, read_bytes)
    reply_after = min(reply_after, len(reads))
    flt = RpcStreamFilter(_resolve)
    sent = fed = 0
    for side, chunk in [
        *(("c", r) for r in reads[:reply_after]),
        ("s", server),
        *(("c", r) for r in reads[reply_after:]),
    ]:
        if side == "s":
            flt.receive_from_server(chunk)
        else:
            flt.receive_from_client(chunk)
            fed += len(chunk)
        sent += len(flt.data_to_server())
        assert sent <= fed, (sent, fed)
        while flt.next_event() is not None:
            pass


def seeds() -> list[bytes]:
    """Per dialect: frames every dialect has and its REGISTER_PEER; then raw handshakes."""
    frames = rpc_frame(15, b"") + rpc_frame(0, bytes(12)) + rpc_frame(6, bytes(400))
    out = []
    for i, dialect in enumerate(DIALECTS):
        body = frames
        if dialect.register_peer_cmd is not None:
            for peer_id in range(len(_ENDPOINTS)):
                endpoint = f"192.168.1.{20 + peer_id}:50052".encode()
                payload = struct.pack(f"<I{REGISTER_PEER_ENDPOINT_BYTES}s", peer_id, endpoint)
                body += rpc_frame(dialect.register_peer_cmd, payload)
        out.append(bytes((i, 255, 1)) + body)
        request, reply = dialect_handshake(dialect)
        out.append(bytes((len(DIALECTS), 255, 1, len(reply))) + reply + request + body)
    return out


if __name__ == "__main__":
    run("rpc-framing", fuzz_one, seeds())
