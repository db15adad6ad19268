"""The transport's route table: which connection each QUIC connection id leads to.

A datagram names its connection by destination connection id; a connection has
several over its life (the ones it started with, then those QUIC issues and
retires). The table is their one owner: the transport adds a connection with its
first ids and looks datagrams up, the connection adds and retires ids as its
QUIC library reports them, and a finished connection leaves with all of its ids.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)


class ConnectionIdTable(Generic[C]):
    """Connection ids to live connections, and every live connection, routed or not."""

    def __init__(self) -> None:
        self._routes: dict[bytes, C] = {}
        self._ids: dict[C, set[bytes]] = {}

    @property
    def connections(self) -> frozenset[C]:
        """Every connection added and not yet removed."""
        return frozenset(self._ids)

    def add(self, connection: C, *connection_ids: bytes) -> None:
        """A new connection, reached by ``connection_ids``."""
        self._ids.setdefault(connection, set())
        for connection_id in connection_ids:
            self.route(connection_id, connection)

    def route(self, connection_id: bytes, connection: C) -> None:
        """Datagrams to ``connection_id`` go to ``connection`` from now on."""
        self._ids.setdefault(connection, set()).add(connection_id)
        self._routes[connection_id] = connection

    def retire(self, connection_id: bytes) -> None:
        """``connection_id`` leads nowhere any more."""
        connection = self._routes.pop(connection_id, None)
        if connection is not None:
            self._ids[connection].discard(connection_id)

    def get(self, connection_id: bytes) -> C | None:
        """The connection a datagram to ``connection_id`` belongs to, if any."""
        return self._routes.get(connection_id)

    def remove(self, connection: C) -> None:
        """``connection`` is gone: none of its ids lead anywhere."""
        for connection_id in self._ids.pop(connection, set()):
            if self._routes.get(connection_id) is connection:
                del self._routes[connection_id]
