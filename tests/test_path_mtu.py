"""Datagram size discovery (path_mtu.py): the search alone, then real QUIC over links of unequal MTU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from mesh_sidecar.net import path_mtu
from mesh_sidecar.net import quic
from mesh_sidecar.net.path_mtu import BASE_DATAGRAM_BYTES, DatagramSizeSearch, candidate_sizes
from tests.netns import Lab, can_make_namespaces, run

ETHERNET, JUMBO = 1500 - 28, 9000 - 28


def test_candidates_are_the_interface_limit_then_common_mtus_below_it() -> None:
    assert candidate_sizes(65536) == [path_mtu.MAX_PROBED_DATAGRAM_BYTES, JUMBO, ETHERNET]
    assert candidate_sizes(9000) == [JUMBO, ETHERNET]
    assert candidate_sizes(1500) == [ETHERNET]
    assert candidate_sizes(1500, ipv6=True) == [1500 - 48]
    assert candidate_sizes(1420) == [1420 - 28]  # a WireGuard link
    assert candidate_sizes(1280, ipv6=True) == [1232]  # IPv6's minimum link
    assert candidate_sizes(1228) == []  # nothing above QUIC's minimum
    assert candidate_sizes(None) == []


def test_search_takes_the_first_acknowledged_size_from_the_top() -> None:
    search = DatagramSizeSearch([JUMBO, ETHERNET])
    for _ in range(path_mtu.PROBE_ATTEMPTS):  # a loss may be congestion: a size gets several tries
        assert search.next_probe() == JUMBO
        assert search.next_probe() is None  # one probe at a time
        search.on_probe_result(JUMBO, acknowledged=False)
        assert search.confirmed == BASE_DATAGRAM_BYTES and not search.done
    assert search.next_probe() == ETHERNET
    search.on_probe_result(ETHERNET, acknowledged=True)
    assert (search.confirmed, search.done, search.next_probe()) == (ETHERNET, True, None)


def test_an_acknowledged_top_size_ends_the_search() -> None:
    search = DatagramSizeSearch([JUMBO, ETHERNET])
    search.on_probe_result(search.next_probe(), acknowledged=True)
    assert (search.confirmed, search.done) == (JUMBO, True)


def test_a_black_hole_goes_back_to_the_base_size_and_searches_again() -> None:
    search = DatagramSizeSearch([JUMBO])
    search.on_probe_result(search.next_probe(), acknowledged=True)
    search.on_black_hole([ETHERNET])
    assert (search.confirmed, search.done) == (BASE_DATAGRAM_BYTES, False)
    stale = JUMBO
    assert search.next_probe() == ETHERNET
    search.on_probe_result(stale, acknowledged=True)  # a probe from before the black hole: ignored
    assert search.confirmed == BASE_DATAGRAM_BYTES
    search.on_probe_result(ETHERNET, acknowledged=True)
    assert search.confirmed == ETHERNET


# --- real QUIC between namespaces whose links differ -------------------------------------

PORT = 47471
SECRET_HEX = "11" * 32
TRANSFER_BYTES = 4 * 1024 * 1024
SETTLE_S = 10.0

# One side of a transfer over MeshTransport: the dialer sends DATA, the listener checks it and
# sends DATA back with "ok" after it; each prints the datagram size it settled on, as JSON.
ENDPOINT = textwrap.dedent(f"""
    import asyncio, hashlib, json, sys
    from mesh_sidecar.identity import generate_identity
    from mesh_sidecar.net.transport import MeshTransport

    role, peer_ip = sys.argv[1], sys.argv[2]
    DATA = hashlib.shake_256(b"mtu test").digest({TRANSFER_BYTES})

    async def settle(connection):
        # The search runs alongside the transfer; a lost probe only costs time.
        for _ in range(int({SETTLE_S} / 0.05)):
            if connection.datagram_size > 1200 and not connection._size_search.in_flight:
                break
            await asyncio.sleep(0.05)
        return connection.datagram_size

    async def send(writer, data):
        for offset in range(0, len(data), 65536):
            writer.write(data[offset:offset + 65536])
            await writer.drain()
        writer.write_eof()

    async def receive(reader):
        data = bytearray()
        while chunk := await reader.read(65536):
            data += chunk
        return bytes(data)

    async def main():
        identity = generate_identity()
        finished, peer_gone = asyncio.Event(), asyncio.Event()
        report = {{}}

        async def on_peer(connection):
            async def serve(reader, writer):
                report["received_ok"] = await receive(reader) == DATA
                await send(writer, DATA + (b"ok" if report["received_ok"] else b"no"))
                report["datagram_size"] = await settle(connection)
                finished.set()
            connection.set_stream_handler(serve)
            try:
                await connection.wait_closed()
            finally:  # the transport cancels this task as the connection closes
                peer_gone.set()

        mesh = MeshTransport(identity, bytes.fromhex("{SECRET_HEX}"), on_peer)
        await mesh.start("0.0.0.0", {PORT})
        if role == "listen":
            print(identity.node_id.hex(), flush=True)
            await asyncio.wait_for(finished.wait(), 60)
            print(json.dumps(report), flush=True)
            await asyncio.wait_for(peer_gone.wait(), 30)  # until the dialer has all it was sent
        else:
            connection = await mesh.connect([(peer_ip, {PORT})], bytes.fromhex(sys.stdin.readline().strip()))
            reader, writer = await connection.open_stream()
            _, received = await asyncio.gather(send(writer, DATA), receive(reader))
            report["received_ok"] = received == DATA + b"ok"
            report["datagram_size"] = await settle(connection)
            print(json.dumps(report), flush=True)
        await mesh.close()

    asyncio.run(main())
""")


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not can_make_namespaces(), reason="needs root and `ip netns`")
@pytest.mark.skipif(not quic.QuicConnection.probes_datagram_size, reason="qh3 probes its own sizes")
def test_each_side_finds_the_size_its_path_carries():
    """a's link takes jumbo frames but b's does not: the bridge drops a's 9000-byte frames to b
    without a word, so only acknowledged probes can tell a to use Ethernet-sized datagrams."""
    lab = Lab(sniff=False)
    procs: list[subprocess.Popen] = []
    try:
        a, b = lab.add_host("a"), lab.add_host("b")
        run("ip", "link", "set", lab.bridge, "mtu", "9000")
        run("ip", "link", "set", f"{lab.tag}ao", "mtu", "9000")
        run("ip", "-n", a.netns, "link", "set", a.device, "mtu", "9000")
        listener = subprocess.Popen(b.exec_argv(sys.executable, "-c", ENDPOINT, "listen", a.ip),
                                    stdout=subprocess.PIPE, text=True)
        procs.append(listener)
        node_id = listener.stdout.readline()
        dialer = subprocess.Popen(a.exec_argv(sys.executable, "-c", ENDPOINT, "dial", b.ip),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(dialer)
        dialer_out, _ = dialer.communicate(node_id, timeout=90)
        listener_out, _ = listener.communicate(timeout=30)
        from_a, from_b = json.loads(dialer_out), json.loads(listener_out)
        assert from_a == {"received_ok": True, "datagram_size": ETHERNET}  # 8972 was lost on the way
        assert from_b == {"received_ok": True, "datagram_size": ETHERNET}  # b's own link allows no more
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lab.close()
