"""How big a datagram each peer's path carries: QUIC's 1200 bytes first, then probed upward.

Every QUIC path carries 1200-byte datagrams; an Ethernet LAN carries 1472, a jumbo-frame LAN
8972 and loopback far more. Python QUIC pays per packet, so bigger datagrams move more bytes
per CPU second (docs/performance.md). Discovery follows RFC 8899 (packetization-layer path MTU
discovery): a probe is one PING padded to the size tried, and only the peer's acknowledgement
counts, so no ICMP is needed and a path that silently drops big frames is found out too. The
socket sets don't-fragment (endpoint.py), so a probe too big for a link is dropped, never
split into IP fragments.

The search is pure (sizes in, sizes out): the largest size the local interface allows first,
then the common MTUs below it; the first one acknowledged is kept. A size is given up only
after PROBE_ATTEMPTS losses, since a busy receiver drops datagrams of any size. A path that
stops carrying the kept size (a route change: repeated probe timeouts in QUIC's loss
recovery) falls back to the base size and searches again.
"""

from __future__ import annotations

import socket
from dataclasses import InitVar, dataclass, field

BASE_DATAGRAM_BYTES = 1200  # QUIC's minimum (RFC 9000 14.1): every path carries it
# Bigger datagrams pay on loopback too, up to where one lost datagram costs a whole window
# and GSO (at most ~64 KB per send) batches only one: benchmarks/relay.py --mtu.
MAX_PROBED_DATAGRAM_BYTES = 16 * 1024
COMMON_LINK_MTUS = (9000, 1500)  # jumbo-frame and plain Ethernet, tried below a bigger interface MTU
IPV4_UDP_HEADER_BYTES = 20 + 8
IPV6_UDP_HEADER_BYTES = 40 + 8
# Loss recovery's probe timeouts in a row (no acknowledgement at all) that mean the path no
# longer carries our datagram size.
BLACK_HOLE_PROBE_TIMEOUTS = 3
PROBE_ATTEMPTS = 3  # RFC 8899's MAX_PROBES

# Linux socket options, absent from Python's socket module on some builds.
IP_MTU = getattr(socket, "IP_MTU", 14)
IPV6_MTU = getattr(socket, "IPV6_MTU", 24)
IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IPV6_MTU_DISCOVER = getattr(socket, "IPV6_MTU_DISCOVER", 23)
PMTUDISC_PROBE = 3  # IP_PMTUDISC_PROBE / IPV6_PMTUDISC_PROBE: set DF, never fragment, ignore cached PMTU


def set_dont_fragment(sock: socket.socket) -> None:
    """Datagrams leave whole or not at all: a probe too big for a link is lost, not fragmented."""
    if sock.family == socket.AF_INET6:
        level, option = socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER
    else:
        level, option = socket.IPPROTO_IP, IP_MTU_DISCOVER
    try:
        sock.setsockopt(level, option, PMTUDISC_PROBE)
    except OSError:
        pass  # not Linux: the kernel's default; probes may then arrive as fragments


def route_mtu(address: tuple[str, int] | tuple[str, int, int, int]) -> int | None:
    """The MTU of the local interface the route to ``address`` leaves by (None if unknown)."""
    ipv6 = ":" in address[0]
    with socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address[0], address[1]))  # UDP: picks the route, sends nothing
            return sock.getsockopt(socket.IPPROTO_IPV6 if ipv6 else socket.IPPROTO_IP, IPV6_MTU if ipv6 else IP_MTU)
        except OSError:
            return None


def candidate_sizes(link_mtu: int | None, *, ipv6: bool = False, ceiling: int = MAX_PROBED_DATAGRAM_BYTES) -> list[int]:
    """Datagram sizes to probe, largest first: what ``link_mtu`` allows, then the common MTUs below it."""
    if link_mtu is None:
        return []
    header = IPV6_UDP_HEADER_BYTES if ipv6 else IPV4_UDP_HEADER_BYTES
    largest = min(link_mtu - header, ceiling)
    sizes = {largest} | {mtu - header for mtu in COMMON_LINK_MTUS if mtu - header < largest}
    return sorted((size for size in sizes if size > BASE_DATAGRAM_BYTES), reverse=True)


@dataclass
class DatagramSizeSearch:
    """Which size to probe next, and the size confirmed so far, for one peer's path."""

    candidates: InitVar[list[int]]
    confirmed: int = BASE_DATAGRAM_BYTES
    in_flight: int | None = None  # the size being probed
    _untried: list[int] = field(init=False)
    _losses: int = field(init=False, default=0)  # of the size at the head of _untried

    def __post_init__(self, candidates: list[int]) -> None:
        self._untried = list(candidates)

    @property
    def done(self) -> bool:
        return self.in_flight is None and not self._untried

    def next_probe(self) -> int | None:
        """The next size to probe, or None while one is in flight or when the search is over."""
        if self.in_flight is not None or not self._untried:
            return None
        self.in_flight = self._untried[0]
        return self.in_flight

    def on_probe_result(self, size: int, acknowledged: bool) -> None:
        if size != self.in_flight:
            return  # from a search a black hole restarted
        self.in_flight = None
        if acknowledged:
            self.confirmed = size
            self._untried.clear()  # sizes are tried largest first: nothing below can be better
            return
        self._losses += 1
        if self._losses >= PROBE_ATTEMPTS:
            self._untried.pop(0)
            self._losses = 0

    def on_black_hole(self, candidates: list[int]) -> None:
        """The confirmed size stopped getting through: back to the base size, and search again."""
        self.confirmed = BASE_DATAGRAM_BYTES
        self.in_flight = None
        self._untried = list(candidates)
        self._losses = 0
