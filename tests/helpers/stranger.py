"""A hostile or mistaken outsider, run in its own network namespace by the security tests
(and, as ``unauthenticated_client``, on loopback by the transport's tests).

    python -m tests.helpers.stranger silent HOST PORT
    python -m tests.helpers.stranger wrong-secret HOST PORT NODE_ID_HEX
    python -m tests.helpers.stranger impostor HOST PORT NODE_ID_HEX CLAIMED_ID_HEX SECRET_HEX
    python -m tests.helpers.stranger flood HOST PORT COUNT
    python -m tests.helpers.stranger relay HOST PORT TARGET_ID_HEX
    python -m tests.helpers.stranger data-port HOST PORT     (TLS with a key of its own, then RPC)
    python -m tests.helpers.stranger data-garbage HOST PORT  (no TLS: bytes that are none of it)
    python -m tests.helpers.stranger data-member HOST PORT HOME  (a member's key, then broken RPC frames)

Each mode prints one line saying how it was turned away (or "ADMITTED", which
a test treats as a failure); exit status 0 unless the tool itself broke.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import ssl
import struct
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamDataReceived
from cryptography.hazmat.primitives import serialization

from mesh_sidecar.errors import MeshError
from mesh_sidecar.identity import NodeIdentity, generate_identity, load_or_create_identity
from mesh_sidecar.net.quic import ALPN
from mesh_sidecar.net.transport import MeshTransport
from mesh_sidecar.wire import auth
from mesh_sidecar.wire.packet_relay import encode_packet
from mesh_sidecar.wire.stream_kind import StreamKind

SILENT_WAIT_S = auth.AUTH_TIMEOUT_S + 5


@dataclass(frozen=True)
class Impostor(NodeIdentity):
    """Says it is ``claimed`` but can only sign with its own key."""

    claimed: bytes = b""

    @property
    def node_id(self) -> bytes:
        return self.claimed


class Watcher(QuicConnectionProtocol):
    """A QUIC client connection that notes how it was closed and what came back on its streams."""

    closed_with: str | None = None
    answered: bytes = b""  # what came back on our streams

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            self.closed_with = f"code {event.error_code}: {event.reason_phrase}"
        elif isinstance(event, StreamDataReceived) and event.stream_id != 0:
            self.answered += event.data


@asynccontextmanager
async def unauthenticated_client(host: str, port: int) -> AsyncIterator[Watcher]:
    """A QUIC client of the mesh's ALPN that completes TLS and never authenticates (nor gives up)."""
    configuration = QuicConfiguration(alpn_protocols=[ALPN], is_client=True, verify_mode=ssl.CERT_NONE)
    async with connect(host, port, configuration=configuration, create_protocol=Watcher,
                       wait_connected=True) as client:
        yield client


async def silent(host: str, port: int) -> str:
    """Complete TLS, then say nothing: the node must give up on us."""
    async with unauthenticated_client(host, port) as client:
        try:
            await asyncio.wait_for(client.wait_closed(), SILENT_WAIT_S)
        except TimeoutError:
            return "ADMITTED (never closed)"
        return f"closed by the node, {client.closed_with}"


async def relay(host: str, port: int, target_id: bytes) -> str:
    """Ask the node to relay our packets to a member, without ever being admitted."""
    async with unauthenticated_client(host, port) as client:
        # Stream 0 is the control stream (opened, silent); the next is a RELAY_REQUEST with a packet after it.
        client._quic.send_stream_data(client._quic.get_next_available_stream_id(), b"")
        stream_id = client._quic.get_next_available_stream_id()
        client._quic.send_stream_data(stream_id, bytes((StreamKind.RELAY_REQUEST,)) + target_id
                                      + encode_packet(os.urandom(1200)))
        client.transmit()
        try:
            await asyncio.wait_for(client.wait_closed(), SILENT_WAIT_S)
        except TimeoutError:
            return "RELAYED? the node kept the connection open"
        if client.answered:
            return f"RELAYED: the node answered {client.answered[:16].hex()}"
        return f"no relay, closed by the node, {client.closed_with}"


async def dial(identity: NodeIdentity, secret: bytes, host: str, port: int, node_id: bytes) -> str:
    async def on_peer(connection) -> None:
        await connection.wait_closed()

    transport = MeshTransport(identity, secret, on_peer)
    await transport.start("0.0.0.0", 0)
    try:
        await transport.connect([(host, port)], node_id)
        return "ADMITTED"
    except MeshError as exc:
        return f"refused: {exc}"
    finally:
        await transport.close()


def flood(host: str, port: int, count: int) -> str:
    """Random datagrams, and datagrams shaped like QUIC Initials with random connection ids."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sizes = (1, 7, 64, 700, 1200, 1350, 9000)
    for i in range(count):
        if i % 4 == 0:
            # long header, Initial, QUIC v1, 8-byte DCID, 8-byte SCID, no token, junk "payload"
            header = bytes([0xC3]) + struct.pack("!I", 1) + b"\x08" + os.urandom(8) + b"\x08" + os.urandom(8)
            data = header + b"\x00" + b"\x44\xd0" + os.urandom(1200 - len(header) - 3)
        else:
            data = os.urandom(sizes[i % len(sizes)])
        try:
            sock.sendto(data, (host, port))
        except OSError:
            pass  # a full socket buffer: the flood goes on
    return f"sent {count} datagrams"


# What a member's relay sends after TLS: "MESH" | version 1 | kind RPC (net/data_plane/native/README.md),
# then an RPC HELLO (cmd 14, 24 bytes of capabilities).
DATA_PREAMBLE = b"MESH\x01\x01"
RPC_HELLO = bytes([14]) + struct.pack("<Q", 24) + bytes(24)


def presenting(identity: NodeIdentity) -> ssl.SSLContext:
    """A TLS client context presenting ``identity``'s certificate, as a node's relay dials (no server check)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with tempfile.NamedTemporaryFile("wb", suffix=".pem") as pem:
        pem.write(identity.certificate().public_bytes(serialization.Encoding.PEM))
        pem.write(identity.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
        pem.flush()
        context.load_cert_chain(pem.name)
    return context


def data_port(host: str, port: int, garbage: bool, identity: NodeIdentity | None = None) -> str:
    """Dial a node's native data port as a stranger (or, given ``identity``, as that member sending
    broken RPC): a stranger must get nothing at all, a member's broken stream must be dropped."""
    member = identity is not None
    context = presenting(identity or generate_identity())
    try:
        raw = socket.create_connection((host, port), timeout=10)
    except OSError as exc:  # reset at once: the node closes sources it does not know before any TLS
        return f"{'dropped' if member else 'refused'}: {type(exc).__name__}: {exc}"
    try:
        if garbage:
            raw.sendall(os.urandom(4096))
            conn: socket.socket = raw
        else:
            conn = context.wrap_socket(raw)
            conn.sendall(DATA_PREAMBLE + RPC_HELLO)
        data = conn.recv(64)
        if member:
            # A frame declaring a 1 TiB payload, then a truncated one: the relay drops the connection.
            conn.sendall(bytes([6]) + struct.pack("<Q", 1 << 40) + os.urandom(100) + bytes([8, 1, 2]))
            while conn.recv(65536):
                pass
            return "dropped: closed by the node"
    except (OSError, ssl.SSLError) as exc:
        return f"{'dropped' if member else 'refused'}: {type(exc).__name__}: {exc}"
    finally:
        raw.close()
    return "ADMITTED" if data else "refused: closed with nothing sent"


def main(argv: list[str]) -> None:
    mode, *args = argv
    match mode:
        case "silent":
            result = asyncio.run(silent(args[0], int(args[1])))
        case "wrong-secret":
            result = asyncio.run(dial(generate_identity(), secrets.token_bytes(auth.MESH_SECRET_BYTES),
                                      args[0], int(args[1]), bytes.fromhex(args[2])))
        case "impostor":
            identity = Impostor(generate_identity().private_key, bytes.fromhex(args[3]))
            result = asyncio.run(dial(identity, bytes.fromhex(args[4]), args[0], int(args[1]),
                                      bytes.fromhex(args[2])))
        case "flood":
            result = flood(args[0], int(args[1]), int(args[2]))
        case "relay":
            result = asyncio.run(relay(args[0], int(args[1]), bytes.fromhex(args[2])))
        case "data-port" | "data-garbage":
            result = data_port(args[0], int(args[1]), garbage=mode == "data-garbage")
        case "data-member":
            result = data_port(args[0], int(args[1]), garbage=False,
                               identity=load_or_create_identity(Path(args[2])))
        case _:
            raise SystemExit(f"unknown mode {mode}")
    print(result, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
