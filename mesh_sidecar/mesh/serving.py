"""The serving node's side of the mesh: output checks on its workers' tunnels, members it leaves out.

It holds the judge of the float tensors workers return (wire/rpc_outputs.py's
OutputGuard, the output rule) and its histories per worker, cleared when llama-server
starts again (``Mesh.new_serving_session``). The serving loop installs it once
(``Mesh.install_serving``): whether to check, and what to do when a reply fails;
through it (``Mesh.verdicts``) it leaves members out (corrupt_output, slow) and reads
how long each one kept it waiting. Every tunnel holds it from its start
as its OutputChecks (net/tunnel.py): connections a tunnel accepts before the
install relay unchecked, as do all those of a node that never serves.

The verdicts themselves are kept by verdicts.py and announced in this node's gossip,
so the member left out hears why (exclusion.py); a restart there clears them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..wire.gossip import CorruptOutput, MemberInfo, SlowWorker
from ..wire.rpc_outputs import OutputGuard, OutputRejected, RpcOutputCheck
from .exclusion import SLOW_EXCLUSION_S
from .peers import PeerTable
from .verdicts import Verdicts

OnRejected = Callable[[bytes, OutputRejected], None]


class ServingVerdicts:
    """What a serving node decides about its workers, carried out on the mesh."""

    def __init__(self, peers: PeerTable, member_info: Callable[[bytes], MemberInfo | None],
                 name_of: Callable[[bytes], str], say: Callable[[str], None], changed: Callable[[], None]) -> None:
        self._peers = peers
        self._member_info = member_info
        self._name_of = name_of
        self._say = say
        self._changed = changed  # the verdicts changed: announce them, wake who watches the mesh
        self._verdicts = Verdicts()
        self._installed = False
        self._guard = OutputGuard()  # the output rule, with its histories per worker
        self._check_outputs = False
        self._on_rejected: OnRejected | None = None

    def install(self, check_outputs: bool, on_rejected: OnRejected) -> None:
        """Serving starts: judge outputs by the output rule (``check_outputs``; False: no check) and report
        failures to ``on_rejected``."""
        if self._installed:
            raise RuntimeError("a node's serving side is installed once")
        self._installed = True
        self._check_outputs, self._on_rejected = check_outputs, on_rejected

    def new_session(self) -> None:
        """llama-server starts again: the output rule's histories per worker begin anew."""
        self._guard.new_session()

    # --- the output checks, as tunnels ask for them (net/tunnel.py's OutputChecks) ---

    def check_for(self, node_id: bytes) -> RpcOutputCheck | None:
        if not self._check_outputs:
            return None
        judge = self._guard.judge
        return RpcOutputCheck(lambda tensor: judge(node_id, tensor))

    def rejected(self, node_id: bytes, event: OutputRejected) -> None:
        if self._on_rejected is not None:
            self._on_rejected(node_id, event)

    # --- for the serving loop ---

    def exclude_corrupt(self, node_id: bytes, fault: str) -> None:
        """Leave ``node_id`` out, as corrupt_output, until it restarts; announced in gossip so it hears why."""
        if (info := self._member_info(node_id)) is not None:
            self._verdicts.corrupt_found(CorruptOutput(node_id, info.run_id, fault))
            self._changed()

    def exclude_slow(self, node_id: bytes, owed_s: float, window_s: float, token_s: float) -> None:
        """Leave ``node_id`` out, as slow, until it restarts or for SLOW_EXCLUSION_S; announced in gossip."""
        if (info := self._member_info(node_id)) is not None:
            self._verdicts.slow_found(SlowWorker(node_id, info.run_id, round(owed_s * 1000), round(window_s * 1000),
                                                 max(1, round(token_s * 1000))), time.monotonic())
            self._changed()

    def reply_waits_s(self, since: float) -> dict[bytes, float]:
        """Per peer, the seconds since ``since`` (monotonic) its rpc-server owed our llama-server a reply."""
        return self._peers.reply_waits_s(since, time.monotonic())

    # --- for the mesh ---

    @property
    def corrupt(self) -> tuple[CorruptOutput, ...]:
        return self._verdicts.corrupt

    @property
    def slow(self) -> tuple[SlowWorker, ...]:
        return self._verdicts.slow

    def member_seen(self, info: MemberInfo) -> None:
        """A member left out as corrupt_output or slow that restarted (a new run id) may be given layers again."""
        if (reason := self._verdicts.forgive_restarted(info)) is not None:
            self._say(f"{info.name} restarted: it may be given layers again (it was left out as {reason})")
            self._changed()

    def expire(self, now: float) -> None:
        """Slow verdicts older than SLOW_EXCLUSION_S end."""
        for node_id in self._verdicts.expire(now):
            self._say(f"{self._name_of(node_id)} may be given layers again: it was left out as slow "
                      f"{SLOW_EXCLUSION_S / 60:.0f} minutes ago")
            self._changed()
