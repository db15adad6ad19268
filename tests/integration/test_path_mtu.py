"""Datagram size discovery over real QUIC between network namespaces whose links differ in MTU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from mesh_sidecar.net import quic
from tests.helpers.netns import Lab, can_make_namespaces, run
from tests.unit.test_path_mtu import ETHERNET

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
