"""A NAT lab on one machine: an "internet" bridge, public hosts on it, and home routers with a host behind each.

    public host p ─┐
    stranger     ──┼── internet bridge (198.18.R.0/24: the benchmarking range, routed nowhere)
    router r1 wan ─┤        r1: masquerade ── home host h1 (10.1.R.2, default route via r1)
    router r2 wan ─┘        r2: masquerade [random] ── home host h2 (10.2.R.2)

A router is a namespace forwarding between its two links with nftables masquerade on
its internet side, and a firewall that drops what comes in from the internet unasked, as
home routers do (OpenWrt's wan zone rejects input). Linux keeps the home host's source
port when it can and reuses the mapping for every destination (one mapping per local
port, as most home routers), and lets in only replies to what the host sent: a peer
reaches h1 only after h1 sent to it. (Without the firewall, a peer's early packet would
be taken by the router for itself, and its conntrack entry would push h1's own later
mapping to that peer onto another port: the punch would fail.)
``random_ports`` makes the router pick a new port for every destination, the case hole
punching cannot cross. ``flush_mappings`` forgets every mapping, as a router reboot or a
conntrack flush does; with ``new_ports`` the next mappings get other ports, so the peers
see the home host at a new address.

Everything is made with names unique to this run and removed by those names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.netns import API_PORT, Host, ns_python, run, start_in, ticket_of, veth_into_bridge
from tests.helpers.nodes import NodeProcess
from tests.helpers.waiting import wait_until

PUBLIC = "198.18.{run}.{host}"
HOME = "10.{home}.{run}.{host}"
HOME_ROUTER, HOME_HOST = 1, 2
MESH_TIMEOUT_S = 60.0  # only a hang breaks it
LOAD_TIMEOUT_S = 180.0
# Ports a router maps to after ``flush_mappings(new_ports=True)``: far from the mesh's 47470.
REMAPPED_PORTS = "50000-50999"


def can_make_nat_lab() -> bool:
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "nft", "conntrack"))


@dataclass
class Home:
    router: Host  # its ``ip`` is its public (internet bridge) address
    host: Host  # behind the router
    random_ports: bool


class NatLab:
    """Public hosts and homes on one internet bridge; ``close()`` removes exactly what was made."""

    made = 0  # labs made by this process: each gets its own names

    def __init__(self) -> None:
        NatLab.made += 1
        self.tag = f"mn{os.getpid() % 100000}{NatLab.made % 10}"
        self.bridge = f"{self.tag}net"
        self.run_octet = os.getpid() % 250 + 1
        self.namespaces: list[str] = []
        self._links: list[str] = []
        self._public_hosts = 0
        self.homes: list[Home] = []
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "link", "set", self.bridge, "up")

    def _namespace(self, name: str) -> str:
        netns = f"{self.tag}{name}"
        run("ip", "netns", "add", netns)
        self.namespaces.append(netns)
        run("ip", "netns", "exec", netns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1")
        run("ip", "-n", netns, "link", "set", "lo", "up")
        return netns

    def _on_internet(self, name: str, netns: str) -> Host:
        """A link from ``netns`` into the internet bridge, with the next public address."""
        self._public_hosts += 1
        ip = PUBLIC.format(run=self.run_octet, host=self._public_hosts)
        outside, inside = f"{self.tag}{name}o", f"{self.tag}{name}i"
        veth_into_bridge(self.bridge, outside, inside, netns)
        self._links.append(outside)
        run("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", inside)
        run("ip", "-n", netns, "link", "set", inside, "up")
        return Host(name, netns, ip, inside)

    def add_public(self, name: str) -> Host:
        """A host with a public address: reachable from everywhere on the internet bridge."""
        return self._on_internet(name, self._namespace(name))

    def add_home(self, router_name: str, host_name: str, *, random_ports: bool = False) -> Home:
        """A router on the internet bridge doing masquerade, and one host behind it."""
        index = len(self.homes) + 1
        router = self._on_internet(router_name, self._namespace(router_name))
        host_netns = self._namespace(host_name)
        lan_router, lan_host = f"{self.tag}{router_name}l", f"{self.tag}{host_name}l"
        run("ip", "link", "add", lan_router, "netns", router.netns, "type", "veth", "peer", "name", lan_host,
            "netns", host_netns)
        router_lan_ip = HOME.format(home=index, run=self.run_octet, host=HOME_ROUTER)
        host_ip = HOME.format(home=index, run=self.run_octet, host=HOME_HOST)
        run("ip", "-n", router.netns, "addr", "add", f"{router_lan_ip}/24", "dev", lan_router)
        run("ip", "-n", router.netns, "link", "set", lan_router, "up")
        run("ip", "-n", host_netns, "addr", "add", f"{host_ip}/24", "dev", lan_host)
        run("ip", "-n", host_netns, "link", "set", lan_host, "up")
        run("ip", "-n", host_netns, "route", "add", "default", "via", router_lan_ip)
        run("ip", "netns", "exec", router.netns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        self._masquerade(router, random_ports)
        home = Home(router, Host(host_name, host_netns, host_ip, lan_host), random_ports)
        self.homes.append(home)
        return home

    @staticmethod
    def _masquerade(router: Host, random_ports: bool, ports: str | None = None) -> None:
        wan = router.device
        random = "random" if random_ports else ""
        # nft maps to a port range only for a protocol with ports: UDP (the mesh) gets it, the rest plain.
        remap = f"    oifname \"{wan}\" meta l4proto udp masquerade to :{ports} {random}\n" if ports else ""
        rules = (f"flush ruleset\n"
                 f"table ip nat {{\n"
                 f"  chain postrouting {{\n"
                 f"    type nat hook postrouting priority srcnat;\n"
                 f"{remap}"
                 f"    oifname \"{wan}\" masquerade {random}\n"
                 f"  }}\n"
                 f"}}\n"
                 f"table ip filter {{\n"
                 f"  chain input {{\n"
                 f"    type filter hook input priority filter;\n"
                 f"    iifname \"{wan}\" ct state new drop\n"
                 f"  }}\n"
                 f"}}\n")
        subprocess.run(["ip", "netns", "exec", router.netns, "nft", "-f", "-"], input=rules, text=True,
                       check=True, capture_output=True)

    def set_random_ports(self, home: Home, random_ports: bool) -> None:
        """Change how ``home``'s router maps new flows (its live mappings stay)."""
        home.random_ports = random_ports
        self._masquerade(home.router, random_ports)

    def flush_mappings(self, home: Home, *, new_ports: bool = False) -> None:
        """Forget every mapping of ``home``'s router; with ``new_ports`` the next ones get other ports."""
        if new_ports:
            self._masquerade(home.router, home.random_ports, REMAPPED_PORTS)
        run("ip", "netns", "exec", home.router.netns, "conntrack", "-F")

    def close(self) -> None:
        for netns in self.namespaces:  # deleting a namespace deletes the veth ends inside it
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


# --- a mesh in the lab: a public member and two homes -----------------------------------------

@dataclass
class NatMesh:
    lab: NatLab
    public: Host
    homes: list[Home]
    nodes: dict[str, NodeProcess]
    joined_to_path_s: float  # both home nodes up -> each sees the other on a path


def peer(node: NodeProcess, name: str) -> dict:
    return next((p for p in node.status()["peers"] if p["name"] == name), {})


def metrics_in(host: Host) -> dict[str, float]:
    """``conftest.metrics`` of the API on ``host``, read from inside its namespace."""
    code = f"import json, tests.helpers.nodes as n; print(json.dumps(n.metrics({API_PORT})))"
    return json.loads(ns_python(host, code))


def event_time(node: NodeProcess, starting: str) -> float:
    """When ``node`` first said a line starting with ``starting`` (its recent events, epoch seconds)."""
    return next(e["time"] for e in node.status()["events"] if e["message"].startswith(starting))


def start_nat_mesh(root: Path, *, random_ports: bool) -> NatMesh:
    """A public member and two homes; the second home's router maps per destination with ``random_ports``."""
    lab = NatLab()
    nodes: dict[str, NodeProcess] = {}
    mesh = NatMesh(lab, lab.add_public("p"), [], nodes, 0.0)
    try:
        mesh.homes = [lab.add_home("r1", "h1"), lab.add_home("r2", "h2", random_ports=random_ports)]
        nodes["p"] = start_in(mesh.public, root / "p", "--no-mdns")
        ticket = ticket_of(nodes["p"])
        nodes["h1"] = start_in(mesh.homes[0].host, root / "h1", "--no-mdns", "--join", ticket)
        nodes["h2"] = start_in(mesh.homes[1].host, root / "h2", "--no-mdns", "--join", ticket,
                               "--serve", str(API_PORT), "--spread", "--min-peers", "2")
        wait_until(lambda: all((root / n / "control.json").exists() for n in ("h1", "h2")), MESH_TIMEOUT_S,
                   "both home nodes up")
        wait_until(lambda: peer(nodes["h1"], "h2").get("path") and peer(nodes["h2"], "h1").get("path"),
                   MESH_TIMEOUT_S, "h1 and h2 see each other")
        # From the nodes' own clocks: both joined the public member -> both connected to each other.
        joined = max(event_time(nodes[n], "Connected to peer p ") for n in ("h1", "h2"))
        met = max(event_time(nodes["h1"], "Connected to peer h2 "), event_time(nodes["h2"], "Connected to peer h1 "))
        mesh.joined_to_path_s = met - joined
        wait_until(lambda: "API ready" in nodes["h2"].text() or nodes["h2"].proc.poll() is not None,
                   LOAD_TIMEOUT_S, "h2 loads the model over the three")
        assert nodes["h2"].proc.poll() is None, nodes["h2"].text()
        for node in nodes.values():
            node.extra_pids = node.child_pids()
    except BaseException:
        stop_nat_mesh(mesh)
        raise
    return mesh


def stop_nat_mesh(mesh: NatMesh) -> None:
    for node in mesh.nodes.values():
        node.stop_with_children()
    mesh.lab.close()
