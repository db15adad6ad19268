"""The node's QUIC mesh on one UDP port: dial, accept, and route each datagram to its connection.

    UDP port ── UdpEndpoint ── MeshTransport ──(connection id)──> PeerConnection ── QuicConnection
               (endpoint.py)   (this module)                      (connection.py)    (quic.py)

The endpoint's one socket both listens and dials; every datagram it reads goes
to its connection by destination connection id, and an Initial packet for no
connection may open a new one. Each connection handles its share of a batch at
once. MeshTransport lives apart from the socket (endpoint.py), as aioquic keeps
connection-id routing (its asyncio/server.py) apart from the protocol glue, so
this module is only about which connection a datagram belongs to and about
connections coming and going.

An unadmitted peer costs bounded memory: at most MAX_UNAUTHENTICATED_PEERS at
a time, each for at most auth.AUTH_TIMEOUT_S, with a connection receive window
of quic.PRE_AUTH_RECEIVE_WINDOW_BYTES. An Initial packet that draws no reply
(not a client hello the QUIC library can read) is forgotten at once.

Lifetime. ``on_peer(connection)`` runs once per admitted connection, inbound
or outbound, as a task the transport owns; when it returns the connection is
closed (connection.py). ``close()`` closes every connection and stops every task.
The transport is each connection's ConnectionHost: it owns the route table
(routes.py) the connections add their ids to, and the task group they run in.

Simultaneous dials: two nodes may dial each other at once and get two admitted
connections. The transport keeps both and says which to keep:
``PeerConnection.preferred`` is true for the one dialed by the lower node id;
``open_streams`` tells when the other one has finished its work.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any

from ..errors import (
    AddressUnresolvedError,
    AuthError,
    DialTimeoutError,
    MeshError,
    PeerConnectionError,
    TransportStoppedError,
    UsageError,
)
from ..identity import NODE_ID_BYTES, NodeIdentity, short_id
from ..wire import auth
from ..wire.stream_kind import StreamKind
from .connection import AdmissionCounters, PeerConnection
from .connection_ids import ConnectionIdTable
from .endpoint import Address, Datagram, UdpEndpoint, format_address
from .packet_relay import RelayCircuit, request_circuit, virtual_address
from .quic import QuicConnection, opens_connection, parse_header, quic_configuration
from .streams import MeshStreamReader, MeshStreamWriter

logger = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 3.0  # per address, TLS and admission included
DIAL_STAGGER_S = 0.25  # the next address is dialed this long after the last, while none has answered
MAX_UNAUTHENTICATED_PEERS = 32
# Datagrams that are not QUIC for us (scans, floods) are dropped; one log line per interval says so.
IGNORED_DATAGRAMS_LOG_INTERVAL_S = 60.0

PeerHandler = Callable[[PeerConnection], Awaitable[None]]


class MeshTransport:
    """Listens and dials on one UDP port; hands each admitted connection to ``on_peer``."""

    def __init__(
        self,
        identity: NodeIdentity,
        mesh_secret: bytes,
        on_peer: PeerHandler,
        *,
        dial_timeout_s: float = DIAL_TIMEOUT_S,
        auth_timeout_s: float = auth.AUTH_TIMEOUT_S,
        max_unauthenticated_peers: int = MAX_UNAUTHENTICATED_PEERS,
        on_unreachable: Callable[[bytes], None] = lambda _: None,
    ) -> None:
        if len(mesh_secret) != auth.MESH_SECRET_BYTES:
            raise UsageError(f"the mesh secret must be {auth.MESH_SECRET_BYTES} bytes, not {len(mesh_secret)}")
        self._identity = identity
        self._secret = mesh_secret
        self._on_peer = on_peer
        self._dial_timeout_s = dial_timeout_s
        self._auth_timeout_s = auth_timeout_s
        self._max_unauthenticated_peers = max_unauthenticated_peers
        self._server_configuration = quic_configuration(identity, is_client=False)
        self._client_configuration = quic_configuration(identity, is_client=True)
        self._removed: set[bytes] = set()
        self._routes: ConnectionIdTable[PeerConnection] = ConnectionIdTable()
        self.port: int | None = None  # the UDP port, once started
        self.ignored_datagrams = 0
        self._admission = AdmissionCounters()
        self._ignored_since_log = 0
        self._ignored_logged_at: float | None = None
        self._on_unreachable = on_unreachable  # a member's port answered "unreachable": its node id
        self._endpoint = UdpEndpoint(self._datagrams_received, self._port_unreachable)
        # Relayed paths (relay.py): a virtual address per circuit, for its QUIC connection.
        self._circuits: dict[Address, RelayCircuit] = {}
        self._circuits_made = 0
        self._tasks: asyncio.TaskGroup | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._closed = False

    @property
    def node_id(self) -> bytes:
        return self._identity.node_id

    @property
    def routes(self) -> ConnectionIdTable[PeerConnection]:
        return self._routes

    @property
    def admission(self) -> AdmissionCounters:
        """Inbound connections refused, and the streams their peers opened unanswered."""
        return self._admission

    def admits(self, node_id: bytes) -> bool:
        return node_id not in self._removed

    def set_secret(self, mesh_secret: bytes) -> None:
        """Admit new connections with this secret from now on; live ones stay."""
        if len(mesh_secret) != auth.MESH_SECRET_BYTES:
            raise ValueError(f"the mesh secret must be {auth.MESH_SECRET_BYTES} bytes")
        self._secret = mesh_secret

    def refuse_nodes(self, node_ids: Iterable[bytes]) -> None:
        """Never admit these node keys again, even with the right secret."""
        self._removed.update(node_ids)

    @property
    def connections(self) -> frozenset[PeerConnection]:
        """Every connection not yet terminated, admitted or not."""
        return self._routes.connections

    async def start(self, host: str, port: int) -> int:
        """Bind the UDP port (0: any free one) and return its number."""
        self._loop = asyncio.get_running_loop()
        self.port = await self._endpoint.bind(host, port)
        started = self._loop.create_future()
        self._supervisor = asyncio.create_task(self._supervise(started), name="mesh-transport")
        await started
        return self.port

    def send_datagrams(self, datagrams: list[Datagram]) -> None:
        """Send a connection's datagrams: over UDP, or into the relay circuit of their virtual address."""
        if not self._circuits:
            self._endpoint.send(datagrams)
            return
        direct = []
        for datagram in datagrams:
            if (circuit := self._circuits.get(datagram[1])) is not None:
                circuit.send([datagram])
            else:
                direct.append(datagram)
        self._endpoint.send(direct)

    def relay_of(self, connection: PeerConnection) -> bytes | None:
        """The node id of the member relaying ``connection``, or None for a direct one."""
        circuit = self._circuits.get(connection.remote_address) if connection.relayed else None
        return circuit.relay_id if circuit is not None else None

    async def connect_via(self, relay: PeerConnection, expected_id: bytes) -> PeerConnection:
        """Dial ``expected_id`` through ``relay``, a member connected to both (RelayRefusedError if it will not)."""
        reader, writer = await relay.open_stream()
        writer.write(bytes((StreamKind.RELAY_REQUEST,)))
        await request_circuit(reader, writer, expected_id)
        circuit = self._open_circuit(relay.peer_id, expected_id, reader, writer)
        self.spawn(self._run_circuit(circuit))
        host, port = circuit.address
        try:
            return await self._dial(host, port, expected_id)
        except BaseException:
            circuit.close()
            raise

    async def serve_circuit(self, reader: MeshStreamReader, writer: MeshStreamWriter, relay_id: bytes) -> None:
        """A RELAY_DELIVERY stream (kind byte read) from ``relay_id``: a member reaching us through it."""
        try:
            source_id = await reader.readexactly(NODE_ID_BYTES)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.abort()
            return
        await self._run_circuit(self._open_circuit(relay_id, source_id, reader, writer))

    def _open_circuit(self, relay_id: bytes, peer_id: bytes, reader: MeshStreamReader,
                      writer: MeshStreamWriter) -> RelayCircuit:
        self._circuits_made += 1
        circuit = RelayCircuit(virtual_address(self._circuits_made), relay_id, peer_id, reader, writer,
                               self._datagrams_received)
        self._circuits[circuit.address] = circuit
        return circuit

    async def _run_circuit(self, circuit: RelayCircuit) -> None:
        """Carry the circuit's packets; when its stream ends (the relay left), so does its connection."""
        try:
            await circuit.run()
        finally:
            self._circuits.pop(circuit.address, None)
            for connection in self._routes.connections:
                if connection.peer_address == circuit.address:
                    connection.close("the relay's path ended")

    def finished(self, connection: PeerConnection) -> None:
        """A connection is gone: its routes go, and so does the relay circuit it ran over."""
        self._routes.remove(connection)
        address = connection.peer_address
        if address is not None and (circuit := self._circuits.pop(tuple(address)[:2], None)) is not None:
            circuit.close()

    async def connect(self, addresses: Sequence[Address], expected_id: bytes) -> PeerConnection:
        """Dial ``expected_id`` at its addresses; the first admitted connection wins.

        A dial starts every DIAL_STAGGER_S while none has answered (happy eyeballs, RFC 8305),
        so an unreachable first address (a home LAN's, seen from another home) costs a stagger,
        not a whole dial timeout, and a member behind a NAT is dialed at its public mapping at
        about the moment it dials ours: both routers open the mapping (hole punching).
        """
        if self._closed or not self._endpoint.bound:
            raise TransportStoppedError("the transport is not running")
        failures: dict[int, MeshError] = {}
        waiting = list(enumerate(addresses))
        running: dict[asyncio.Task[PeerConnection], int] = {}
        try:
            while waiting or running:
                if waiting:
                    index, (host, port) = waiting.pop(0)
                    running[asyncio.ensure_future(self._dial(host, port, expected_id))] = index
                done, _ = await asyncio.wait(running, timeout=DIAL_STAGGER_S if waiting else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = running.pop(task)
                    try:
                        return task.result()
                    except MeshError as exc:
                        failures[index] = exc
        finally:
            # A second connection admitted in the same instant is kept or retired like a simultaneous dial.
            for task in running:
                task.cancel()
        if len(failures) == 1:
            raise next(iter(failures.values()))
        kind = AuthError if any(isinstance(f, AuthError) for f in failures.values()) else PeerConnectionError
        tried = "; ".join(str(failures[i]) for i in sorted(failures)) or "no addresses given"
        raise kind(f"could not connect to {short_id(expected_id)}: {tried}")

    async def close(self) -> None:
        """Close every connection, stop every task, release the port."""
        if self._closed:
            return
        self._closed = True
        for connection in self._routes.connections:
            connection.discard("node shutting down")
        self._stopping.set()
        if self._supervisor is not None:
            await self._supervisor
        self._endpoint.close()

    async def _supervise(self, started: asyncio.Future[None]) -> None:
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            started.set_result(None)
            await self._stopping.wait()

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coroutine`` in the transport's task group (until ``close``)."""
        assert self._tasks is not None
        return self._tasks.create_task(coroutine)

    async def serve_peer(self, connection: PeerConnection) -> None:
        await self._on_peer(connection)

    async def _dial(self, host: str, port: int, expected_id: bytes) -> PeerConnection:
        where = format_address((host, port))
        flags = socket.AI_V4MAPPED if self._endpoint.family == socket.AF_INET6 else 0
        try:
            infos = await self._loop.getaddrinfo(host, port, family=self._endpoint.family, type=socket.SOCK_DGRAM,
                                                 flags=flags)
        except socket.gaierror as exc:
            raise AddressUnresolvedError(f"{where}: cannot resolve ({exc.strerror})") from exc
        now = self._loop.time()
        quic = QuicConnection(configuration=self._client_configuration)
        nonce = secrets.token_bytes(auth.NONCE_BYTES)
        handshake = auth.ClientHandshake(self._identity, self._secret, expected_id, nonce, now, self._auth_timeout_s)
        connection = PeerConnection(self, quic, handshake, initiator=True)
        self._routes.add(connection, quic.host_cid)
        quic.connect(infos[0][4], now=now)
        connection.pump()
        try:
            async with asyncio.timeout(self._dial_timeout_s):
                failure = await connection.wait_admission()
        except TimeoutError:
            connection.discard("no answer")
            raise DialTimeoutError(f"{where}: no answer within {self._dial_timeout_s:g} s") from None
        except asyncio.CancelledError:
            connection.discard("dial cancelled")
            raise
        if failure is not None:
            raise type(failure)(f"{where}: {failure}") from failure
        return connection

    def _datagrams_received(self, batch: list[Datagram]) -> None:
        fed: dict[PeerConnection, None] = {}
        for data, addr in batch:
            if (connection := self._datagram_received(data, addr)) is not None:
                fed[connection] = None
        for connection in fed:
            connection.pump()

    def _port_unreachable(self, addr: tuple) -> None:
        """Our datagram to ``addr`` met a closed port: each admitted connection there has lost its peer's
        process, most likely (the mesh confirms it with a probe)."""
        for connection in self._routes.connections:
            address = connection.peer_address
            if connection.admitted and address is not None and address[:2] == addr[:2]:
                self._on_unreachable(connection.peer_id)

    def _datagram_received(self, data: bytes, addr: tuple) -> PeerConnection | None:
        """Route one datagram; the connection it was fed to, which the caller pumps."""
        try:
            header = parse_header(data)
        except ValueError:
            self._ignore(addr, "not QUIC")
            return None
        connection = self._routes.get(header.destination_cid)
        if connection is not None:
            connection.datagram_received(data, addr)
            return connection
        if opens_connection(header, len(data), self._server_configuration) and not self._closed:
            self._accept(header.destination_cid, data, addr)
        else:
            self._ignore(addr, "not a connection of ours")
        return None

    def _ignore(self, addr: tuple, why: str) -> None:
        self.ignored_datagrams += 1
        self._ignored_since_log += 1
        now = self._loop.time()
        if self._ignored_logged_at is None or now - self._ignored_logged_at >= IGNORED_DATAGRAMS_LOG_INTERVAL_S:
            # Late packets of closed connections land here too, so this is not a warning.
            logger.info("ignored %d datagram(s) that belong to no connection here (the last from %s: %s)",
                        self._ignored_since_log, format_address(addr), why)
            self._ignored_logged_at = now
            self._ignored_since_log = 0

    def _accept(self, original_connection_id: bytes, data: bytes, addr: tuple) -> None:
        waiting = sum(1 for c in self._routes.connections if not c.initiator and not c.admitted)
        if waiting >= self._max_unauthenticated_peers:
            logger.debug("dropped a new connection from %s: %d peers already authenticating", addr, waiting)
            return
        now = self._loop.time()
        quic = QuicConnection(
            configuration=self._server_configuration,
            original_destination_connection_id=original_connection_id,
        )
        nonce = secrets.token_bytes(auth.NONCE_BYTES)
        handshake = auth.ServerHandshake(self._identity, self._secret, nonce, now, self._auth_timeout_s)
        connection = PeerConnection(self, quic, handshake, initiator=False)
        self._routes.add(connection, original_connection_id, quic.host_cid)
        quic.receive_datagram(data, addr, now=now)
        if not connection.pump():
            connection.forget("no client hello")  # nothing readable: forget it quietly
