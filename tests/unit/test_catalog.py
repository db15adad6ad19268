"""The mesh's models as every node sees them (catalog.py) and routing by model (routing.py): no sockets."""

from __future__ import annotations

import asyncio
import json

import pytest

from mesh_sidecar.errors import ServiceUnavailableError
from mesh_sidecar.serve.api_request import ApiRequest
from mesh_sidecar.serve.catalog import (
    LOADING,
    READY,
    MeshCatalog,
    choose_replica,
    conversation_key,
    mesh_catalog,
    mesh_models_list,
)
from mesh_sidecar.serve.routing import LOCAL, MeshRouter, MeshRoutes, Refusal, Route
from mesh_sidecar.serve.tiers import FITS, IN_SERVICE, TierView
from mesh_sidecar.wire.gossip import LlamaBuild, MemberInfo, ServedModel
from mesh_sidecar.wire.rpc_hello import RpcVersion

A, B, C, W = (bytes([i]) * 32 for i in (1, 2, 3, 4))
NAMES = {A: "a", B: "b", C: "c", W: "w"}
BUILD = LlamaBuild(RpcVersion(7, 0, 0), False, "test")


def member(node_id: bytes, model: str | None = None, *, state: str = READY, since: float = 1.0,
           in_flight: int = 0, members: tuple[bytes, ...] = ()) -> MemberInfo:
    served = None if model is None else ServedModel(model, state, since, in_flight, 1, 1, 1, False,
                                                    members or (node_id,))
    return MemberInfo(node_id, NAMES[node_id], (), "0.1", (), served is not None, True, BUILD, serves=served)


def catalog_of(own: MemberInfo, *others: MemberInfo) -> MeshCatalog:
    return mesh_catalog(own, others, NAMES.__getitem__)


def test_one_entry_per_model_with_its_replicas_earliest_first() -> None:
    catalog = catalog_of(member(W), member(A, "small", since=5.0), member(B, "big", since=2.0),
                         member(C, "small", since=3.0, members=(W, C)))
    assert catalog.ids() == ["big", "small"]
    small = catalog.find("small")
    assert small is not None and [r.name for r in small.replicas] == ["c", "a"]
    assert small.replicas[0].members == ((W, "w"), (C, "c"))
    # This node serves nothing: the default is the model of the node that began serving first.
    assert catalog.default == "big" and catalog.find("") is catalog.find("default") is catalog.find("big")
    assert catalog.find("big.gguf") is catalog.find("big")


def test_a_serving_node_defaults_to_its_own_model() -> None:
    catalog = catalog_of(member(A, "small", since=9.0), member(B, "big", since=1.0))
    assert catalog.default == "small"
    entry = catalog.find("")
    assert entry is not None and entry.local() is not None


def test_an_unknown_model_is_named_with_the_ones_there_are() -> None:
    catalog = catalog_of(member(W), member(A, "small"))
    assert catalog.find("gpt-4") is None
    assert "'gpt-4'" in catalog.not_found("gpt-4") and "'small'" in catalog.not_found("gpt-4")
    assert "No model is served" in catalog_of(member(W)).not_found("x")
    assert "No model is served" in catalog_of(member(W)).not_found("")


def test_a_model_is_ready_when_one_replica_is() -> None:
    catalog = catalog_of(member(W), member(A, "m", state=LOADING), member(B, "m", state=READY))
    entry = catalog.find("m")
    assert entry is not None and entry.state == READY
    assert catalog_of(member(W), member(A, "m", state=LOADING)).models[0].state == LOADING


def test_the_replica_with_the_fewest_requests_in_flight_is_chosen() -> None:
    entry = catalog_of(member(W), member(A, "m", in_flight=3), member(B, "m", in_flight=1)).models[0]
    assert choose_replica(entry, {}).node_id == B
    # What this node itself has sent counts too.
    assert choose_replica(entry, {B: 5}).node_id == A
    assert choose_replica(entry, {}, avoid=frozenset({B})).node_id == A
    assert choose_replica(entry, {}, avoid=frozenset({A, B})) is None
    # A conversation stays where it went, however loaded, while that replica is ready.
    assert choose_replica(entry, {}, sticky=A).node_id == A


def test_a_loading_replica_is_not_chosen() -> None:
    entry = catalog_of(member(W), member(A, "m", state=LOADING), member(B, "m", in_flight=9)).models[0]
    assert choose_replica(entry, {}).node_id == B


def test_a_conversation_keeps_its_key_over_its_turns() -> None:
    first = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    later = {"messages": [*first["messages"], {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "more"}]}
    other = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]}
    path = "/v1/chat/completions"
    assert conversation_key(path, first) == conversation_key(path, later) != conversation_key(path, other)
    assert conversation_key(path, "not an object") is None
    assert conversation_key("/v1/completions", {"prompt": "x" * 600}) == conversation_key(
        "/v1/completions", {"prompt": "x" * 600 + "y"})


# --- routing ---------------------------------------------------------------------------------


class FakeMesh:
    """The mesh as the router reads it: a catalog that tests change, and its change count."""

    def __init__(self, *members: MemberInfo) -> None:
        self.members = list(members)
        self.version = 0
        self.changed = asyncio.Event()

    def routes(self) -> MeshRoutes:
        async def wait_after(version: int) -> int:
            while self.version <= version:
                await self.changed.wait()
                self.changed.clear()
            return self.version

        return MeshRoutes(lambda in_flight: catalog_of(*self.members), lambda: self.version, wait_after,
                          transport=None, name_of=NAMES.__getitem__)  # type: ignore[arg-type]

    def change(self, *members: MemberInfo) -> None:
        self.members = list(members)
        self.version += 1
        self.changed.set()


def route(router: MeshRouter, requested: str, *, ours=None, forwarded: bool = False) -> Route | Refusal:
    body = json.dumps({"model": requested, "messages": [{"role": "user", "content": "hi"}]}).encode()
    return router.route(ApiRequest.parse("POST", "/v1/chat/completions", body), forwarded=forwarded, ours=ours,
                        own_in_flight=0)


def test_routes_by_model() -> None:
    mesh = FakeMesh(member(W), member(A, "small"), member(B, "big"))
    router = MeshRouter(mesh.routes(), 1.0)
    assert isinstance(found := route(router, "big"), Route) and (found.model, found.replicas) == ("big", 1)
    refused = route(router, "nope")
    assert isinstance(refused, Refusal) and (refused.status, refused.code) == (404, "model_not_found")
    # A model served only here is this node's llama-server's.
    here = MeshRouter(FakeMesh(member(A, "small"), member(B, "big")).routes(), 1.0)
    assert route(here, "", ours=lambda name: name in ("", "small")) is LOCAL
    # A tier of ours that nobody serves now goes to our proxy, which says why.
    assert route(here, "huge", ours=lambda name: name == "huge") is LOCAL


def test_a_forwarded_request_is_never_routed_on() -> None:
    router = MeshRouter(FakeMesh(member(A, "small"), member(B, "big")).routes(), 1.0)
    assert route(router, "small", ours=lambda name: name == "small", forwarded=True) is LOCAL
    refused = route(router, "big", ours=lambda name: name == "small", forwarded=True)
    assert isinstance(refused, Refusal) and refused.code == "model_unavailable"
    assert isinstance(route(router, "big", forwarded=True), Refusal)  # this node serves nothing


async def test_after_a_failure_another_replica_then_model_unavailable() -> None:
    mesh = FakeMesh(member(W), member(A, "m"), member(B, "m", in_flight=2))
    router = MeshRouter(mesh.routes(), 5.0)
    found = route(router, "m")
    assert isinstance(found, Route) and found.replicas == 2  # the proxy asks for token ids to continue
    assert await router.replica(found, None, 0) == A
    assert await router.replica(found, A, 0) == B
    with pytest.raises(ServiceUnavailableError) as gone:
        await router.replica(found, B, 0)
    assert gone.value.code == "model_unavailable" and "a, b stopped answering" in str(gone.value)


async def test_a_loading_model_is_waited_for() -> None:
    mesh = FakeMesh(member(W), member(A, "m", state=LOADING))
    router = MeshRouter(mesh.routes(), 5.0)
    found = route(router, "m")
    assert isinstance(found, Route)
    waiting = asyncio.create_task(router.replica(found, None, 0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    mesh.change(member(W), member(A, "m", state=READY))
    assert await asyncio.wait_for(waiting, 1.0) == A
    # Gone from the mesh while waited for: model_unavailable, not a wait until the timeout.
    mesh.change(member(W), member(A, "m", state=LOADING))
    waiting = asyncio.create_task(router.replica(Route("m"), None, 0))
    await asyncio.sleep(0.05)
    mesh.change(member(W))
    with pytest.raises(ServiceUnavailableError) as gone:
        await asyncio.wait_for(waiting, 1.0)
    assert gone.value.code == "model_unavailable"


async def test_a_conversation_goes_back_to_its_replica() -> None:
    mesh = FakeMesh(member(W), member(A, "m"), member(B, "m"))
    router = MeshRouter(mesh.routes(), 5.0)
    first = route(router, "m")
    assert isinstance(first, Route)
    went = await router.replica(first, None, 0)
    with router.forwarding(went):  # busy now: a new conversation would go to the other
        again = route(router, "m")
        assert isinstance(again, Route) and await router.replica(again, None, 0) == went


def test_models_list_merges_a_serving_nodes_tiers_into_the_mesh_entries() -> None:
    catalog = catalog_of(member(A, "small"), member(B, "big"))
    tiers = [TierView("small.gguf", 10, IN_SERVICE), TierView("medium.gguf", 20, FITS)]
    data = mesh_models_list(catalog, tiers, 0)["data"]
    by_id = {entry["id"]: entry for entry in data}
    assert [entry["id"] for entry in data] == ["small", "big", "medium"]
    assert by_id["small"]["state"] == IN_SERVICE and by_id["small"]["status"] == READY
    assert len(by_id["small"]["replicas"]) == 1 and "replicas" not in by_id["medium"]
    assert "state" not in by_id["big"]
