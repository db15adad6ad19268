"""The native data relay process: started, told what it needs, listened to, restarted when it dies.

``DataRelay`` owns the TCP port members' relays dial (bound here, handed to the child, so a
restarted relay keeps it) and the control socket (net/data_plane/control_lines.py's lines). It keeps what it
told the relay (members, our rpc-server's port, each member's REGISTER_PEER endpoints) and tells it all again
after a restart; every report goes to ``on_report``, and a death to ``on_exit`` (the connections it
carried are gone: llama-server sees them reset, and the serving node's recovery takes over).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from ...errors import MalformedMessageError
from ...identity import NodeIdentity
from .build import verify_data_relay
from .control_lines import MAX_REPORT_LINE_BYTES, HandedBack, Report, configuration_lines, parse_report

log = logging.getLogger(__name__)

# A relay that died is started again after this long (doubling while it keeps dying, at most the max).
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
# It stayed up this long: the next death starts the backoff over.
STEADY_S = 60.0
HANDSHAKE_TIMEOUT_S = 5.0  # TLS and the preamble, from the TCP accept
MAX_CONNECTIONS = 256  # relayed connections at once, both ways
MAX_HANDSHAKES = 16  # inbound connections not yet authenticated: a flood costs nothing more
READ_BYTES = 64 * 1024
MAX_FDS_PER_READ = 16


def bind_data_port(preferred: int | None) -> socket.socket:
    """The TCP listener members dial: ``preferred`` (the mesh's UDP port number) if free, else any port."""
    for port in ((preferred, 0) if preferred else (0,)):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            sock.close()
            continue
        sock.listen(64)
        return sock
    raise OSError("no TCP port for the data relay")


def _addresses(addresses: Iterable[str]) -> tuple[str, ...]:
    """Numeric addresses as the relay compares them: an IPv4-mapped IPv6 one as IPv4, names dropped."""
    found: list[str] = []
    for text in addresses:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            continue
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if str(address) not in found:
            found.append(str(address))
    return tuple(found)


def _member_line(node_id: bytes, addresses: tuple[str, ...]) -> str:
    return " ".join(("member", node_id.hex(), *addresses))


class DataRelay:
    """One ``mesh-data-relay`` child and what it was told."""

    def __init__(self, binary: Path, identity: NodeIdentity, listener: socket.socket,
                 on_report: Callable[[Report], None], on_exit: Callable[[], None], *,
                 guard: tuple[int, int, float],
                 take_back: Callable[[HandedBack, socket.socket], None] = lambda _r, sock: sock.close()) -> None:
        self._binary = binary
        self._identity = identity
        self._listener = listener
        self._on_report = on_report
        self._on_exit = on_exit
        self._take_back = take_back  # a tunnel connection the relay could not carry, unread
        self._guard = guard  # history, min_history, norm_ratio (wire/rpc_outputs.py, OutputGuard)
        self._members: dict[bytes, tuple[str, ...]] = {}  # each member's addresses (where its relay dials from)
        # Per member, its REGISTER_PEER endpoints (told while it is a member: the relay drops them on a forget).
        self._endpoints: dict[bytes, dict[int, str]] = {}
        self._rpc_port = 0
        self._control: socket.socket | None = None
        self._process: asyncio.subprocess.Process | None = None
        self.restarts = 0

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def running(self) -> bool:
        return self._control is not None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # --- what it is told ----------------------------------------------------------------------

    def set_rpc_port(self, port: int) -> None:
        self._rpc_port = port
        self._tell(f"rpc-port {port}")

    def member(self, node_id: bytes, addresses: Iterable[str] = ()) -> None:
        """``node_id`` is a member; its relay dials ours from ``addresses`` (none given: as told before). The
        data port answers no other source."""
        known = self._members.get(node_id)
        wanted = _addresses(addresses) or known or ()
        if known != wanted:
            self._members[node_id] = wanted
            self._tell(_member_line(node_id, wanted))
            if known is None:
                self._tell_endpoints(node_id, {}, self._endpoints.get(node_id, {}))

    def forget(self, node_id: bytes) -> None:
        """Not a member any more: its connections, both ways, close now, and the relay drops its endpoints."""
        if self._members.pop(node_id, None) is not None:
            self._tell(f"forget {node_id.hex()}")

    def new_session(self) -> None:
        """A llama-server session starts: the output judge's histories begin anew (a restarted relay's
        are new anyway)."""
        self._tell("new-session")

    def set_endpoints(self, endpoints: Mapping[bytes, Mapping[int, str]]) -> None:
        """Per member M: the peer index of M's REGISTER_PEERs (in M's own rpc order) -> the endpoint that
        reaches that peer from here. The relay resolves a connection from M with M's table only."""
        for node_id in self._endpoints.keys() | endpoints.keys():
            told, wanted = self._endpoints.get(node_id, {}), dict(endpoints.get(node_id, {}))
            if node_id in self._members:
                self._tell_endpoints(node_id, told, wanted)
            if wanted:
                self._endpoints[node_id] = wanted
            else:
                self._endpoints.pop(node_id, None)

    def _tell_endpoints(self, node_id: bytes, told: Mapping[int, str], wanted: Mapping[int, str]) -> None:
        for index in told.keys() - wanted.keys():
            self._tell(f"endpoint {node_id.hex()} {index} -")
        for index, endpoint in wanted.items():
            if told.get(index) != endpoint:
                self._tell(f"endpoint {node_id.hex()} {index} {endpoint}")

    def probe(self, node_id: bytes, host: str, port: int) -> None:
        self._tell(f"probe {node_id.hex()} {host} {port}")

    def tunnel(self, conn_id: int, node_id: bytes, host: str, port: int, check: bool, sock: socket.socket) -> bool:
        """Relay the accepted connection ``sock`` to ``node_id``'s relay; False if the relay is not running."""
        if self._control is None:
            return False
        line = f"tunnel {conn_id} {node_id.hex()} {host} {port} {int(check)}\n".encode()
        try:
            socket.send_fds(self._control, [line], [sock.fileno()])
        except OSError:
            return False
        return True

    def _tell(self, line: str) -> None:
        if self._control is not None:
            try:
                self._control.sendall(line.encode() + b"\n")
            except OSError:
                pass  # it died: run() restarts it and tells it everything again

    # --- its life -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Keep the relay running until cancelled."""
        delay_s = RESTART_FIRST_S
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self._run_once()
            finally:
                await self._stop()
            self._on_exit()
            delay_s = RESTART_FIRST_S if loop.time() - started > STEADY_S else min(delay_s * 2, RESTART_MAX_S)
            log.warning("the native data relay exited; starting it again in %.1f s (meanwhile tunnels use QUIC)",
                        delay_s)
            await asyncio.sleep(delay_s)
            self.restarts += 1

    async def _run_once(self) -> None:
        verify_data_relay(self._binary)  # as it is now: it will hold the node's key
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fds = (theirs.fileno(), self._listener.fileno())
            self._process = await asyncio.create_subprocess_exec(
                str(self._binary), "--control-fd", str(fds[0]), "--listen-fd", str(fds[1]),
                pass_fds=fds, stdin=asyncio.subprocess.DEVNULL)
        finally:
            theirs.close()
        self._control = ours
        cert = self._identity.certificate().public_bytes(serialization.Encoding.DER)
        key = self._identity.private_key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption())
        history, min_history, ratio = self._guard
        for line in configuration_lines(cert, key, handshake_timeout_s=HANDSHAKE_TIMEOUT_S,
                                        max_connections=MAX_CONNECTIONS, max_handshakes=MAX_HANDSHAKES,
                                        history=history, min_history=min_history, norm_ratio=ratio):
            self._tell(line)
        if self._rpc_port:
            self._tell(f"rpc-port {self._rpc_port}")
        for node_id, addresses in self._members.items():
            self._tell(_member_line(node_id, addresses))
            self._tell_endpoints(node_id, {}, self._endpoints.get(node_id, {}))
        await self._read_reports(ours)

    async def _read_reports(self, control: socket.socket) -> None:
        """Each report line to on_report, until the relay is gone; a "fallback" line's socket (passed
        beside it) to take_back. The socket stays blocking for our writes: reads ask not to wait."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        pending, sockets = bytearray(), deque[socket.socket]()

        def readable() -> None:
            try:
                data, fds, _, _ = socket.recv_fds(control, READ_BYTES, MAX_FDS_PER_READ, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            sockets.extend(socket.socket(fileno=fd) for fd in fds)
            if not data:
                if not ended.done():
                    ended.set_result(None)
                return
            pending.extend(data)
            while (end := pending.find(b"\n")) >= 0:
                line = bytes(pending[:end])
                del pending[:end + 1]
                self._dispatch(line, sockets)
            if len(pending) > MAX_REPORT_LINE_BYTES:
                log.warning("the data relay wrote a line over %d bytes; dropped", MAX_REPORT_LINE_BYTES)
                pending.clear()

        loop.add_reader(control.fileno(), readable)
        try:
            await ended
        finally:
            loop.remove_reader(control.fileno())
            for sock in sockets:
                sock.close()

    def _dispatch(self, line: bytes, sockets: deque[socket.socket]) -> None:
        try:
            report = parse_report(line)
        except MalformedMessageError as exc:
            log.warning("%s", exc)
            return
        if isinstance(report, HandedBack):
            if sockets:
                self._take_back(report, sockets.popleft())
            return
        self._on_report(report)

    async def _stop(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._process is not None:
            if self._process.returncode is None:
                self._process.kill()
            await self._process.wait()
            self._process = None

    def kill(self) -> None:
        """SIGKILL the relay (tests: its death must cost a request nothing)."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()

