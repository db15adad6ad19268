"""A fault injector: a stand-in ggml-rpc-server in front of the real one, that spoils its replies.

Run with ggml-rpc-server's arguments plus ``--real PATH --trigger FILE [--delay-s S]`` (a
--llama-bin wrapper script adds them, see ``faulty_rpc_build`` in conftest.py). It starts the
real rpc-server on a free port and relays each client to it, one at a time, command by command
(RPC 7.x framing: see mesh_sidecar/wire/rpc_framing.py). While FILE exists, every F32 GET_TENSOR reply goes back as
NaNs; with ``--delay-s``, every reply goes back that many seconds late instead.
It listens on -p PORT itself, so the node's readiness check (its own pid listens) passes.
"""

from __future__ import annotations

import argparse
import ctypes
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

HEADER = struct.Struct("<BQ")
GET_TENSOR = 8
GGML_TYPE_F32 = 0
NO_REPLY = {4, 5, 6, 10, 12, 16, 17}  # RPC 7.x commands that send no reply
NAN_F32 = struct.pack("<f", float("nan"))
PR_SET_PDEATHSIG = 1


def read_exactly(conn: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(min(n - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def relay(client: socket.socket, server: socket.socket, trigger: Path, delay_s: float | None) -> None:
    while (header := read_exactly(client, HEADER.size)) is not None:
        cmd, size = HEADER.unpack(header)
        payload = read_exactly(client, size)
        if payload is None:
            return
        server.sendall(header + payload)
        if cmd in NO_REPLY:
            continue
        reply_header = read_exactly(server, 8)
        if reply_header is None:
            return
        (reply_size,) = struct.unpack("<Q", reply_header)
        reply = read_exactly(server, reply_size)
        if reply is None:
            return
        if delay_s is not None:
            if trigger.exists():
                time.sleep(delay_s)
        elif cmd == GET_TENSOR and struct.unpack_from("<I", payload, 8)[0] == GGML_TYPE_F32 and trigger.exists():
            reply = NAN_F32 * (reply_size // 4) + reply[reply_size // 4 * 4:]
            print(f"fault proxy: {reply_size // 4} NaNs written into a GET_TENSOR reply", flush=True)
        client.sendall(reply_header + reply)


def connect(port: int, timeout_s: float = 30.0) -> socket.socket:
    """The real rpc-server, once it listens (it starts beside us)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_in_front(real: Path, host: str, port: int, rest: list[str], label: str,
                   relay_one: Callable[[socket.socket, socket.socket], None]) -> None:
    """Start the real rpc-server on a free port with ``rest`` and relay each client on ``host:port`` to it
    through ``relay_one``, one at a time as rpc-server serves them, until killed."""
    real_port = free_port()
    libc = ctypes.CDLL(None)
    # The real rpc-server dies with us: tests stop nodes' children by pid.
    child = subprocess.Popen([str(real), "-H", "127.0.0.1", "-p", str(real_port), *rest],
                             preexec_fn=lambda: libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    try:
        with socket.create_server((host, port)) as listener:
            print(f"{label} on {host}:{port} -> rpc-server on {real_port}", flush=True)
            while True:
                client, _ = listener.accept()
                with client, connect(real_port) as server:
                    for conn in (client, server):
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    try:
                        relay_one(client, server)
                    except OSError:
                        pass
    finally:
        child.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=50052)
    parser.add_argument("--real", type=Path, required=True)
    parser.add_argument("--trigger", type=Path, required=True)
    parser.add_argument("--delay-s", type=float, help="delay replies (instead of writing NaNs)")
    args, rest = parser.parse_known_args()
    serve_in_front(args.real, args.host, args.port, rest, "fault proxy",
                   lambda client, server: relay(client, server, args.trigger, args.delay_s))


if __name__ == "__main__":
    main()
