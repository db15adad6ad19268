"""The models served in the mesh, as every node sees them: built from gossip, pure.

Every serving node says in gossip what it serves (``MemberInfo.serves``: the model's id, loading
or ready, its plan's members, requests in flight). Any node's API reads the mesh through this
module: ``/v1/models`` lists every model once with its replicas, and a request is routed by the
``model`` it names::

    "", "default"         the model this node serves, else the mesh's default: the model of the
                          serving node that began serving first (ties: the lower node id)
    an id or file name    that model, wherever it is served
    anything else         404 model_not_found, naming the models there are

A model served by several nodes (replicas) goes to the ready replica with the fewest requests in
flight, except that one conversation stays with the replica that answered it before while it is
there: its prompt is cached there (``conversation_key``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..llama.model_files import model_stem
from ..wire.gossip import MemberInfo
from .tiers import DEFAULT_MODEL_NAMES, OWNER, TierView, models_list

READY = "ready"
LOADING = "loading"
UNAVAILABLE = "unavailable"
CONVERSATION_PROMPT_CHARS = 512  # a completion's conversation: its prompt's beginning


@dataclass(frozen=True)
class Replica:
    """One serving node of a model."""

    node_id: bytes
    name: str
    state: str  # READY, LOADING or UNAVAILABLE
    in_flight: int  # as it last said in gossip (this node's own: live)
    since: float  # when it began serving
    members: tuple[tuple[bytes, str], ...]  # its plan's members (id, name), in --rpc order
    local: bool  # this node
    takes_images: bool = False  # it runs the model with a --mmproj projector

    def to_json(self) -> dict[str, Any]:
        return {"node": {"id": self.node_id.hex(), "name": self.name}, "local": self.local, "state": self.state,
                "in_flight": self.in_flight, "vision": self.takes_images,
                "members": [{"id": node_id.hex(), "name": name} for node_id, name in self.members]}


@dataclass(frozen=True)
class MeshModel:
    """One model and every node that serves it, the earliest first."""

    id: str
    replicas: tuple[Replica, ...]

    @property
    def state(self) -> str:
        states = {replica.state for replica in self.replicas}
        return READY if READY in states else LOADING if LOADING in states else UNAVAILABLE

    def local(self) -> Replica | None:
        return next((replica for replica in self.replicas if replica.local), None)

    @property
    def takes_images(self) -> bool:
        """Whether a replica runs it with a projector (image requests go only to those)."""
        return any(replica.takes_images for replica in self.replicas)

    def capabilities(self) -> list[str]:
        """As llama-server's own ``/v1/models`` says them: ``multimodal`` when it takes images."""
        return ["completion", *(["multimodal"] if self.takes_images else [])]

    def to_json(self, default: bool) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "default": default, "vision": self.takes_images,
                "replicas": [replica.to_json() for replica in self.replicas]}


@dataclass(frozen=True)
class MeshCatalog:
    """Every model served in the mesh now; ``default`` is what a request naming none gets."""

    models: tuple[MeshModel, ...]
    default: str | None

    def find(self, requested: str) -> MeshModel | None:
        """The model a request's ``model`` names (an id, a file name, or none for the default)."""
        wanted = self.default if requested in DEFAULT_MODEL_NAMES else requested
        if wanted is None:
            return None
        stem = model_stem(wanted) if wanted.endswith(".gguf") else wanted
        return next((model for model in self.models if model.id == stem), None)

    def ids(self) -> list[str]:
        return [model.id for model in self.models]

    def not_found(self, requested: str) -> str:
        """What a client naming a model nobody serves is told."""
        there = ", ".join(repr(model_id) for model_id in self.ids())
        if not there:
            return "No model is served now in this mesh: start a node with --serve PORT (and --model FILE)."
        named = "No model was named and there is no default" if requested in DEFAULT_MODEL_NAMES else (
            f"The model {requested!r} is not served in this mesh")
        return f"{named}. Served now: {there} (send one of these, 'default' or none)."

    def to_json(self) -> list[dict[str, Any]]:
        """The status JSON's ``models``."""
        return [model.to_json(model.id == self.default) for model in self.models]

    def openai_entries(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries: OpenAI's fields, with who serves each model and whether it is ready."""
        return [{"id": model.id, "object": "model", "created": created, "owned_by": OWNER,
                 "status": model.state, "default": model.id == self.default, "capabilities": model.capabilities(),
                 "replicas": [replica.to_json() for replica in model.replicas]} for model in self.models]


def mesh_catalog(own: MemberInfo, members: Sequence[MemberInfo], name_of: Callable[[bytes], str],
                 own_in_flight: int = 0) -> MeshCatalog:
    """The catalog from this node's info (``own``) and the connected members' (a member gone from
    ``members`` is gone from the catalog)."""
    replicas: dict[str, list[Replica]] = {}
    for info in (own, *members):
        served = info.serves
        if served is None:
            continue
        local = info.node_id == own.node_id
        replicas.setdefault(served.model, []).append(Replica(
            info.node_id, info.name, served.state, own_in_flight if local else served.in_flight, served.since,
            tuple((node_id, name_of(node_id)) for node_id in served.members), local, bool(served.projector_sha256)))
    models = tuple(sorted(
        (MeshModel(model_id, tuple(sorted(found, key=lambda r: (r.since, r.node_id))))
         for model_id, found in replicas.items()),
        key=lambda model: (model.replicas[0].since, model.replicas[0].node_id)))
    own_model = own.serves.model if own.serves is not None else None
    return MeshCatalog(models, own_model if own_model is not None else models[0].id if models else None)


def mesh_models_list(catalog: MeshCatalog, tiers: Sequence[TierView], created: int) -> dict[str, Any]:
    """``/v1/models``: every model served in the mesh, with its replicas; a serving node's ``tiers`` as
    tiers.py lists them (a tier in service is one entry with its replicas)."""
    entries = catalog.openai_entries(created)
    by_id = {entry["id"]: entry for entry in entries}
    for tier in models_list(tiers, created)["data"]:
        if tier["id"] in by_id:
            by_id[tier["id"]].update({k: v for k, v in tier.items() if k not in by_id[tier["id"]]})
        else:
            entries.append(tier)
    return {"object": "list", "data": entries}


def choose_replica(model: MeshModel, load: Mapping[bytes, int], *, avoid: frozenset[bytes] = frozenset(),
                   sticky: bytes | None = None, images: bool = False) -> Replica | None:
    """The ready replica to ask: ``sticky`` (where this conversation went before) while it is ready,
    else the one with the fewest requests in flight (``load``: what this node knows beyond gossip,
    added), this node's own first on ties, then the earliest; with ``images``, only those that take
    them. None: no ready replica outside ``avoid``."""
    ready = [r for r in model.replicas
             if r.state == READY and r.node_id not in avoid and (r.takes_images or not images)]
    for replica in ready:
        if replica.node_id == sticky:
            return replica
    return min(ready, key=lambda r: (r.in_flight + load.get(r.node_id, 0), not r.local, r.since, r.node_id),
               default=None)


def conversation_key(path: str, request: Any) -> str | None:
    """What stays the same over a conversation's requests: its messages up to the first user turn (a chat),
    or the prompt's beginning (a completion). None: nothing to keep it by."""
    if not isinstance(request, dict):
        return None
    messages = request.get("messages")
    if isinstance(messages, list) and messages:
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                          len(messages) - 1)
        opening: Any = messages[: first_user + 1]
    elif isinstance(request.get("prompt"), str):
        opening = request["prompt"][:CONVERSATION_PROMPT_CHARS]
    else:
        return None
    text = json.dumps([path, request.get("model", ""), opening], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()

