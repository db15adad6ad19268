"""The /mesh dashboard: its routes and key rule, and the state it draws.

The API proxy runs on a real loopback socket with the dashboard's routes and a stand-in
snapshot (the page in a real browser is in tests/integration/test_dashboard.py).
"""

from __future__ import annotations

import httpx
import pytest

from mesh_sidecar.mesh.health import HealthState
from mesh_sidecar.mesh.membership import MemberState
from mesh_sidecar.mesh.status import PeerView, peers_json
from mesh_sidecar.ports import free_tcp_port
from mesh_sidecar.serve import dashboard
from mesh_sidecar.serve.access import ApiAccess
from mesh_sidecar.serve.activity import TICKET_PLACEHOLDER, RecentEvents
from mesh_sidecar.serve.dashboard import KEYLESS_PATHS, PAGE_PATH, STATE_PATH
from mesh_sidecar.serve.metrics import Metrics
from mesh_sidecar.serve.proxy import ApiProxy, ProxyOptions
from mesh_sidecar.wire.gossip import OfferedDevice

KEY = "dash-key-0123456789"
TICKET = "meshinfabcdefghijklmnopqrstuvwxyz234567"
SERVER_ID, WORKER_ID = "aa" * 32, "bb" * 32


WORKER = PeerView(node_id=bytes.fromhex(WORKER_ID), name="worker", state=MemberState.CONNECTED,
                  address="127.0.0.1:47471", path="direct", via=None, data_path="quic", data_port=0,
                  health=HealthState.CONNECTED,
                  rtt_last_s=0.0008, rtt_p50_s=0.0007, rtt_p95_s=0.0012, quic_rtt_s=0.001, datagram_bytes=1452,
                  missed_heartbeats=0, tunnel_port=40000,
                  rpc_server_up=True, serving=False, capacity={"usable_bytes": 2_000_000_000},
                  devices=(OfferedDevice("Vulkan0", 2 << 30, 2 << 30),), model_sha256="",
                  secret_epoch=0, excluded=None, learned_via=None)


def a_snapshot(events: RecentEvents) -> dict:
    """A serving node's ``status_snapshot()`` with one peer, in the shape node/lifecycle.py builds it."""
    return {
        "node": {"id": SERVER_ID, "short_id": "aaaaaaaa", "name": "server", "version": "0.1.0",
                 "home": "/home/someone/.local/share/mesh-inference", "uptime_s": 12.5,
                 "capacity": {"usable_bytes": 3_000_000_000, "free_ram_bytes": 3_500_000_000,
                              "device_free_bytes": 0, "max_memory_bytes": 0}},
        "model": {"path": "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "bytes": 1, "ctx_size": 4096},
        "processes": [{"name": "rpc-server", "pid": 123, "running": True, "port": 5000, "log": "/x.log"}],
        "serving": {
            "api": {"port": 8080, "url": "http://localhost:8080/v1", "requires_key": True},
            "plan": {"nodes": [
                {"id": WORKER_ID, "name": "worker", "layers": [0, 14], "weights_bytes": 1, "kv_bytes": 1,
                 "output_bytes": 0, "needed_bytes": 2, "free_bytes": 2_000_000_000},
                {"id": SERVER_ID, "name": "server", "layers": [14, 30], "weights_bytes": 1, "kv_bytes": 1,
                 "output_bytes": 1, "needed_bytes": 3, "free_bytes": 3_000_000_000}],
                "left_out": [], "refused": [], "n_layers": 30, "tensor_split": [14, 17]},
            "refusal": None, "speculation": None, "llama_server_restarts": 0,
            "live": {"tokens_per_second_now": 21.5, "last_request_tokens_per_second": 19.0},
            "counters": {"requests": 3, "failovers": 0, "retries": 0, "restarts": 0},
        },
        "mesh": {"quic_port": 47470, "secret_epoch": 0, "removed": [], "ignored_datagrams": 0, "model_sha256": None},
        "models": [{"id": "SmolLM2-135M-Instruct.Q4_1", "state": "ready", "default": True, "replicas": [
            {"node": {"id": SERVER_ID, "name": "server"}, "local": True, "state": "ready", "in_flight": 2,
             "members": [{"id": WORKER_ID, "name": "worker"}, {"id": SERVER_ID, "name": "server"}],
             "a_field_added_later": "/models/secret-path"}]}],
        "peers": peers_json([WORKER]),
        "events": events.to_json(),
    }


@pytest.fixture
async def keyed_dashboard():
    events = RecentEvents()
    events.add(1_700_000_000.0, f"Node ticket: {TICKET}")
    events.add(1_700_000_001.0, "Connected to peer worker (bbbbbbbb)")
    proxy = ApiProxy(Metrics(lambda: [WORKER]), ProxyOptions(access=ApiAccess(api_key=KEY)))
    dashboard.add_routes(proxy.app, lambda: a_snapshot(events), lambda: [WORKER])
    port = free_tcp_port()
    await proxy.start(port)
    yield f"http://127.0.0.1:{port}"
    await proxy.close()


async def test_the_page_and_its_files_are_keyless_and_the_state_wants_the_key(keyed_dashboard):
    async with httpx.AsyncClient(base_url=keyed_dashboard) as client:
        page = await client.get(PAGE_PATH)
        assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["Content-Security-Policy"]
        for path in sorted(KEYLESS_PATHS - {PAGE_PATH}):
            assert path in page.text  # the page loads each file it is allowed to
            asset = await client.get(path)
            assert asset.status_code == 200 and asset.content, path
        assert (await client.get(f"{PAGE_PATH}/dashboard.js")).headers["Content-Type"].startswith("text/javascript")
        assert (await client.get(f"{PAGE_PATH}/dashboard.css")).headers["Content-Type"].startswith("text/css")

        assert (await client.get(STATE_PATH)).status_code == 401
        assert (await client.get(STATE_PATH, headers={"Authorization": "Bearer wrong"})).status_code == 401
        # Only the named files are keyless, not whatever sits under /mesh.
        assert (await client.get(f"{PAGE_PATH}/index.html")).status_code == 401
        state = await client.get(STATE_PATH, headers={"Authorization": f"Bearer {KEY}"})
        assert state.status_code == 200 and state.headers["Cache-Control"] == "no-store"


async def test_the_state_has_members_plan_live_figures_and_events_but_no_secrets(keyed_dashboard):
    async with httpx.AsyncClient() as client:
        response = await client.get(keyed_dashboard + STATE_PATH, headers={"Authorization": f"Bearer {KEY}"})
    state = response.json()
    assert state["node"]["name"] == "server"
    assert state["model"] == {"name": "SmolLM2-135M-Instruct.Q4_1.gguf", "ctx_size": 4096}
    assert [(m["name"], m["state"], m["capacity_bytes"], m["serving"]) for m in state["members"]] == [
        ("server", "self", 3_000_000_000, True), ("worker", "connected", 2_000_000_000, False)]
    assert state["members"][1]["rtt_ms"] == 0.8 and state["members"][1]["address"] == "127.0.0.1:47471"
    assert state["members"][1]["rtt_p50_ms"] == 0.7 and state["members"][1]["health"] == "connected"
    assert state["members"][1]["devices"] == "Vulkan0 2.0 of 2.0 GiB free"  # as the worker's gossip says
    assert state["plan"]["n_layers"] == 30
    assert [(s["name"], s["start"], s["end"], s["output"]) for s in state["plan"]["segments"]] == [
        ("worker", 0, 14, False), ("server", 14, 30, True)]
    assert state["live"] == {"tokens_per_second_now": 21.5, "last_request_tokens_per_second": 19.0}
    assert state["counters"]["requests"] == 3
    assert state["models"] == [{"id": "SmolLM2-135M-Instruct.Q4_1", "state": "ready", "default": True,
                                "vision": False, "replicas": [
        {"node": {"id": SERVER_ID, "name": "server"}, "local": True, "state": "ready", "in_flight": 2,
         "members": [{"id": WORKER_ID, "name": "worker"}, {"id": SERVER_ID, "name": "server"}]}]}]
    assert [e["message"] for e in state["events"]] == [
        f"Node ticket: {TICKET_PLACEHOLDER}", "Connected to peer worker (bbbbbbbb)"]
    for secret_or_path in (TICKET, "/home/someone", "/x.log", "/models/"):
        assert secret_or_path not in response.text


def test_the_state_has_no_models_list_for_a_node_that_knows_none():
    """An older node's status has no "models"; a mesh serving nothing has an empty one: both draw as none."""
    snapshot = a_snapshot(RecentEvents())
    for models in (None, []):
        snapshot["models"] = models
        assert dashboard.state_from(snapshot, [WORKER])["models"] == []
    del snapshot["models"]
    assert dashboard.state_from(snapshot, [WORKER])["models"] == []
