"""Node tickets: one line of text that lets a peer find, authenticate and join a node.

A ticket carries the node id (its Ed25519 public key), the mesh secret and the
addresses the node listens on. People copy it between machines through chat,
email and terminals, so the text form is ``meshinf`` followed by lowercase
RFC 4648 base32 without padding: letters a-z and digits 2-7 only, one "word"
that a double-click selects whole and that shells and markdown leave alone.

Binary layout (integers big-endian)::

    +---------+-------------+-----------------+--------+-----------------+----------+
    | version | node_id     | mesh_secret     | n_addr | n_addr entries  | checksum |
    | u8 (=1) | 32 bytes    | 32 bytes        | u8     | (see below)     | 4 bytes  |
    +---------+-------------+-----------------+--------+-----------------+----------+

    entry:  +--------+------------------------+------+
            | family | ip                     | port |
            | u8 4|6 | 4 bytes (v4) | 16 (v6) | u16  |
            +--------+------------------------+------+

    checksum = sha256(every byte before it)[:4]

The checksum catches typos and accidental edits; it is not a signature. Trust
comes from the QUIC handshake, which proves the peer holds ``node_id``'s key.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
from dataclasses import dataclass

from ..errors import (
    TicketChecksumError,
    TicketMalformedError,
    TicketTruncatedError,
    TicketVersionError,
)
from ..identity import NODE_ID_BYTES
from .auth import MESH_SECRET_BYTES

TICKET_VERSION = 1
TICKET_PREFIX = "meshinf"
# What the CLI prints in front of a ticket; accepted (and ignored) on paste.
TICKET_LABEL = "Node ticket:"
MAX_TICKET_ADDRESSES = 16
# Far above the largest real ticket (~620 chars), so only junk is refused.
MAX_TICKET_CHARS = 2048

_BASE32_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
_BASE32_VALUE = {ch: i for i, ch in enumerate(_BASE32_ALPHABET)}
_BASE32_BITS_PER_CHAR = 5
_BITS_PER_BYTE = 8

_VERSION_BYTES = 1
_N_ADDR_BYTES = 1
_FAMILY_BYTES = 1
_PORT_BYTES = 2
_CHECKSUM_BYTES = 4
_HEADER_BYTES = _VERSION_BYTES + NODE_ID_BYTES + MESH_SECRET_BYTES + _N_ADDR_BYTES
_FAMILY_IPV4 = 4
_FAMILY_IPV6 = 6
_IP_BYTES = {_FAMILY_IPV4: 4, _FAMILY_IPV6: 16}
_MAX_PORT = 65535

_RECOPY = "Copy the whole `Node ticket:` line again from the node that printed it."


@dataclass(frozen=True)
class PeerAddress:
    """One IP literal and UDP port a node listens on; the host is kept in canonical form."""

    host: str
    port: int

    def __post_init__(self) -> None:
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError as exc:
            raise ValueError(f"{self.host!r} is not an IPv4 or IPv6 literal") from exc
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
            raise ValueError(f"{self.host!r} has a scope id, which a ticket cannot carry")
        if not isinstance(self.port, int) or not 1 <= self.port <= _MAX_PORT:
            raise ValueError(f"port {self.port!r} is not in 1..{_MAX_PORT}")
        # Canonical text makes equal addresses compare equal (and round-trip).
        object.__setattr__(self, "host", str(ip))

    @property
    def is_ipv6(self) -> bool:
        """Whether the host is an IPv6 address."""
        return ":" in self.host

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if self.is_ipv6 else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """The inverse of ``str()``: ``host:port`` or ``[v6]:port``; ValueError if not."""
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{text!r} is not host:port")
        return cls(host.removeprefix("[").removesuffix("]"), int(port))


@dataclass(frozen=True)
class Ticket:
    """What a peer needs to reach and join a node."""

    node_id: bytes
    mesh_secret: bytes
    addresses: tuple[PeerAddress, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, bytes) or len(self.node_id) != NODE_ID_BYTES:
            raise ValueError(f"node_id must be {NODE_ID_BYTES} bytes")
        if not isinstance(self.mesh_secret, bytes) or len(self.mesh_secret) != MESH_SECRET_BYTES:
            raise ValueError(f"mesh_secret must be {MESH_SECRET_BYTES} bytes")
        addresses = tuple(self.addresses)
        if not 1 <= len(addresses) <= MAX_TICKET_ADDRESSES:
            raise ValueError(
                f"a ticket holds 1..{MAX_TICKET_ADDRESSES} addresses, not {len(addresses)}"
            )
        if not all(isinstance(a, PeerAddress) for a in addresses):
            raise ValueError("addresses must be PeerAddress values")
        object.__setattr__(self, "addresses", addresses)


def encode_ticket(ticket: Ticket) -> str:
    """The copy-paste text form of ``ticket``: ``meshinf`` + lowercase unpadded base32."""
    body = bytearray([TICKET_VERSION])
    body += ticket.node_id
    body += ticket.mesh_secret
    body.append(len(ticket.addresses))
    for address in ticket.addresses:
        ip = ipaddress.ip_address(address.host)
        body.append(_FAMILY_IPV6 if address.is_ipv6 else _FAMILY_IPV4)
        body += ip.packed
        body += address.port.to_bytes(_PORT_BYTES, "big")
    body += _checksum(bytes(body))
    text = base64.b32encode(bytes(body)).decode("ascii").rstrip("=").lower()
    return TICKET_PREFIX + text


def decode_ticket(text: str) -> Ticket:
    """Parse a pasted ticket; raises only TicketError subclasses, with a sentence to show."""
    if not isinstance(text, str):
        raise TicketMalformedError(f"A ticket is text, not {type(text).__name__}. {_RECOPY}")
    if len(text) > MAX_TICKET_CHARS:
        raise TicketMalformedError(
            f"This is not a node ticket: it is {len(text)} characters long and a ticket is "
            f"at most {MAX_TICKET_CHARS}. Paste only the `Node ticket:` line."
        )
    text = text.strip()
    if text[: len(TICKET_LABEL)].casefold() == TICKET_LABEL.casefold():
        text = text[len(TICKET_LABEL) :].strip()
    if not text.startswith(TICKET_PREFIX):
        raise TicketMalformedError(
            f"This is not a node ticket: a ticket starts with `{TICKET_PREFIX}`. {_RECOPY}"
        )
    body = text[len(TICKET_PREFIX) :]
    for index, ch in enumerate(body, start=len(TICKET_PREFIX) + 1):
        if ch not in _BASE32_VALUE:
            raise TicketMalformedError(
                f"The ticket has the character {ch!r} at position {index}, "
                f"which no ticket contains (only a-z and 2-7). {_RECOPY}"
            )
    raw, tail_is_canonical = _base32_decode(body)
    return _parse(raw, tail_is_canonical)


def _checksum(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:_CHECKSUM_BYTES]


def _base32_decode(body: str) -> tuple[bytes, bool]:
    """The whole bytes in ``body`` and whether its trailing bits are what an encoder writes.

    Hand-rolled rather than ``base64.b32decode`` so a ticket cut at any length
    still yields its leading bytes (and so a "truncated" message), and so
    non-zero padding bits are caught instead of silently ignored.
    """
    acc = 0
    n_bits = 0
    out = bytearray()
    for ch in body:
        acc = (acc << _BASE32_BITS_PER_CHAR) | _BASE32_VALUE[ch]
        n_bits += _BASE32_BITS_PER_CHAR
        if n_bits >= _BITS_PER_BYTE:
            n_bits -= _BITS_PER_BYTE
            out.append(acc >> n_bits)
            acc &= (1 << n_bits) - 1
    # An encoder never emits a character that carries no byte, and pads with zeros.
    return bytes(out), n_bits < _BASE32_BITS_PER_CHAR and acc == 0


def _truncated() -> TicketTruncatedError:
    return TicketTruncatedError(
        f"The ticket is truncated: it is shorter than its header says. {_RECOPY}"
    )


def _parse(raw: bytes, tail_is_canonical: bool) -> Ticket:
    """Check ``raw`` in the order that gives the most useful message, then build the Ticket."""
    if len(raw) < _VERSION_BYTES:
        raise _truncated()
    if raw[0] != TICKET_VERSION:
        raise TicketVersionError(
            f"This ticket uses format version {raw[0]}, but this build of mesh-inference "
            f"reads version {TICKET_VERSION}. Upgrade mesh-inference on the older side, "
            "then make a new ticket."
        )
    if len(raw) < _HEADER_BYTES:
        raise _truncated()
    n_addr = raw[_HEADER_BYTES - 1]
    if n_addr > MAX_TICKET_ADDRESSES:
        raise TicketMalformedError(
            f"The ticket claims {n_addr} addresses; a ticket holds at most "
            f"{MAX_TICKET_ADDRESSES}. {_RECOPY}"
        )
    # Walk the entries to learn the length; the family byte decides each entry's size.
    entries: list[tuple[bytes, int]] = []
    offset = _HEADER_BYTES
    for _ in range(n_addr):
        if len(raw) < offset + _FAMILY_BYTES:
            raise _truncated()
        family = raw[offset]
        if family not in _IP_BYTES:
            raise TicketMalformedError(
                f"The ticket has an address of unknown family {family} (expected 4 or 6). {_RECOPY}"
            )
        ip_start = offset + _FAMILY_BYTES
        port_start = ip_start + _IP_BYTES[family]
        offset = port_start + _PORT_BYTES
        if len(raw) < offset:
            raise _truncated()
        port = int.from_bytes(raw[port_start:offset], "big")
        entries.append((raw[ip_start:port_start], port))
    end = offset + _CHECKSUM_BYTES
    if len(raw) < end:
        raise _truncated()
    if len(raw) > end:
        raise TicketMalformedError(
            f"The ticket has extra characters after its end: it is longer than its header "
            f"says. {_RECOPY}"
        )
    if not tail_is_canonical:
        raise TicketMalformedError(
            "The ticket does not end the way a ticket can: its last character was altered, "
            f"mistyped or added. {_RECOPY}"
        )
    if raw[offset:end] != _checksum(raw[:offset]):
        raise TicketChecksumError(
            f"The ticket's checksum does not match: it was altered or mistyped. {_RECOPY}"
        )
    if n_addr == 0:
        raise TicketMalformedError(
            f"The ticket lists no addresses, so there is nowhere to connect. {_RECOPY}"
        )
    addresses: list[PeerAddress] = []
    for packed, port in entries:
        # 4 packed bytes read as IPv4, 16 as IPv6.
        host = str(ipaddress.ip_address(packed))
        if port == 0:
            raise TicketMalformedError(
                f"The ticket gives port 0 for {host}, which no node listens on. {_RECOPY}"
            )
        addresses.append(PeerAddress(host, port))
    node_id = raw[_VERSION_BYTES : _VERSION_BYTES + NODE_ID_BYTES]
    mesh_secret = raw[_VERSION_BYTES + NODE_ID_BYTES : _HEADER_BYTES - _N_ADDR_BYTES]
    return Ticket(node_id, mesh_secret, tuple(addresses))
