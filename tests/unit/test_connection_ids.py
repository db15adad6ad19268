"""The transport's route table (net/connection_ids.py): connection ids to connections, and who owns which."""

from __future__ import annotations

from mesh_sidecar.net.connection_ids import ConnectionIdTable


def test_a_connection_is_reached_by_every_id_it_was_given_until_one_is_retired() -> None:
    routes: ConnectionIdTable[str] = ConnectionIdTable()
    routes.add("a", b"a1", b"a2")
    routes.add("b")  # not routed yet (an Initial not answered), but live
    assert routes.connections == {"a", "b"}
    routes.route(b"a3", "a")
    assert [routes.get(cid) for cid in (b"a1", b"a2", b"a3", b"b1")] == ["a", "a", "a", None]
    routes.retire(b"a1")
    routes.retire(b"unknown")
    assert routes.get(b"a1") is None and routes.get(b"a2") == "a"


def test_a_removed_connection_takes_its_ids_but_not_one_taken_over_since() -> None:
    routes: ConnectionIdTable[str] = ConnectionIdTable()
    routes.add("a", b"x", b"y")
    routes.add("b", b"z")
    routes.route(b"y", "b")  # an id that now leads to another connection stays with it
    routes.remove("a")
    assert routes.connections == {"b"}
    assert [routes.get(cid) for cid in (b"x", b"y", b"z")] == [None, "b", "b"]
    routes.remove("a")  # twice: nothing left to remove
    assert routes.connections == {"b"}
