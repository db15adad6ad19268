"""A small lab of hosts on one machine: network namespaces on a bridge.

Each host is a namespace with one veth into a bridge in the root namespace and
its own loopback. Everything is made with names unique to this test run and
removed by those names; processes are stopped by pid. A sniffer on the bridge
sees every frame that crosses between hosts.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

from tests.conftest import GREEDY, N_PREDICT, PROMPT, TICKET_LINE, NodeProcess
from tests.waiting import wait_until

SUBNET = "10.231.{run}.{host}"
QUIC_PORT = 47470
API_PORT = 8080
ETH_P_ALL = 0x0003
ETH_HEADER_BYTES = 14
ETHERTYPE_IPV4 = 0x0800
ETHERTYPE_IPV6 = 0x86DD
IPPROTO_TCP = 6
IPPROTO_UDP = 17


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


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
    """Hosts on one bridge; `close()` removes exactly what was made."""

    def __init__(self) -> None:
        self.tag = f"mi{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.run_octet = os.getpid() % 250 + 1
        self.hosts: list[Host] = []
        self._links: list[str] = []
        run("ip", "link", "add", self.bridge, "type", "bridge")
        # Promiscuous, the bridge device also receives the frames it forwards: the sniffer sees them.
        run("ip", "link", "set", self.bridge, "up", "promisc", "on")
        self.sniffer = Sniffer(self.bridge)
        self.sniffer.start()

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        netns = f"{self.tag}{name}"
        outside, inside = f"{self.tag}{name}o", f"{self.tag}{name}i"
        ip = SUBNET.format(run=self.run_octet, host=index)
        run("ip", "netns", "add", netns)
        host = Host(name, netns, ip)
        self.hosts.append(host)
        run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        self._links.append(outside)
        run("ip", "link", "set", inside, "netns", netns)
        run("ip", "link", "set", outside, "master", self.bridge)
        run("ip", "link", "set", outside, "up")
        # IPv6 off inside: its router/neighbour chatter would only blur the sniffer's counts.
        run(*host.exec_argv("sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"))
        run("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", inside)
        run("ip", "-n", netns, "link", "set", inside, "up")
        run("ip", "-n", netns, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        self.sniffer.stop()
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


# --- mesh-inference nodes on lab hosts -----------------------------------------------------


def start_in(host: Host, home, *args: str) -> NodeProcess:
    home.mkdir(parents=True)
    output = home.parent / f"{host.name}.out"
    argv = host.exec_argv(sys.executable, "-m", "mesh_sidecar", "--home", str(home), "--name", host.name,
                          "--port", str(QUIC_PORT), *args)
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


def ns_complete(host: Host) -> str:
    code = f"""
import httpx, json
r = httpx.post("http://127.0.0.1:{API_PORT}/v1/completions", timeout=120,
               json={json.dumps({"prompt": PROMPT, "max_tokens": N_PREDICT, **GREEDY})})
r.raise_for_status()
print(json.dumps(r.json()))
"""
    body = json.loads(ns_python(host, code))
    assert body["usage"]["completion_tokens"] == N_PREDICT
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
