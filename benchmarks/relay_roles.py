"""The processes of the relay benchmark (``benchmarks/relay.py``), each run in a host's namespace as
``python -m benchmarks.relay_roles ROLE SPEC`` (SPEC: a JSON object):

- ``target`` (on b): counts what a connection sends to its end ("S") or echoes it ("E"), on
  127.0.0.1 (for the tunnel) and on b's bridge address (for plain TCP);
- ``client`` (on a): one bulk transfer or one series of round trips, one JSON object out;
- ``node`` (on a or b): one mesh process, a MeshTransport with one side of the tunnel, no llama.cpp.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

QUIC_PORT = 47470
TARGET_PORT = 47480
SEND_CHUNK_BYTES = 1024 * 1024
RECV_CHUNK_BYTES = 1024 * 1024
MESSAGE_BYTES = 64
WARMUP_ROUND_TRIPS = 200
BULK_TIMEOUT_S = 600.0
SINK, ECHO = b"S", b"E"
COUNT_BYTES = 8


# --------------------------------------------------------------------------------------------
# The target: runs on b, plain threads and blocking sockets (never the bottleneck).
# --------------------------------------------------------------------------------------------

def target(spec: dict[str, Any]) -> None:
    def serve(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mode = conn.recv(1)
            buffer = bytearray(RECV_CHUNK_BYTES)
            if mode == SINK:
                total = 0
                while n := conn.recv_into(buffer):
                    total += n
                conn.sendall(total.to_bytes(COUNT_BYTES, "big"))
            elif mode == ECHO:
                view = memoryview(buffer)
                while n := conn.recv_into(buffer):
                    conn.sendall(view[:n])

    def listen(host: str) -> None:
        server = socket.create_server((host, TARGET_PORT), reuse_port=False)
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    for host in spec["hosts"]:
        threading.Thread(target=listen, args=(host,), daemon=True).start()
    print("listening", flush=True)
    threading.Event().wait()


# --------------------------------------------------------------------------------------------
# The client: runs on a, one measurement per process, prints one JSON object.
# --------------------------------------------------------------------------------------------

def client(spec: dict[str, Any]) -> dict[str, Any]:
    conn = socket.create_connection((spec["host"], spec["port"]), timeout=BULK_TIMEOUT_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        if spec["mode"] == "bulk":
            return _bulk(conn, spec["bytes"])
        return _round_trips(conn, spec["round_trips"])


def _bulk(conn: socket.socket, total: int) -> dict[str, Any]:
    chunk = memoryview(os.urandom(SEND_CHUNK_BYTES))
    started = time.perf_counter()
    conn.sendall(SINK)
    left = total
    while left:
        n = min(left, SEND_CHUNK_BYTES)
        conn.sendall(chunk[:n])
        left -= n
    conn.shutdown(socket.SHUT_WR)
    count = _recv_exactly(conn, COUNT_BYTES)
    seconds = time.perf_counter() - started
    received = int.from_bytes(count, "big")
    if received != total:
        raise SystemExit(f"the target counted {received} bytes of {total}")
    return {"bytes": total, "seconds": seconds, "gbit_s": total * 8 / seconds / 1e9}


def _round_trips(conn: socket.socket, count: int) -> dict[str, Any]:
    message = os.urandom(MESSAGE_BYTES)
    conn.sendall(ECHO)
    samples = []
    for i in range(WARMUP_ROUND_TRIPS + count):
        started = time.perf_counter_ns()
        conn.sendall(message)
        if _recv_exactly(conn, MESSAGE_BYTES) != message:
            raise SystemExit("the echo came back altered")
        if i >= WARMUP_ROUND_TRIPS:
            samples.append((time.perf_counter_ns() - started) / 1000)
    return {"round_trips": count, "us": samples}


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise SystemExit(f"connection closed after {len(data)} of {n} bytes")
        data += part
    return bytes(data)


# --------------------------------------------------------------------------------------------
# A mesh node: runs on a or b, a MeshTransport and one side of the tunnel, until SIGTERM.
# --------------------------------------------------------------------------------------------

def node(spec: dict[str, Any]) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name, value in spec["tweaks"].items():
        module, constant = name.rsplit(".", 1)
        setattr(importlib.import_module(f"mesh_sidecar.{module}"), constant, value)
    if spec["uvloop"]:
        import uvloop

        uvloop.run(_node_main(spec))
    else:
        asyncio.run(_node_main(spec))



async def _node_main(spec: dict[str, Any]) -> None:
    from mesh_sidecar.identity import generate_identity
    from mesh_sidecar.net import quic, transport
    from mesh_sidecar.net.connection import PeerConnection
    from mesh_sidecar.net.peer_streams import serve_peer_stream
    from mesh_sidecar.net.tunnel import TunnelListener, serve_inbound_stream
    from mesh_sidecar.ports import LOOPBACK
    from mesh_sidecar.wire.stream_kind import StreamKind

    workdir = Path(spec["workdir"])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    identity = generate_identity()
    secret = bytes.fromhex(spec["secret"])

    async def serve_peer(peer: PeerConnection) -> None:
        if spec["name"] == "b":
            servers = {StreamKind.RPC: lambda r, w: serve_inbound_stream(r, w, TARGET_PORT, lambda _peer: None, "a")}
            peer.set_stream_handler(lambda r, w: serve_peer_stream(r, w, servers, "a"))
        await peer.wait_closed()

    mesh = transport.MeshTransport(identity, secret, serve_peer)
    await mesh.start(spec["ip"], QUIC_PORT)
    listener = None
    info = {"library": quic.QUIC_LIBRARY, "version": importlib.metadata.version(quic.QUIC_LIBRARY),
            "pid": os.getpid()}
    if spec["name"] == "b":
        (workdir / "b.id").write_text(identity.node_id.hex())
    else:
        b_id = bytes.fromhex((workdir / "b.id").read_text())
        peer = await mesh.connect([(spec["peer_ip"], QUIC_PORT)], b_id)
        listener = TunnelListener(peer)
        info["tunnel"] = [LOOPBACK, await listener.start()]
    (workdir / f"{spec['name']}.ready").write_text(json.dumps(info))
    await stop.wait()
    if listener is not None:
        await listener.close()
    await mesh.close()


ROLES = {"target": target, "client": client, "node": node}

if __name__ == "__main__":
    answer = ROLES[sys.argv[1]](json.loads(sys.argv[2]))
    if answer is not None:  # the client's figures
        print(json.dumps(answer))
