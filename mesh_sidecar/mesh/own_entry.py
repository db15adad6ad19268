"""This node's own entry in gossip: what it is (name, build, run id), what it holds and offers members
(the model's identity and files, its devices, its capacity), what it serves; ``info`` adds where it is
reached and the serving side's verdicts, as the mesh knows them now."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from pathlib import Path

from .. import __version__
from ..llama.build import offered_source
from ..llama.model import offered_files
from ..wire.gossip import MAX_DEVICES_PER_MEMBER, MAX_RUN_ID, MemberInfo, OfferedDevice, ServedModel
from .config import MeshConfig
from .serving import ServingVerdicts


def _serves_nothing() -> ServedModel | None:
    return None


class OwnEntry:
    """What this node announces about itself, apart from where it is reached."""

    def __init__(self, config: MeshConfig) -> None:
        self._node_id = config.identity.node_id
        self._name = config.name
        self._capacity = config.capacity
        self._serving = config.serving
        self.build = config.build  # announced; members and the serving node compare it (exclusion.py)
        self.model_sha256 = config.model_sha256
        self.devices = config.devices[:MAX_DEVICES_PER_MEMBER]
        # The model's files members may fetch, by sha256 (a split model's manifest and shards).
        self._offered = (offered_files(config.model_file, config.model_sha256)
                         if config.model_file is not None and config.model_sha256 else {})
        self.run_id = secrets.randbelow(MAX_RUN_ID) + 1  # announced: a new one tells members this node restarted
        # A serving node's announcement of what it serves (serve/supervisor.py), read at each announcement.
        self.serves: Callable[[], ServedModel | None] = _serves_nothing

    def offered(self, sha256: str) -> Path | None:
        """A file members may fetch: only the model we announce, while we announce it, and the pinned llama.cpp
        source, which a member without package access builds from (mesh/source_fetch.py)."""
        return self._offered.get(sha256) or offered_source(sha256)

    def holds_model(self, sha256: str, path: Path) -> None:
        """The model ``sha256`` is held at ``path`` now: its files are offered (ModelError if not there)."""
        self._offered = offered_files(path, sha256)
        self.model_sha256 = sha256

    def devices_measured(self, devices: tuple[OfferedDevice, ...]) -> None:
        self.devices = devices[:MAX_DEVICES_PER_MEMBER]

    def info(self, addresses: tuple[str, ...], held: tuple[tuple[str, int], ...], secret_epoch: int,
             verdicts: ServingVerdicts, data_port: int) -> MemberInfo:
        """The entry as gossip carries it now."""
        return MemberInfo(
            node_id=self._node_id, name=self._name, version=__version__, addresses=addresses,
            capacity=dataclasses.replace(self._capacity(), held=held).to_gossip(),
            serving=self._serving, rpc_ready=True, llama_build=self.build, model_sha256=self.model_sha256,
            secret_epoch=secret_epoch, run_id=self.run_id,
            corrupt_outputs=verdicts.corrupt, slow_workers=verdicts.slow, serves=self.serves(),
            devices=self.devices, data_port=data_port)
