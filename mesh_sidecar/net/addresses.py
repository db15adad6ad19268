"""The addresses this machine can be reached at, read from its network interfaces."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import psutil

from ..ports import LOOPBACK
from ..wire.ticket import MAX_TICKET_ADDRESSES, PeerAddress


class InterfaceAddress(Protocol):
    """One address of a network interface, as ``psutil.net_if_addrs`` lists it."""

    @property
    def family(self) -> int: ...

    @property
    def address(self) -> str: ...


def reachable_addresses(
    port: int,
    ipv6: bool = False,
    interfaces: Callable[[], Mapping[str, Sequence[InterfaceAddress]]] = psutil.net_if_addrs,
) -> tuple[PeerAddress, ...]:
    """Addresses to put in this node's ticket: interface IPs, then 127.0.0.1 last.

    Loopback comes last and always survives the cap, so a second node on the same
    machine can still connect. With ``ipv6`` (a socket that takes IPv6), global
    IPv6 addresses come after IPv4; link-local ones never, since their scope id
    names an interface on *this* machine. The mesh listens on IPv4 only for now, so
    it leaves them out: a ticket must not list addresses nobody can dial.
    ``interfaces`` lists this machine's interfaces and their addresses.
    """
    ipv4: list[PeerAddress] = []
    global_ipv6: list[PeerAddress] = []
    for entries in interfaces().values():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(entry.address)
            except ValueError:
                continue  # something odd an OS reports; it cannot go in a ticket anyway
            if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast:
                continue
            if isinstance(ip, ipaddress.IPv6Address) and (not ipv6 or ip.scope_id is not None):
                continue
            address = PeerAddress(str(ip), port)
            bucket = ipv4 if ip.version == 4 else global_ipv6
            if address not in bucket:
                bucket.append(address)
    # IPv4 first: more LANs route it, and a dialer tries addresses in order.
    found = (ipv4 + global_ipv6)[: MAX_TICKET_ADDRESSES - 1]
    return (*found, PeerAddress(LOOPBACK, port))
