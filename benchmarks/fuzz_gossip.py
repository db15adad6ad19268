"""Fuzz the gossip codec with atheris: ``.venv/bin/python -m benchmarks.fuzz_gossip [flags]``.

The first input byte picks what the rest becomes (see benchmarks/fuzzing.py for the run):

    0  a raw stream: the second byte + 1 is the read size; fed read by read, then ended
    1  one frame: a length prefix that matches, this build's version, the second byte as
       the message type, the rest as the JSON body (so mutations reach the schema checks)

Only WireError may escape; the decoder never holds more than one frame; and every message
that decodes must encode again and decode to itself (what we accept, we can relay).
"""

from __future__ import annotations

from mesh_sidecar.wire.gossip import (
    FRAME_HEADER_BYTES,
    GOSSIP_WIRE_VERSION,
    LENGTH_PREFIX_BYTES,
    MAX_GOSSIP_FRAME_BYTES,
    GossipDecoder,
    GossipMessage,
    Leave,
    MemberInfo,
    MemberList,
    Ping,
    Pong,
    Rekey,
    RpcOrder,
    encode_message,
)

from .fuzzing import Input, chunks, run

_STREAM, _FRAME = 0, 1
_FRAME_CAP_BYTES = LENGTH_PREFIX_BYTES + MAX_GOSSIP_FRAME_BYTES

_A, _B = b"\xaa" * 32, b"\xbb" * 32
SAMPLES: tuple[GossipMessage, ...] = (
    MemberList(
        (
            MemberInfo(
                node_id=_A,
                name="worker a",
                addresses=("192.0.2.7:7447", "[2001:db8::1]:7447"),
                version="0.1.0",
                capacity=(("free_ram_bytes", 8 << 30), ("free_vram_bytes", 0)),
                serving=False,
                rpc_ready=True,
            ),
        )
    ),
    Leave(_A, "shutting down"),
    RpcOrder((_A, _B)),
    Ping(7, 1.5),
    Pong(7, 1.5),
    Rekey(epoch=2, secret=b"\x5a" * 32, removed=(_B,), by=_A),
)


def _check_relayable(msg: GossipMessage) -> None:
    again = GossipDecoder()
    again.feed(encode_message(msg))
    assert again.next_message() == msg


def fuzz_one(data: bytes) -> None:
    """Decode one input as the mode byte says; raises WireError or, on a bug, anything."""
    src = Input(data)
    mode, knob = src.byte() % 2, src.byte()
    if mode == _FRAME:
        payload = bytes((GOSSIP_WIRE_VERSION, knob)) + src.rest()
        reads = [len(payload).to_bytes(LENGTH_PREFIX_BYTES, "big") + payload]
    else:
        reads = chunks(src.rest(), knob + 1)
    decoder = GossipDecoder()
    for read in reads:
        decoder.feed(read)
        assert decoder.buffered_bytes <= _FRAME_CAP_BYTES
        while (msg := decoder.next_message()) is not None:
            _check_relayable(msg)
    decoder.end_of_stream()


def seeds() -> list[bytes]:
    """Every sample as one frame, and all of them as one stream."""
    frames = [encode_message(msg) for msg in SAMPLES]
    by_frame = [
        bytes((_FRAME, msg.TYPE)) + frame[LENGTH_PREFIX_BYTES + FRAME_HEADER_BYTES :]
        for msg, frame in zip(SAMPLES, frames)
    ]
    return [*by_frame, bytes((_STREAM, 6)) + b"".join(frames)]


if __name__ == "__main__":
    run("gossip", fuzz_one, seeds())
