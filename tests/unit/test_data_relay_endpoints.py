"""What the sidecar tells the native relay of each member's REGISTER_PEER endpoints (net/data_plane/process.py): one
table per member, told only while the relay knows that member, told again when it is named again."""

from __future__ import annotations

import socket
from pathlib import Path

from mesh_sidecar.identity import generate_identity
from mesh_sidecar.net.data_plane.process import DataRelay

X, Y = bytes(range(32)), bytes(range(32, 64))


def told(ours: socket.socket) -> list[str]:
    ours.setblocking(False)
    data = b""
    try:
        while chunk := ours.recv(65536):
            data += chunk
    except BlockingIOError:
        pass
    return data.decode().splitlines()


def test_each_members_endpoints_are_its_own_and_go_with_it() -> None:
    listener = socket.socket()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    relay = DataRelay(Path("/nonexistent"), generate_identity(), listener, lambda _r: None, lambda: None,
                      guard=(64, 8, 3.0))
    relay._control = theirs  # what run() holds while the relay runs
    try:
        relay.member(X, ("10.0.0.1",))
        relay.set_endpoints({X: {0: "127.0.0.1:40001"}, Y: {0: "127.0.0.1:40002"}})
        assert told(ours) == [f"member {X.hex()} 10.0.0.1", f"endpoint {X.hex()} 0 127.0.0.1:40001"]
        relay.member(Y, ("10.0.0.2",))  # named: its table follows
        assert told(ours) == [f"member {Y.hex()} 10.0.0.2", f"endpoint {Y.hex()} 0 127.0.0.1:40002"]
        relay.set_endpoints({X: {1: "127.0.0.1:40003"}})  # X's order changed; Y sent none any more
        assert sorted(told(ours)) == sorted([f"endpoint {X.hex()} 0 -", f"endpoint {X.hex()} 1 127.0.0.1:40003",
                                             f"endpoint {Y.hex()} 0 -"])
        relay.forget(X)  # the relay drops its table with it
        relay.set_endpoints({X: {1: "127.0.0.1:40003"}})
        assert told(ours) == [f"forget {X.hex()}"]
        relay.member(X, ("10.0.0.1",))
        assert told(ours) == [f"member {X.hex()} 10.0.0.1", f"endpoint {X.hex()} 1 127.0.0.1:40003"]
    finally:
        relay._control = None
        for sock in (listener, ours, theirs):
            sock.close()
