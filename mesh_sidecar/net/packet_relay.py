"""Relayed paths: a member's QUIC packets to another member through a third, and relaying for others.

When neither of two members can reach the other (a router that maps every
destination to a new port, carrier-grade NAT), their QUIC connection runs over a
*circuit*: a stream to a member both reach (the relay), which copies packets to a
stream of its own to the other member (wire/packet_relay.py). The QUIC connection over
it is an ordinary one, addressed to a *virtual address* that stands for the
circuit (0.x.y.z, "this network": never a destination on the wire, so nothing
leaks to the network if one were ever used as one). TLS, admission and the
mesh-secret proof run end to end: the relay sees packet sizes and timing, never
their content, and cannot alter them unnoticed.

A relay forwards only for admitted members (circuits are streams on admitted
connections) and only towards other members it is connected to. Each direction
keeps at most RELAY_QUEUE_BYTES unsent; past that, packets are dropped (QUIC
resends what it needs), so a slow side cannot make the relay buffer without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..errors import MalformedMessageError, RelayRefusedError
from ..identity import NODE_ID_BYTES, short_id
from ..units import KIB
from ..wire.packet_relay import PACKET_HEADER, PacketDecoder, RelayAnswer, encode_packet
from .endpoint import Address, Datagram
from .streams import MeshStreamReader, MeshStreamWriter

log = logging.getLogger(__name__)

RELAY_PORT = 1  # the port of every virtual address
RELAY_QUEUE_BYTES = 256 * KIB
RELAY_ANSWER_TIMEOUT_S = 5.0
READ_BYTES = 64 * KIB

# A leg to the target: its stream, or why there is none.
OpenLeg = Callable[[bytes, bytes], Awaitable[tuple[MeshStreamReader, MeshStreamWriter] | str]]


def virtual_address(index: int) -> Address:
    """The address a circuit's QUIC connection uses; ``index`` up to 2**24 - 1."""
    return f"0.{(index >> 16) & 255}.{(index >> 8) & 255}.{index & 255}", RELAY_PORT


def is_virtual(address: Address | tuple | None) -> bool:
    return address is not None and str(address[0]).startswith("0.")


@dataclass
class RelayCounters:
    """What this node did as a relay, and for its own relayed paths (status and /metrics)."""

    relayed_bytes: int = 0  # forwarded for others, both directions
    relayed_packets: int = 0
    dropped_packets: int = 0  # over a queue bound
    refused: int = 0  # requests refused (not towards a member we reach)
    circuits_served: int = 0  # relayed pairs served, ever


class RelayCircuit:
    """One end of a relayed path: a stream through the relay, and the virtual address over it."""

    def __init__(self, address: Address, relay_id: bytes, peer_id: bytes, reader: MeshStreamReader,
                 writer: MeshStreamWriter, deliver: Callable[[list[Datagram]], None]) -> None:
        self.address = address
        self.relay_id = relay_id
        self.peer_id = peer_id
        self._reader = reader
        self._writer = writer
        self._deliver = deliver
        self.dropped_packets = 0

    def send(self, datagrams: list[Datagram]) -> None:
        if self._writer.is_closing():
            return
        # A connection's whole batch in one stream write: one pass over the QUIC library, not one per packet.
        room = RELAY_QUEUE_BYTES - self._writer.unsent_bytes()
        packets = []
        for data, _ in datagrams:
            if room <= 0:
                self.dropped_packets += 1
                continue
            packet = encode_packet(data)
            packets.append(packet)
            room -= len(packet)
        if packets:
            try:
                self._writer.write(b"".join(packets))
            except ConnectionError:
                pass

    async def run(self) -> None:
        """Hand every packet that comes through to the transport until the stream ends."""
        decoder = PacketDecoder()
        try:
            while chunk := await self._reader.read(READ_BYTES):
                self._deliver([(packet, self.address) for packet in decoder.feed(chunk)])
        except ConnectionError:
            pass

    def close(self) -> None:
        self._writer.abort()


async def request_circuit(reader: MeshStreamReader, writer: MeshStreamWriter, target_id: bytes) -> None:
    """Ask the relay at the other end of a fresh RELAY_REQUEST stream (kind byte written) for ``target_id``.

    RelayRefusedError with the relay's reason if it will not.
    """
    writer.write(target_id)
    try:
        async with asyncio.timeout(RELAY_ANSWER_TIMEOUT_S):
            accepted, length = RelayAnswer.decode_head(await reader.readexactly(2))
            reason = (await reader.readexactly(length)).decode(errors="replace")
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
        writer.abort()
        raise RelayRefusedError(f"the relay did not answer ({exc!r})") from exc
    if not accepted:
        writer.abort()
        raise RelayRefusedError(reason)


async def serve_relay_request(reader: MeshStreamReader, writer: MeshStreamWriter, source_id: bytes,
                              open_leg: OpenLeg, counters: RelayCounters) -> None:
    """Relay for ``source_id`` (an admitted member) towards the member its request names."""
    try:
        target_id = await reader.readexactly(NODE_ID_BYTES)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.abort()
        return
    leg = await open_leg(source_id, target_id)
    if isinstance(leg, str):
        counters.refused += 1
        log.info("refused to relay from %s to %s: %s", short_id(source_id), short_id(target_id), leg)
        writer.write(RelayAnswer(False, leg).encode())
        writer.write_eof()
        return
    target_reader, target_writer = leg
    writer.write(RelayAnswer(True).encode())
    counters.circuits_served += 1
    log.info("relaying between %s and %s", short_id(source_id), short_id(target_id))
    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(_forward(reader, target_writer, counters))
            tasks.create_task(_forward(target_reader, writer, counters))
    except* (ConnectionError, MalformedMessageError):
        pass
    finally:
        writer.abort()
        target_writer.abort()


async def _forward(reader: MeshStreamReader, writer: MeshStreamWriter, counters: RelayCounters) -> None:
    """Copy packets, whole, dropping those that would queue past RELAY_QUEUE_BYTES; ends both legs at EOF."""
    decoder = PacketDecoder()
    while chunk := await reader.read(READ_BYTES):
        # Whole packets only, and all a read brought in one write (one pass over the QUIC library).
        room = RELAY_QUEUE_BYTES - writer.unsent_bytes()
        forwarded = []
        for packet in decoder.feed(chunk):
            if room <= 0:
                counters.dropped_packets += 1
                continue
            forwarded.append(encode_packet(packet))
            room -= PACKET_HEADER.size + len(packet)
            counters.relayed_packets += 1
            counters.relayed_bytes += len(packet)
        if forwarded:
            writer.write(b"".join(forwarded))
    raise ConnectionResetError("a relayed leg ended")
