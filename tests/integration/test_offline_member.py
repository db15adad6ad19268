"""A member that uses no model file fetches none: a worker whose package index is unreachable (an
offline lab, a machine behind a proxy) joins, offers its memory and holds layers (real processes).

The worker gets a cache of its own holding this machine's builds but no model, and pip an index
that nothing answers: fetching the default model there would fail the start.
"""

from __future__ import annotations

import pytest

from mesh_sidecar import environment
from mesh_sidecar.home import cache_root
from mesh_sidecar.llama.model import default_model_path
from tests.helpers.llama import complete
from tests.helpers.nodes import TICKET_LINE
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"  # the discard port: nothing listens


def test_a_worker_without_package_access_joins_and_holds_layers(start_node, tmp_path, reference_text):
    shared = cache_root()
    offline_cache = tmp_path / "offline-cache"
    offline_cache.mkdir()
    for entry in shared.iterdir():  # the builds and tools, not the models
        if entry != default_model_path().parent:
            (offline_cache / entry.name).symlink_to(entry)
    offline = {environment.CACHE_ENV: str(offline_cache), "PIP_INDEX_URL": UNREACHABLE_INDEX,
               "PIP_CONFIG_FILE": "/dev/null", "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}

    server = start_node("server", "--min-peers", "1", serve=True, wait=False)
    ticket = wait_until(lambda: TICKET_LINE.search(server.text()), 60, "the server's ticket").group(1)
    worker = start_node("worker", "--join", ticket, env=offline)
    server.wait_ready()
    plan = wait_until(lambda: server.status()["serving"]["plan"], 90, "a plan")
    held = {n["name"]: n["layers"][1] - n["layers"][0] for n in plan["nodes"]}
    assert held.get("worker", 0) > 0, held
    assert complete(server.serve_port) == reference_text

    status = worker.status()
    assert status["model"]["path"] is None and status["node"]["capacity"]["usable_bytes"] > 0
    assert "Downloading" not in worker.text()
    assert not (offline_cache / default_model_path().parent.name).exists()
