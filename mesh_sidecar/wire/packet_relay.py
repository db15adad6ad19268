"""The relay's wire format: asking a member to relay, its answer, and the packets it carries. Pure: no I/O.

When two members cannot reach each other, one opens a RELAY_REQUEST stream to a
member both are connected to, naming the other; the relay answers, opens a
RELAY_DELIVERY stream to the other naming the first, and copies packets between
the two streams. The packets are the two members' own QUIC datagrams, so their
connection's TLS, admission and mesh-secret proof stay end to end::

    RELAY_REQUEST  stream (after its kind byte):  target node id (32 bytes)
    RELAY_DELIVERY stream (after its kind byte):  source node id (32 bytes)
    relay's answer on the request stream:         status u8 (0 accepted, 1 refused), reason length u8, reason
    then, both ways on both streams:              packets, each: length u16 big-endian, datagram
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import FrameTooLargeError, MalformedMessageError

PACKET_HEADER = struct.Struct("!H")
# A QUIC datagram never exceeds a UDP payload; ours stay far below (path_mtu.py).
MAX_PACKET_BYTES = 65_527
ACCEPTED, REFUSED = 0, 1
MAX_REASON_BYTES = 255


def encode_packet(datagram: bytes) -> bytes:
    if len(datagram) > MAX_PACKET_BYTES:
        raise FrameTooLargeError(f"a relayed datagram of {len(datagram)} bytes is over {MAX_PACKET_BYTES}")
    return PACKET_HEADER.pack(len(datagram)) + datagram


class PacketDecoder:
    """Relayed packets out of a stream's bytes, however they were split."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        packets = []
        while len(self._buffer) >= PACKET_HEADER.size:
            (size,) = PACKET_HEADER.unpack_from(self._buffer)
            end = PACKET_HEADER.size + size
            if len(self._buffer) < end:
                break
            packets.append(bytes(self._buffer[PACKET_HEADER.size:end]))
            del self._buffer[:end]
        return packets


@dataclass(frozen=True)
class RelayAnswer:
    """The relay's answer to a request: accepted, or refused with why."""

    accepted: bool
    reason: str = ""

    def encode(self) -> bytes:
        reason = self.reason.encode()[:MAX_REASON_BYTES]
        return bytes((ACCEPTED if self.accepted else REFUSED, len(reason))) + reason

    @classmethod
    def decode_head(cls, head: bytes) -> tuple[bool, int]:
        """From the answer's first two bytes: whether accepted, and how many reason bytes follow."""
        status, length = head[0], head[1]
        if status not in (ACCEPTED, REFUSED):
            raise MalformedMessageError(f"a relay answer with status {status}")
        return status == ACCEPTED, length
