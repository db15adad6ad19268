"""A small lab of hosts on one machine: network namespaces on a bridge.

Each host is a namespace with one veth into a bridge in the root namespace and
its own loopback. Everything is made with names unique to this test run and
removed by those names; processes are stopped by pid. A sniffer on the bridge
sees every frame that crosses between hosts.

Link profiles for benchmarks (`LINK_PROFILES`): `Lab(rate="100mbit")` puts a
tbf on both ends of every host's veth; `Lab(delay_ms=20)` joins the hosts with
TAP devices on a delay switch (`tests/helpers/delay_switch.py`) instead of a bridge,
since this kernel has no netem: every frame between hosts arrives 20 ms late.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.llama import GREEDY, N_PREDICT, PROMPT
from tests.helpers.nodes import TICKET_LINE, NodeProcess
from tests.helpers.waiting import wait_until

SUBNET = "10.231.{run}.{host}"
QUIC_PORT = 47470
MDNS_PORT = 5353  # LAN discovery (zeroconf), on by default in lab nodes
API_PORT = 8080
ETH_P_ALL = 0x0003
ETH_HEADER_BYTES = 14
ETHERTYPE_IPV4 = 0x0800
ETHERTYPE_IPV6 = 0x86DD
IPPROTO_TCP = 6
IPPROTO_UDP = 17

# TAP devices (linux/if_tun.h): TUNSETIFF = _IOW('T', 202, int); frames without a packet-info header.
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
DELAY_SWITCH = Path(__file__).with_name("delay_switch.py")
SWITCH_START_TIMEOUT_S = 10.0
# tbf on a host's link. Burst: 1 ms of the rate (1gbit: 125,000 B, 100mbit: 12,500 B, at
# least eight full frames): the bucket must cover a late wake-up of tbf's watchdog on a busy 2-core
# machine or the link falls short of its rate, and bursts above the rate stay within a
# millisecond's worth. A GSO packet from the veth larger than the burst is split by tbf itself.
# Latency 20 ms (queue = rate x 20 ms + burst: 2.6 MB at 1gbit, 262 KB at 100mbit): many
# bandwidth-delay products of a sub-millisecond LAN, so TCP and QUIC fill the link without
# tail drops, yet short of a bufferbloated modem's seconds.
TBF_BURST_S = 0.001
TBF_MIN_BURST_BYTES = 8 * 1514
TBF_LATENCY_MS = 20
_RATE = re.compile(r"(\d+(?:\.\d+)?)(k|m|g)?bit", re.IGNORECASE)

# Link profiles by name: keyword arguments of Lab. "0ms" is the delay switch alone (its own cost).
LINK_PROFILES: dict[str, dict] = {
    "unshaped": {},
    "1gbit": {"rate": "1gbit"},
    "100mbit": {"rate": "100mbit"},
    "0ms": {"delay_ms": 0},
    "5ms": {"delay_ms": 5},
    "20ms": {"delay_ms": 20},
}


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def rate_bits_per_s(rate: str) -> int:
    """tc's spelling of a rate ("100mbit", "1gbit", "500kbit") in bits per second."""
    match = _RATE.fullmatch(rate.strip())
    if match is None:
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit")
    return int(float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[(match.group(2) or "").lower()])


def tbf_argv(rate: str) -> list[str]:
    """The `tbf ...` part of `tc qdisc add dev DEV root tbf ...` for this rate (see TBF_BURST_S)."""
    burst = max(int(rate_bits_per_s(rate) / 8 * TBF_BURST_S), TBF_MIN_BURST_BYTES)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


def open_tap(name: str) -> int:
    """Make TAP device `name` in this namespace; it lives as long as the returned fd is open."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def veth_into_bridge(bridge: str, outside: str, inside: str, netns: str) -> None:
    """A veth pair: ``inside`` moved into ``netns``, ``outside`` on ``bridge`` and up."""
    run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
    run("ip", "link", "set", inside, "netns", netns)
    run("ip", "link", "set", outside, "master", bridge)
    run("ip", "link", "set", outside, "up")


def can_make_namespaces() -> bool:
    if os.geteuid() != 0:
        return False
    probe = f"miprobe{os.getpid() % 100000}"
    try:
        run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return False
    run("ip", "netns", "del", probe)
    return True


@dataclass
class Host:
    name: str
    netns: str
    ip: str
    device: str = ""  # its link into the lab, inside the namespace

    def exec_argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class Sniffer:
    """Counts IP packets crossing the bridge by (protocol, port) pairs."""

    interface: str
    tcp: Counter = field(default_factory=Counter)
    udp_ports: Counter = field(default_factory=Counter)
    other: Counter = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._sock.bind((self.interface, 0))
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sock.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self._sock.recv(65535)
            except TimeoutError:
                continue
            self._count(frame)

    def _count(self, frame: bytes) -> None:
        if len(frame) < ETH_HEADER_BYTES:
            return
        (ethertype,) = struct.unpack_from("!H", frame, 12)
        ip = frame[ETH_HEADER_BYTES:]
        if ethertype == ETHERTYPE_IPV4 and len(ip) >= 20:
            proto, header = ip[9], (ip[0] & 0x0F) * 4
        elif ethertype == ETHERTYPE_IPV6 and len(ip) >= 40:
            proto, header = ip[6], 40
        else:
            return  # ARP and the like carry no payload of ours
        ports = struct.unpack_from("!HH", ip, header) if len(ip) >= header + 4 else (0, 0)
        if proto == IPPROTO_TCP:
            self.tcp[ports] += 1
        elif proto == IPPROTO_UDP:
            self.udp_ports[ports] += 1
        else:
            self.other[proto] += 1


class Lab:
    """Hosts on one bridge; `close()` removes exactly what was made.

    rate: a tc rate ("100mbit"): a tbf on both ends of every host's link, so each host
    sends and receives at most that. With delay_ms, only the host's sending side.
    delay_ms: join the hosts with TAP devices on a delay switch instead of veths on the
    bridge; each frame between hosts arrives delay_ms late. No bridge, so no sniffer;
    the switch's counters are in `switch_stats` after `close()`.
    sniff: start the sniffer on the bridge (`sniffer` is None without it).
    """

    def __init__(self, rate: str | None = None, delay_ms: float | None = None, sniff: bool = True) -> None:
        self.tag = f"mi{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.run_octet = os.getpid() % 250 + 1
        self.hosts: list[Host] = []
        self._links: list[str] = []
        self.rate, self.delay_ms = rate, delay_ms
        if rate is not None:
            rate_bits_per_s(rate)  # a typo fails here, not halfway through add_host
        self.sniffer: Sniffer | None = None
        self.switch: subprocess.Popen | None = None
        self.switch_stats: dict | None = None
        self._taps: list[tuple[str, str]] = []  # (namespace, device)
        if delay_ms is not None:
            self._start_switch(delay_ms)
            return
        run("ip", "link", "add", self.bridge, "type", "bridge")
        # Promiscuous, the bridge device also receives the frames it forwards: the sniffer sees them.
        run("ip", "link", "set", self.bridge, "up", "promisc", "on")
        if sniff:
            self.sniffer = Sniffer(self.bridge)
            self.sniffer.start()

    def _start_switch(self, delay_ms: float) -> None:
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control.settimeout(SWITCH_START_TIMEOUT_S)
        handle, self._switch_stats_path = tempfile.mkstemp(prefix=f"{self.tag}-switch-", suffix=".json")
        os.close(handle)
        os.unlink(self._switch_stats_path)  # written on the switch's exit; absent means it never wrote
        # Its own process: it must not share a GIL with the code under test.
        self.switch = subprocess.Popen(
            [sys.executable, str(DELAY_SWITCH), "--delay-ms", str(delay_ms),
             "--control-fd", str(theirs.fileno()), "--stats", self._switch_stats_path],
            pass_fds=(theirs.fileno(),), stdout=subprocess.DEVNULL)
        theirs.close()

    def _link_over_switch(self, name: str, netns: str) -> str:
        """A TAP for `name`, moved into its namespace, its fd handed to the switch; returns the device."""
        tap = f"{self.tag}{name}t"
        fd = open_tap(tap)
        try:
            run("ip", "link", "set", tap, "netns", netns)
            socket.send_fds(self._control, [tap.encode()], [fd])
            if self._control.recv(16) != b"ok":
                raise RuntimeError(f"the delay switch (pid {self.switch.pid}) did not take {tap}")
        finally:
            os.close(fd)  # the switch holds it now; when the switch exits, the device goes too
        self._taps.append((netns, tap))
        if self.rate is not None:
            run("tc", "-n", netns, "qdisc", "add", "dev", tap, "root", *tbf_argv(self.rate))
        return tap

    def _link_over_bridge(self, name: str, netns: str) -> str:
        outside, inside = f"{self.tag}{name}o", f"{self.tag}{name}i"
        veth_into_bridge(self.bridge, outside, inside, netns)
        self._links.append(outside)
        if self.rate is not None:  # both ends: what the host sends, and what the bridge sends it
            run("tc", "-n", netns, "qdisc", "add", "dev", inside, "root", *tbf_argv(self.rate))
            run("tc", "qdisc", "add", "dev", outside, "root", *tbf_argv(self.rate))
        return inside

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        netns = f"{self.tag}{name}"
        ip = SUBNET.format(run=self.run_octet, host=index)
        run("ip", "netns", "add", netns)
        host = Host(name, netns, ip)
        self.hosts.append(host)
        if self.switch is not None:
            inside = self._link_over_switch(name, netns)
        else:
            inside = self._link_over_bridge(name, netns)
        host.device = inside
        # IPv6 off inside: its router/neighbour chatter would only blur the sniffer's counts.
        run(*host.exec_argv("sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"))
        run("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", inside)
        run("ip", "-n", netns, "link", "set", inside, "up")
        run("ip", "-n", netns, "link", "set", "lo", "up")
        return host

    def readdress(self, host: Host, index: int) -> None:
        """Give ``host`` the address of host number ``index`` instead of its own, as a new DHCP lease would."""
        ip = SUBNET.format(run=self.run_octet, host=index)
        run("ip", "-n", host.netns, "addr", "del", f"{host.ip}/24", "dev", host.device)
        run("ip", "-n", host.netns, "addr", "add", f"{ip}/24", "dev", host.device)
        host.ip = ip

    def close(self) -> None:
        if self.sniffer is not None:
            self.sniffer.stop()
        if self.switch is not None:
            self._stop_switch()
        for netns, tap in self._taps:
            subprocess.run(["ip", "-n", netns, "link", "del", tap], capture_output=True)
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if self.switch is None:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def _stop_switch(self) -> None:
        self._control.close()  # the switch's cue to write its counters and exit; then SIGTERM, SIGKILL
        for stop in (None, self.switch.terminate, self.switch.kill):
            if stop is not None:
                stop()
            try:
                self.switch.wait(SWITCH_START_TIMEOUT_S)
                break
            except subprocess.TimeoutExpired:
                pass
        stats = Path(self._switch_stats_path)
        if stats.exists():
            self.switch_stats = json.loads(stats.read_text())
            stats.unlink()
        stats.with_name(stats.name + ".partial").unlink(missing_ok=True)  # killed while writing


# --- mesh-inference nodes on lab hosts -----------------------------------------------------


def start_in(host: Host, home, *args: str) -> NodeProcess:
    home.mkdir(parents=True)
    output = home.parent / f"{host.name}.out"
    # One CPU thread per rpc-server, as on loopback (tests/helpers/nodes.py): the hosts share this machine.
    argv = host.exec_argv(sys.executable, "-m", "mesh_sidecar", "--home", str(home), "--name", host.name,
                          "--port", str(QUIC_PORT), "--threads", "1", *args)
    proc = subprocess.Popen(argv, stdout=open(output, "w"), stderr=subprocess.STDOUT)
    return NodeProcess(home, proc, output, prefix=host.exec_argv())


def ticket_of(node: NodeProcess) -> str:
    match = wait_until(lambda: TICKET_LINE.search(node.text()), 60, "a ticket is printed")
    return match.group(1)


def connected_names(node: NodeProcess) -> set[str]:
    return set(re.findall(r"Connected to peer (\S+)", node.text()))


def ns_python(host: Host, code: str, timeout: float = 120) -> str:
    result = subprocess.run(host.exec_argv(sys.executable, "-c", code), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout


def ns_complete(host: Host, prompt: str = PROMPT, max_tokens: int = N_PREDICT) -> str:
    code = f"""
import httpx, json
r = httpx.post("http://127.0.0.1:{API_PORT}/v1/completions", timeout=120,
               json={json.dumps({"prompt": prompt, "max_tokens": max_tokens, **GREEDY})})
r.raise_for_status()
print(json.dumps(r.json()))
"""
    body = json.loads(ns_python(host, code))
    assert body["usage"]["completion_tokens"] == max_tokens
    return body["choices"][0]["text"]


def ns_tcp_refused(host: Host, ip: str, port: int) -> bool:
    code = f"""
import socket
s = socket.socket(); s.settimeout(3)
try:
    s.connect(({ip!r}, {port})); print("open")
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print("error", e)
"""
    return ns_python(host, code).strip() == "refused"
