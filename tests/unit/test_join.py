"""Joining with a ticket: a member that does not answer yet is dialed again for a while; a wrong
secret is final at once. Real Meshes on loopback (real QUIC), no llama.cpp processes."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from mesh_sidecar.errors import AuthError, PeerConnectionError
from mesh_sidecar.identity import generate_identity
from mesh_sidecar.mesh.timings import MeshTimings
from mesh_sidecar.ports import LOOPBACK
from mesh_sidecar.wire import auth
from mesh_sidecar.wire.ticket import PeerAddress, Ticket
from tests.helpers.meshes import HANG_S, make_mesh, row, ticket_of, wait_for
from tests.helpers.nodes import free_udp_port

SECRET = b"s" * auth.MESH_SECRET_BYTES


QUICK_DIALS = MeshTimings(dial_timeout_s=0.5, join_retry_s=0.2)


async def test_a_joiner_waits_for_a_member_that_starts_late(tmp_path):
    identity, port = generate_identity(), free_udp_port()
    said: list[str] = []
    joiner = make_mesh(tmp_path, "joiner", SECRET, said.append, timings=QUICK_DIALS)
    late = make_mesh(tmp_path, "late", SECRET, identity=identity, timings=QUICK_DIALS)
    await joiner.start(0)
    try:
        joining = asyncio.create_task(joiner.join(Ticket(identity.node_id, SECRET, (PeerAddress(LOOPBACK, port),))))
        await wait_for(lambda: any(m.startswith("No answer from") for m in said), "the first dial fails")
        assert not joining.done()
        await late.start(port)
        await asyncio.wait_for(joining, HANG_S)
        await wait_for(lambda: row(joiner, late).get("state") == "connected", "the joiner is connected")
        assert sum(m.startswith("No answer from") for m in said) == 1  # said once, however many dials
    finally:
        await asyncio.gather(joiner.close(graceful=False), late.close(graceful=False))


async def test_a_joiner_gives_up_after_its_patience_saying_what_to_check(tmp_path):
    joiner = make_mesh(tmp_path, "joiner", SECRET, timings=dataclasses.replace(QUICK_DIALS, join_patience_s=1.5))
    await joiner.start(0)
    try:
        ticket = Ticket(generate_identity().node_id, SECRET, (PeerAddress(LOOPBACK, free_udp_port()),))
        with pytest.raises(PeerConnectionError, match=r"no answer.*Nothing answered for 1.5 s.*fresh ticket"):
            await asyncio.wait_for(joiner.join(ticket), HANG_S)
    finally:
        await joiner.close(graceful=False)


async def test_a_wrong_secret_is_not_retried(tmp_path):
    said: list[str] = []
    wrong = b"w" * auth.MESH_SECRET_BYTES  # an old ticket's secret, from before a rotation
    member = make_mesh(tmp_path, "member", SECRET)
    joiner = make_mesh(tmp_path, "joiner", wrong, said.append)
    await member.start(0)
    await joiner.start(0)
    try:
        # Well within the default patience (60 s): a refusal ends the join at the first answer.
        with pytest.raises(AuthError):
            await asyncio.wait_for(joiner.join(ticket_of(member, wrong)), HANG_S)
        assert not any(m.startswith("No answer from") for m in said)
    finally:
        await asyncio.gather(joiner.close(graceful=False), member.close(graceful=False))
