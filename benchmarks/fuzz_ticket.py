"""Fuzz the ticket decoder with atheris: ``.venv/bin/python -m benchmarks.fuzz_ticket [flags]``.

The first input byte picks what the rest becomes (see benchmarks/fuzzing.py for the run):

    0  pasted text: UTF-8, undecodable bytes kept as lone surrogates
    1  ``meshinf`` + base32 of the raw bytes: the base32, length and checksum checks
    2  the same with a valid checksum appended: past the checksum, into every field check

Only TicketError may escape, and a ticket that decodes from 1 or 2 must encode back to
the very text it came from: the decoder accepts one spelling of each ticket.
"""

from __future__ import annotations

import base64
import hashlib

from mesh_sidecar.wire.ticket import TICKET_PREFIX, decode_ticket, encode_ticket
from tests.unit.test_ticket import SAMPLE

from .fuzzing import Input, run

_CHECKSUM_BYTES = 4
_TEXT, _RAW, _CHECKSUMMED = 0, 1, 2

def _b32_text(raw: bytes) -> str:
    return TICKET_PREFIX + base64.b32encode(raw).decode("ascii").rstrip("=").lower()


def fuzz_one(data: bytes) -> None:
    """Decode one input as the mode byte says; raises TicketError or, on a bug, anything."""
    src = Input(data)
    mode = src.byte() % 3
    rest = src.rest()
    if mode == _TEXT:
        decode_ticket(rest.decode("utf-8", "surrogateescape"))
        return
    if mode == _CHECKSUMMED:
        rest += hashlib.sha256(rest).digest()[:_CHECKSUM_BYTES]
    text = _b32_text(rest)
    assert encode_ticket(decode_ticket(text)) == text


def seeds() -> list[bytes]:
    """The sample ticket in each mode's form."""
    text = encode_ticket(SAMPLE)
    body = text[len(TICKET_PREFIX) :].upper()
    raw = base64.b32decode(body + "=" * (-len(body) % 8))
    return [
        bytes([_TEXT]) + f"Node ticket: {text}\n".encode(),
        bytes([_RAW]) + raw,
        bytes([_CHECKSUMMED]) + raw[:-_CHECKSUM_BYTES],
    ]


if __name__ == "__main__":
    run("ticket", fuzz_one, seeds())
