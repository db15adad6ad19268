"""The streams a peer opens, dispatched by their first byte to what serves each kind.

    stream from a peer -> kind byte (wire/stream_kind.py) -> server
        RPC             serve_inbound_stream: our rpc-server, through the RPC filter (tunnel.py)
        MODEL_FILE      serve_model_file: the model file we announce (model_transfer.py)
        RELAY_REQUEST   serve_relay_request: relay for that peer (relay.py)
        RELAY_DELIVERY  the transport's circuit: a member reaching us through that peer (transport.py)
        API_FORWARD     serve_forwarded_request: an API request for the model we serve (api_forward.py)

The table is built here from what the node offers (StreamServices); the mesh
decides what that is, net/ how each kind is served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..identity import short_id
from ..wire.stream_kind import StreamKind
from .api_forward import ApiServer, serve_forwarded_request
from .connection import PeerConnection
from .model_transfer import serve_model_file
from .packet_relay import OpenLeg, RelayCounters, serve_relay_request
from .streams import MeshStreamReader, MeshStreamWriter, StreamPair
from .tunnel import TunnelCounters, serve_inbound_stream

log = logging.getLogger(__name__)

StreamServer = Callable[[MeshStreamReader, MeshStreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class StreamServices:
    """What this node serves on the streams its peers open."""

    rpc_port: int  # the local rpc-server
    # (the member that sent it, REGISTER_PEER's peer id) -> endpoint (wire/rpc_framing.py): by its own rpc order
    resolve_endpoint: Callable[[bytes, int], str | None]
    model_file: Callable[[str], Path | None]  # sha256 -> the model file offered, if any
    open_relay_leg: OpenLeg  # for a member asking us to relay: a stream to its target, or why not
    relay_counters: RelayCounters
    # A RELAY_DELIVERY stream (kind byte read) from the relay it names: the transport's circuit.
    serve_circuit: Callable[[MeshStreamReader, MeshStreamWriter, bytes], Awaitable[None]]
    local_api: Callable[[], ApiServer | None]  # this node's API server, for forwarded requests (None: none)
    forward_token: str  # what forwarded requests carry to this node's API: they come from an admitted member


def serve_streams(connection: PeerConnection, services: StreamServices, counters: TunnelCounters) -> None:
    """Serve each stream ``connection``'s peer opens by its kind; ``counters`` get its RPC streams' figures."""
    peer_id = connection.peer_id
    name = short_id(peer_id)
    servers: dict[StreamKind, StreamServer] = {
        StreamKind.RPC: lambda reader, writer: serve_inbound_stream(
            reader, writer, services.rpc_port, lambda index: services.resolve_endpoint(peer_id, index), name,
            counters=counters),
        StreamKind.MODEL_FILE: lambda reader, writer: serve_model_file(reader, writer, services.model_file, name),
        StreamKind.RELAY_REQUEST: lambda reader, writer: serve_relay_request(
            reader, writer, peer_id, services.open_relay_leg, services.relay_counters),
        StreamKind.RELAY_DELIVERY: lambda reader, writer: services.serve_circuit(reader, writer, peer_id),
        StreamKind.API_FORWARD: lambda reader, writer: serve_forwarded_request(
            reader, writer, services.local_api, services.forward_token, name),
    }
    connection.set_stream_handler(lambda reader, writer: serve_peer_stream(reader, writer, servers, name))


async def serve_peer_stream(reader: MeshStreamReader, writer: MeshStreamWriter,
                            servers: Mapping[StreamKind, StreamServer], peer_name: str) -> None:
    """Read a stream's kind byte and hand it to the server for that kind."""
    try:
        kind = (await reader.readexactly(1))[0]
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.abort()
        return
    server = servers.get(kind)  # type: ignore[call-overload]
    if server is None:
        log.warning("stream from %s of unknown kind %d: closed", peer_name, kind)
        writer.abort()
        return
    await server(reader, writer)


async def open_relay_delivery(connection: PeerConnection, source_id: bytes) -> StreamPair:
    """As a relay: a RELAY_DELIVERY stream to ``connection``'s peer for packets from ``source_id``."""
    reader, writer = await connection.open_stream()
    writer.write(bytes((StreamKind.RELAY_DELIVERY,)) + source_id)
    return reader, writer
