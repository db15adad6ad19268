"""Local TCP ports: pick free ones, and check the ones a user names."""

from __future__ import annotations

import errno
import socket

from .errors import PortInUseError

LOOPBACK = "127.0.0.1"
DEFAULT_API_PORT = 8080  # the OpenAI-compatible API on every node, when free
DEFAULT_QUIC_PORT = 47470  # UDP, the mesh (a node's data relay takes the same number in TCP when free)


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


PROC_NET_TCP = "/proc/net/tcp"


def _proc_address(address: tuple[str, int]) -> str:
    """An IPv4 (host, port) as /proc/net/tcp writes it: the address in host byte order, hex."""
    packed = socket.inet_aton(address[0])
    return f"{int.from_bytes(packed, 'little'):08X}:{address[1]:04X}"


def socket_owner_uid(table: str, local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """In a /proc/net/tcp ``table``, the uid owning the socket bound to ``local`` and connected to ``remote``."""
    wanted = (_proc_address(local), _proc_address(remote))
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7 and (fields[1], fields[2]) == wanted:
            return int(fields[7])
    return None


def loopback_client_uid(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid of the local process whose connection from ``client`` reached our ``server`` socket.

    None if the kernel's table does not show it (not Linux, or the client is gone).
    """
    try:
        with open(PROC_NET_TCP) as f:
            return socket_owner_uid(f.read(), client, server)
    except OSError:
        return None
