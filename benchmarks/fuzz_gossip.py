"""Fuzz the gossip codec with atheris: ``.venv/bin/python -m benchmarks.fuzz_gossip [flags]``.

The first input byte picks what the rest becomes (see benchmarks/fuzzing.py for the run):

    0  a raw control stream: the second byte + 1 is the read size; split into frames
       (wire/frames.py) as a connection does, each frame decoded
    1  one frame's payload: this build's version, the second byte as the message type,
       the rest as the JSON body (so mutations reach the schema checks)

Only WireError may escape; and every message
that decodes must encode again and decode to itself (what we accept, we can relay).
"""

from __future__ import annotations

from mesh_sidecar.wire import gossip
from mesh_sidecar.wire.frames import MAX_CONTROL_MESSAGE_BYTES, FrameDecoder, encode_frame
from mesh_sidecar.wire.layer_share import LayersFetched, LayerShare, SharedTensor
from mesh_sidecar.wire.rpc_hello import RpcVersion

from .fuzzing import Input, chunks, run

_STREAM, _FRAME = 0, 1

_A, _B = b"\xaa" * 32, b"\xbb" * 32
SAMPLES: tuple[gossip.GossipMessage, ...] = (
    gossip.MemberList(
        (
            gossip.MemberInfo(
                node_id=_A,
                name="worker a",
                addresses=("192.0.2.7:7447", "[2001:db8::1]:7447"),
                version="0.1.0",
                capacity=(("free_ram_bytes", 8 << 30), ("free_vram_bytes", 0)),
                serving=False,
                rpc_ready=True,
                llama_build=gossip.LlamaBuild(RpcVersion(7, 0, 1), True, "llama-cpp-python 0.3.36 b2b"),
            ),
        )
    ),
    gossip.Leave(_A, "shutting down"),
    gossip.RpcOrder((_A, _B)),
    gossip.Ping(7, 1.5),
    gossip.Pong(7, 1.5),
    gossip.Rekey(epoch=2, secret=b"\x5a" * 32, removed=(_B,), by=_A),
    gossip.Observed("203.0.113.5:47470"),
    LayerShare("5" * 64, "bartowski/Qwen3-8B-GGUF", "c" * 40, ("Qwen3-8B-Q4_K_M.gguf",),
               (SharedTensor(0, 5_242_880, 11_075_584, "0123456789abcdef", "a" * 64),)),
    LayersFetched("5" * 64, 1, 11_075_584, ""),
)


def fuzz_one(data: bytes) -> None:
    """Decode one input as the mode byte says; raises WireError or, on a bug, anything.

    _FRAME: one control frame's payload with the type byte given. _STREAM: a control
    stream cut into reads, split into frames as a connection does, each decoded.
    """
    src = Input(data)
    mode, knob = src.byte() % 2, src.byte()
    if mode == _FRAME:
        payloads = [bytes((gossip.GOSSIP_WIRE_VERSION, knob)) + src.rest()]
    else:
        decoder, payloads = FrameDecoder(MAX_CONTROL_MESSAGE_BYTES), []
        for read in chunks(src.rest(), knob + 1):
            decoder.feed(read)
            while (payload := decoder.next_frame()) is not None:
                payloads.append(payload)
    for payload in payloads:
        msg = gossip.decode_message(payload)
        # What we accept from one peer we may relay to the others.
        assert gossip.decode_message(gossip.encode_message(msg)) == msg


def seeds() -> list[bytes]:
    """Every sample as one frame, and all of them as one stream."""
    payloads = [gossip.encode_message(msg) for msg in SAMPLES]
    by_frame = [bytes((_FRAME, msg.TYPE)) + payload[gossip.MESSAGE_HEADER_BYTES:]
                for msg, payload in zip(SAMPLES, payloads, strict=True)]
    return [*by_frame, bytes((_STREAM, 6)) + b"".join(encode_frame(p) for p in payloads)]


if __name__ == "__main__":
    run("gossip", fuzz_one, seeds())
