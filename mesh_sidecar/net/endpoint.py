"""The node's UDP socket: datagrams read in batches and sent with Linux UDP GSO; no QUIC here.

One socket both listens and dials. Datagrams waiting together are read
together and handed on as one batch, so each connection handles its share at
once (one pass over the QUIC state, one ACK); datagrams sent together to one
address go as one GSO ``sendmsg()`` where the kernel allows. The socket sets
don't-fragment, so path_mtu.py's probes are dropped when too big, never split.

The socket also asks for ICMP errors (``IP_RECVERR``): when a member's process dies on a live
machine, its kernel answers our next datagram with "port unreachable", and the error queue says
to which address. That reaches the mesh (``on_unreachable``) as a sign the member is gone, within
one round trip; QUIC alone would wait for its idle timeout.

This is apart from transport.py (which routes the datagrams to connections by
connection id) as aioquic keeps its UDP glue apart from its server's routing:
what is about the socket (buffer sizes, batching, GSO fallbacks) is found here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import struct
import sys
from collections.abc import Callable

from ..errors import PortInUseError, UsageError
from ..units import MIB
from . import path_mtu

logger = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 4 * MIB  # asked of the kernel, which may cap it
MAX_DATAGRAMS_PER_READ = 64  # read in one go when the socket is readable, then each connection pumps once
MAX_UDP_PAYLOAD_BYTES = 65535
# Linux UDP GSO: one sendmsg() carries up to this many equal-size datagrams (the last may be shorter).
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65000
# Linux's error queue (ip(7), ipv6(7)): not all in the socket module.
IP_RECVERR = 11
IPV6_RECVERR = 25
MSG_ERRQUEUE = getattr(socket, "MSG_ERRQUEUE", 0x2000)
SOCK_EXTENDED_ERR = struct.Struct("=IBBBBII")  # ee_errno, ee_origin, ee_type, ee_code, ee_pad, ee_info, ee_data
SO_EE_ORIGIN_ICMP, SO_EE_ORIGIN_ICMP6 = 2, 3
MAX_ERRORS_PER_READ = 64

Address = tuple[str, int]
Datagram = tuple[bytes, tuple]  # payload, and the address it came from or goes to
DatagramsHandler = Callable[[list[Datagram]], None]
UnreachableHandler = Callable[[tuple], None]  # the address our datagram went to


def format_address(address: tuple) -> str:
    """host:port, with IPv6 hosts in brackets."""
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class UdpEndpoint:
    """One UDP socket: hands received datagrams to ``on_datagrams`` in batches, sends with GSO."""

    def __init__(self, on_datagrams: DatagramsHandler, on_unreachable: UnreachableHandler = lambda _: None) -> None:
        self._on_datagrams = on_datagrams
        self._on_unreachable = on_unreachable
        self._udp: asyncio.DatagramTransport | None = None
        self._sock: socket.socket | None = None
        self._gso = hasattr(socket, "SOL_UDP") and sys.platform == "linux"
        self.family = socket.AF_INET  # of the bound socket, which dialed addresses must match

    @property
    def bound(self) -> bool:
        return self._udp is not None

    async def bind(self, host: str, port: int) -> int:
        """Bind the UDP port (0: any free one) and return its number."""
        loop = asyncio.get_running_loop()
        try:
            # Our own socket, not asyncio's wrapper of it: the endpoint reads batches, and sends with GSO.
            family, kind, proto, _, address = (await loop.getaddrinfo(
                host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE))[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.bind(address)
                self._udp, _ = await loop.create_datagram_endpoint(
                    lambda: _BatchReader(sock, self._on_datagrams, self._on_unreachable), sock=sock)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"UDP port {port} on {host} is in use: stop the program using it or pick another port"
                ) from exc
            raise UsageError(f"cannot listen on UDP {host}:{port}: {exc.strerror or exc}") from exc
        self._sock = sock
        self.family = sock.family
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        path_mtu.set_dont_fragment(sock)
        _ask_for_icmp_errors(sock)
        return sock.getsockname()[1]

    def close(self) -> None:
        if self._udp is not None:
            self._udp.close()

    def send(self, datagrams: list[Datagram]) -> None:
        """Send in order; runs of equal-size datagrams to one address go as one GSO sendmsg()."""
        udp = self._udp
        if udp is None or udp.is_closing():
            return
        i = 0
        while i < len(datagrams):
            data, address = datagrams[i]
            size, end = len(data), i + 1
            if self._gso:
                while (end < len(datagrams) and end - i < GSO_MAX_SEGMENTS and (end - i + 1) * size <= GSO_MAX_BYTES
                       and datagrams[end][1] == address and len(datagrams[end - 1][0]) == size
                       and len(datagrams[end][0]) <= size):
                    end += 1
            if end - i == 1 or not self._send_segments([d for d, _ in datagrams[i:end]], size, address):
                for d, _ in datagrams[i:end]:
                    udp.sendto(d, address)
            i = end

    def _send_segments(self, segments: list[bytes], size: int, address: tuple) -> bool:
        """One sendmsg() with UDP_SEGMENT; False (send them one by one) if that cannot be done now."""
        assert self._udp is not None and self._sock is not None
        # asyncio's datagram transports have it; typeshed's DatagramTransport does not say so.
        if self._udp.get_write_buffer_size():  # type: ignore[attr-defined]
            return False  # asyncio holds earlier datagrams: keep the order
        try:
            segment_size = [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))]
            self._sock.sendmsg([b"".join(segments)], segment_size, 0, address)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                return True  # too big for the link now: lost, and the black-hole check shrinks them
            self._gso = False
            logger.info("UDP segmentation offload unavailable (%s): one datagram per send from now on", exc)
            return False
        return True


def _ask_for_icmp_errors(sock: socket.socket) -> None:
    """Queue ICMP errors with the address they concern (Linux); elsewhere they stay unreported."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError):
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVERR, 1)
        if sock.family == socket.AF_INET or not sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY):
            sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)


def port_unreachable(ancdata: list[tuple[int, int, bytes]]) -> bool:
    """Whether an error-queue message's control data says "port unreachable" (ECONNREFUSED from ICMP)."""
    for _level, _kind, data in ancdata:
        if len(data) >= SOCK_EXTENDED_ERR.size:
            ee_errno, origin, *_ = SOCK_EXTENDED_ERR.unpack_from(data)
            if ee_errno == errno.ECONNREFUSED and origin in (SO_EE_ORIGIN_ICMP, SO_EE_ORIGIN_ICMP6):
                return True
    return False


class _BatchReader(asyncio.DatagramProtocol):
    def __init__(self, sock: socket.socket, on_datagrams: DatagramsHandler, on_unreachable: UnreachableHandler) -> None:
        self._sock = sock
        self._on_datagrams = on_datagrams
        self._on_unreachable = on_unreachable

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        # asyncio reads one datagram per loop iteration: take those waiting behind it too,
        # so each connection pumps once per batch (fewer wakeups, ACKs and timer changes).
        batch = [(data, addr)]
        while len(batch) < MAX_DATAGRAMS_PER_READ:
            try:
                batch.append(self._sock.recvfrom(MAX_UDP_PAYLOAD_BYTES))
            except BlockingIOError:
                break
            except OSError:  # an ICMP error waits: its queue must be read, or the socket stays readable
                self._read_errors()
                break
        self._on_datagrams(batch)

    def error_received(self, exc: Exception) -> None:
        logger.debug("UDP error: %s", exc)
        self._read_errors()

    def _read_errors(self) -> None:
        """Empty the error queue; each "port unreachable" names the address our datagram went to."""
        for _ in range(MAX_ERRORS_PER_READ):
            try:
                _, ancdata, _, address = self._sock.recvmsg(1, 1024, MSG_ERRQUEUE)
            except OSError:  # empty (or not Linux)
                return
            if address and port_unreachable(ancdata):
                self._on_unreachable(address)
