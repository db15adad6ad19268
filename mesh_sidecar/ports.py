"""Local TCP ports: pick free ones, and check the ones a user names."""

from __future__ import annotations

import errno
import socket

from .errors import PortInUseError

LOOPBACK = "127.0.0.1"


def free_tcp_port(host: str = LOOPBACK) -> int:
    """A port that is free now on ``host`` (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_tcp_port_free(host: str, port: int, what: str) -> None:
    """PortInUseError naming ``what`` wanted the port, if something already holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise PortInUseError(
                    f"Port {port} on {host} is already in use, so {what} cannot listen there. "
                    f"Stop the program holding it (e.g. `ss -ltnp 'sport = :{port}'`) or choose "
                    "another port."
                ) from exc
            raise
