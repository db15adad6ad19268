"""Length-prefixed frames: how the control stream carries admission and gossip messages.

    0       1       2       3       4
    +-------+-------+-------+-------+---------------- - -
    |    length (u32, big-endian)   | payload ...
    +-------+-------+-------+-------+---------------- - -

The decoder buffers bytes as they arrive and hands out whole payloads; a length
over its limit is refused before any of the payload is buffered.
"""

from __future__ import annotations

import struct

from ..errors import FrameTooLargeError

FRAME_HEADER = struct.Struct("!I")
# A control message after admission, with its header, fills at most one stream receive window
# (1 MiB, net/quic.py): a member list of 256 members at every field's limit (about 820 KB) fits.
MAX_CONTROL_MESSAGE_BYTES = 1024 * 1024 - FRAME_HEADER.size


def encode_frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Splits a byte stream into frames; refuses one over ``max_frame_bytes``."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next_frame(self) -> bytes | None:
        """The next whole frame's payload, or None until more bytes arrive."""
        if len(self._buffer) < FRAME_HEADER.size:
            return None
        (length,) = FRAME_HEADER.unpack_from(self._buffer)
        if length > self.max_frame_bytes:
            raise FrameTooLargeError(f"control frame of {length} bytes is over the limit of {self.max_frame_bytes}")
        end = FRAME_HEADER.size + length
        if len(self._buffer) < end:
            return None
        frame = bytes(self._buffer[FRAME_HEADER.size : end])
        del self._buffer[:end]
        return frame
