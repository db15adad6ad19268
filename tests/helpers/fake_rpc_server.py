"""A stand-in ggml-rpc-server of another RPC protocol version: it answers HELLO with 6.0.0 and nothing else.

Run with ggml-rpc-server's arguments (``-H HOST -p PORT``, ``-c`` and others ignored). Like the
real one it serves one client at a time, until that client disconnects.
"""

from __future__ import annotations

import argparse
import socket
import struct

VERSION = (6, 0, 0)
HELLO_CMD = 14
CAPS_BYTES = 24
HEADER = struct.Struct("<BQ")


def read_exactly(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def serve_client(conn: socket.socket) -> None:
    header = read_exactly(conn, HEADER.size)
    if header is None:
        return
    cmd, size = HEADER.unpack(header)
    if cmd != HELLO_CMD or read_exactly(conn, size) is None:
        return
    # The 7.x reply's form (major, minor, patch, flags, caps), with another major.
    payload = bytes([*VERSION, 0]) + bytes(CAPS_BYTES)
    conn.sendall(struct.pack("<Q", len(payload)) + payload)
    while conn.recv(65536):  # no other command is answered; hold the client until it leaves
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=50052)
    parser.add_argument("-c", "--cache", action="store_true")
    args, _ = parser.parse_known_args()
    with socket.create_server((args.host, args.port)) as server:
        print(f"fake rpc-server answering HELLO with {'.'.join(map(str, VERSION))} on {args.host}:{args.port}",
              flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                serve_client(conn)


if __name__ == "__main__":
    main()
