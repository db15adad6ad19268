"""LAN discovery over mDNS: see the meshes nearby, and re-find members that moved.

Every member advertises one DNS-SD service of type ``_mesh-inference._udp.local.``
on its QUIC port, with a TXT record::

    v=1  mesh=<mesh id>  node=<node id, hex>  name=<node name>

The mesh id is a hash of the mesh secret (``mesh_id``): equal for every member of
one mesh, and it tells nobody the secret. A record is only a hint about where a
node listens. It never admits anyone: the QUIC handshake still needs the secret
and the node's key, so a stranger who copies our mesh id into its own record is
dialed and then refused like any other stranger.

Two uses:
- ``mesh-inference --lan`` (``browse_lan``): list the meshes seen on this LAN, so
  a person knows whom to ask for a ticket.
- a running member (``LanPresence``): advertise itself, and hand every record of
  its own mesh to the mesh, which dials members it is not connected to. That is how
  a member whose address changed (DHCP, another network) is found again without a
  ticket.

Records are parsed by ``parse_record`` (pure); zeroconf does the multicast in its
own thread, and this module is the asyncio edge around it. IPv4 only: mDNS
chatter on IPv6 buys nothing on the LANs we serve and fails noisily on hosts with
IPv6 switched off.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zeroconf
from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from ..identity import NODE_ID_BYTES, short_id
from ..wire.ticket import PeerAddress

log = logging.getLogger(__name__)

SERVICE_TYPE = "_mesh-inference._udp.local."
RECORD_VERSION = "1"
# Domain separation: the mesh id is a hash of the secret made for this use only.
MESH_ID_CONTEXT = b"mesh-inference mesh id v1\x00"
MESH_ID_BYTES = 16
MAX_NAME_CHARS = 64
RESOLVE_TIMEOUT_MS = 3000
# How long `--lan` listens: mDNS answers to a query arrive within about a second.
LAN_BROWSE_S = 3.0
# A running node checks this often whether its own addresses changed (and re-advertises).
READVERTISE_CHECK_S = 30.0


def mesh_id(secret: bytes) -> str:
    """The public name of the mesh whose secret is ``secret``."""
    return hashlib.sha256(MESH_ID_CONTEXT + secret).digest()[:MESH_ID_BYTES].hex()


@dataclass(frozen=True)
class LanRecord:
    """One node as its mDNS record describes it."""

    mesh_id: str
    node_id: bytes
    name: str
    addresses: tuple[PeerAddress, ...]

    def properties(self) -> dict[str, str]:
        """The TXT record."""
        return {"v": RECORD_VERSION, "mesh": self.mesh_id, "node": self.node_id.hex(),
                "name": self.name[:MAX_NAME_CHARS]}


def lan_record_json(record: LanRecord) -> dict[str, object]:
    """A record for `status --json` and `--lan`: nothing in it is secret."""
    return {"mesh_id": record.mesh_id, "node": short_id(record.node_id), "name": record.name,
            "addresses": [str(a) for a in record.addresses]}


def parse_record(properties: dict[bytes, bytes | None], ips: list[str], port: int) -> LanRecord | None:
    """A record from its TXT entries and address records; None for anything not ours or malformed."""
    def text(key: bytes) -> str:
        value = properties.get(key)
        return value.decode("utf-8", errors="replace") if value else ""

    if text(b"v") != RECORD_VERSION or not 0 < port < 65536:
        return None
    try:
        node_id = bytes.fromhex(text(b"node"))
        bytes.fromhex(text(b"mesh"))
    except ValueError:
        return None
    if len(node_id) != NODE_ID_BYTES or len(text(b"mesh")) != 2 * MESH_ID_BYTES:
        return None
    addresses = []
    for ip in ips:
        try:
            addresses.append(PeerAddress(str(ipaddress.ip_address(ip)), port))
        except ValueError:
            continue
    if not addresses:
        return None
    return LanRecord(text(b"mesh"), node_id, text(b"name")[:MAX_NAME_CHARS], tuple(addresses))


def _service_info(record: LanRecord) -> AsyncServiceInfo:
    instance = f"mesh-inference {record.node_id.hex()[:16]}"
    return AsyncServiceInfo(
        SERVICE_TYPE, f"{instance}.{SERVICE_TYPE}", port=record.addresses[0].port,
        properties=record.properties(), server=f"mi-{record.node_id.hex()[:16]}.local.",
        parsed_addresses=[a.host for a in record.addresses if ipaddress.ip_address(a.host).version == 4])


async def _resolve(zc: AsyncZeroconf, name: str) -> LanRecord | None:
    info = AsyncServiceInfo(SERVICE_TYPE, name)
    if not await info.async_request(zc.zeroconf, RESOLVE_TIMEOUT_MS) or info.port is None:
        return None
    return parse_record(info.properties, info.parsed_addresses(IPVersion.V4Only), info.port)


class _Browser:
    """Names of our service type coming and going, as a queue (zeroconf calls back in the loop)."""

    def __init__(self, zc: AsyncZeroconf) -> None:
        self.changes: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
        self._browser = AsyncServiceBrowser(zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
        self.changes.put_nowait((name, state_change is not ServiceStateChange.Removed))

    async def cancel(self) -> None:
        await self._browser.async_cancel()


def _own_addresses(addresses: tuple[PeerAddress, ...]) -> tuple[PeerAddress, ...]:
    """What goes in our record: the LAN addresses (loopback means nothing to another machine)."""
    return tuple(a for a in addresses
                 if ipaddress.ip_address(a.host).version == 4 and not ipaddress.ip_address(a.host).is_loopback)


async def browse_lan(wait_s: float = LAN_BROWSE_S) -> list[LanRecord]:
    """The records seen on the LAN within ``wait_s`` seconds (for `mesh-inference --lan`)."""
    zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
    browser = _Browser(zc)
    found: dict[str, LanRecord] = {}
    deadline = time.monotonic() + wait_s
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                name, present = await asyncio.wait_for(browser.changes.get(), remaining)
            except TimeoutError:
                break
            record = await _resolve(zc, name) if present else None
            if record is not None:
                found[name] = record
            else:
                found.pop(name, None)
    finally:
        await browser.cancel()
        await zc.async_close()
    return sorted(found.values(), key=lambda r: (r.mesh_id, r.name))


class LanPresence:
    """A running node on the LAN: its own record advertised, every other record reported.

    ``own_record`` is called again whenever the secret may have changed (``refresh``)
    and every READVERTISE_CHECK_S, so a rotated mesh id or a new address is re-advertised.
    ``on_record`` gets each record of another node as it appears or changes.
    """

    def __init__(self, own_record: Callable[[], LanRecord], on_record: Callable[[LanRecord], None]) -> None:
        self._own_record = own_record
        self._on_record = on_record
        self._seen: dict[str, LanRecord] = {}
        self._refresh = asyncio.Event()

    def seen(self) -> list[LanRecord]:
        return sorted(self._seen.values(), key=lambda r: (r.mesh_id, r.name))

    def refresh(self) -> None:
        """Advertise again soon: the mesh id or our addresses may have changed."""
        self._refresh.set()

    async def run(self) -> None:
        """Advertise and browse until cancelled; then withdraw the record."""
        zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
        advertised = self._advertisable()
        info = _service_info(advertised) if advertised else None
        browser: _Browser | None = None
        try:
            if info is not None:
                await zc.async_register_service(info)
            browser = _Browser(zc)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._watch_browser(zc, browser))
                while True:
                    try:
                        await asyncio.wait_for(self._refresh.wait(), READVERTISE_CHECK_S)
                    except TimeoutError:
                        pass
                    self._refresh.clear()
                    record = self._advertisable()
                    if record != advertised:
                        info = await self._readvertise(zc, info, record)
                        advertised = record
        finally:
            if browser is not None:
                await browser.cancel()
            await zc.async_close()  # unregisters our service (goodbye packets) too

    def _advertisable(self) -> LanRecord | None:
        record = self._own_record()
        addresses = _own_addresses(record.addresses)
        if not addresses:
            return None  # loopback only: nobody on a LAN could reach it
        return LanRecord(record.mesh_id, record.node_id, record.name, addresses)

    @staticmethod
    async def _readvertise(zc: AsyncZeroconf, info: AsyncServiceInfo | None,
                           record: LanRecord | None) -> AsyncServiceInfo | None:
        """Our record changed (a rotated mesh id, new addresses): the same instance, updated in place.
        Unregistering and registering it again made zeroconf probe a name its own goodbye was still
        answering for (NonUniqueNameException); the LAN is a convenience, so a failure here is logged,
        never the node's end."""
        try:
            if record is None:
                if info is not None:
                    await zc.async_unregister_service(info)
                return None
            new = _service_info(record)
            await (zc.async_update_service(new) if info is not None else zc.async_register_service(new))
        except zeroconf.Error as exc:
            log.warning("LAN: could not advertise the new record (%s: %s); members still join by ticket",
                        type(exc).__name__, exc)
            return info
        log.info("LAN: advertising mesh %s at %s", record.mesh_id, ", ".join(map(str, record.addresses)))
        return new

    async def _watch_browser(self, zc: AsyncZeroconf, browser: _Browser) -> None:
        own_node = self._own_record().node_id
        while True:
            name, present = await browser.changes.get()
            record = await _resolve(zc, name) if present else None
            if record is None:
                self._seen.pop(name, None)
                continue
            if record.node_id == own_node:
                continue
            if self._seen.get(name) != record:
                self._seen[name] = record
                self._on_record(record)
