"""Secret rotation and kicking a member, over real QUIC on loopback (no llama.cpp)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from mesh_sidecar.errors import AuthError
from mesh_sidecar.mesh.runtime import Mesh
from mesh_sidecar.mesh.saved import MESH_FILE_NAME, SavedMesh
from mesh_sidecar.wire import auth
from mesh_sidecar.wire.ticket import decode_ticket
from tests.helpers.meshes import make_mesh, row, ticket_of, wait_for

OLD_SECRET = b"o" * auth.MESH_SECRET_BYTES


@pytest.fixture
async def trio(tmp_path):
    """A, B and C in one mesh (B and C joined with A's ticket)."""
    meshes = [make_mesh(tmp_path, name, OLD_SECRET) for name in "abc"]
    tasks = []
    for m in meshes:
        await m.start(0)
        tasks.append(asyncio.create_task(m.run()))
    a, b, c = meshes
    await b.join(ticket_of(a, OLD_SECRET))
    await c.join(ticket_of(a, OLD_SECRET))
    await wait_for(lambda: all(len(m.connected_members()) == 2 for m in meshes), "full mesh")
    yield meshes
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for m in meshes:
        await m.close(graceful=False)


def saved(mesh: Mesh) -> dict:
    return json.loads((mesh._home.root / MESH_FILE_NAME).read_text())


async def test_rotation_gives_members_a_new_secret_and_shuts_out_old_tickets(trio, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "mesh_sidecar.net.connection")
    a, b, c = trio
    new_ticket = decode_ticket(b.rotate_secret())
    assert new_ticket.mesh_secret != OLD_SECRET and new_ticket.node_id == b.identity.node_id
    await wait_for(lambda: all(saved(m)["secret"] == new_ticket.mesh_secret.hex() for m in trio), "all rotated")
    assert all(saved(m)["epoch"] == 1 for m in trio)
    await wait_for(lambda: row(a, c).get("secret_epoch") == 1, "epoch gossiped")
    assert all(len(m.connected_members()) == 2 for m in trio), "rotation must not drop anyone"

    stranger = make_mesh(tmp_path, "d", OLD_SECRET)
    await stranger.start(0)
    try:
        with pytest.raises(AuthError, match=auth.WRONG_SECRET):
            await stranger.join(ticket_of(a, OLD_SECRET))
        refusals = [r.getMessage() for r in caplog.records
                    if auth.WRONG_SECRET in r.getMessage() and not r.getMessage().startswith("refused by")]
        assert len(refusals) == 1, refusals  # logged once, by A
        # A holder of the new ticket gets in, and restarts remember the new secret.
        late = make_mesh(tmp_path, "e", new_ticket.mesh_secret)
        await late.start(0)
        try:
            await late.join(new_ticket)
            await wait_for(lambda: len(late.connected_members()) >= 1, "new ticket admitted")
        finally:
            await late.close(graceful=False)
        assert SavedMesh.load(c._home, None).secret == new_ticket.mesh_secret
    finally:
        await stranger.close(graceful=False)


async def test_kicked_member_is_cut_off_and_cannot_come_back(trio):
    a, b, c = trio
    said_b: list[str] = []
    b._say = said_b.append
    new_ticket = decode_ticket(a.rotate_secret(remove=(c.identity.node_id,)))
    await wait_for(lambda: row(a, c).get("state") == row(b, c).get("state") == "removed", "C removed")
    await wait_for(lambda: row(c, a).get("state") == row(c, b).get("state") == "lost", "C cut off")
    assert [m.name for m in a.connected_members()] == ["b"] or len(a.connected_members()) == 1
    assert any("was removed from the mesh by a" in m for m in said_b), said_b
    for m in (a, b):
        assert c.identity.node_id.hex() in saved(m)["removed"]
    # C's old ticket no longer works...
    with pytest.raises(AuthError, match=auth.WRONG_SECRET):
        await c.join(ticket_of(a, OLD_SECRET))
    # ...and even the new secret, were it leaked to C, does not admit C's key.
    c._transport.set_secret(new_ticket.mesh_secret)
    with pytest.raises(AuthError, match="removed from the mesh"):
        await c.join(ticket_of(b, new_ticket.mesh_secret))
    assert len(a.connected_members()) == len(b.connected_members()) == 1


async def test_kick_finds_members_by_name_or_id_and_refuses_nonsense(trio):
    a, b, c = trio
    assert a.find_member("b") == b.identity.node_id
    assert a.find_member(c.identity.short_id) == c.identity.node_id
    assert a.find_member(c.identity.node_id.hex()[:12]) == c.identity.node_id
    from mesh_sidecar.errors import UsageError
    with pytest.raises(UsageError, match="No member called"):
        a.find_member("nobody")
    with pytest.raises(UsageError, match="That is this node"):
        a.find_member("a")
