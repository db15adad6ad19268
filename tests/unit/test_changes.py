"""Change notification (mesh/changes.py): every waiter sees every change, none is missed in between."""

from __future__ import annotations

import asyncio

from mesh_sidecar.mesh.changes import Changes

HANG_S = 5.0  # a wait that only fails if something hangs


async def test_every_waiter_wakes_on_one_change() -> None:
    changes = Changes()
    seen = changes.version
    waiters = [asyncio.ensure_future(changes.wait_after(seen)) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    changes.notify()
    assert await asyncio.wait_for(asyncio.gather(*waiters), HANG_S) == [seen + 1] * 3


async def test_a_change_made_before_the_wait_is_not_missed() -> None:
    changes = Changes()
    seen = changes.version
    changes.notify()  # between looking and waiting
    assert await asyncio.wait_for(changes.wait_after(seen), HANG_S) == seen + 1


async def test_one_waiter_does_not_consume_the_change_for_another() -> None:
    changes = Changes()
    seen = changes.version
    changes.notify()
    first = await changes.wait_after(seen)
    later = asyncio.ensure_future(changes.wait_after(first))
    assert await asyncio.wait_for(changes.wait_after(seen), HANG_S) == first  # the other still sees it
    await asyncio.sleep(0)
    assert not later.done()  # the next one waits for the next change
    changes.notify()
    assert await asyncio.wait_for(later, HANG_S) == first + 1
