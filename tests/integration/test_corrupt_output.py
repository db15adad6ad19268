"""A worker whose rpc-server returns NaNs: left out as corrupt_output, and the client's answer is unchanged."""

from __future__ import annotations

import json

import pytest

from mesh_sidecar.mesh.exclusion import CORRUPT_OUTPUT
from tests.helpers.llama import complete
from tests.helpers.nodes import cli, metrics
from tests.helpers.waiting import wait_until


@pytest.mark.slow
def test_a_worker_returning_nans_is_left_out_and_the_answer_is_unchanged(start_node, faulty_rpc_build,
                                                                         reference_text):
    directory, trigger = faulty_rpc_build()
    a = start_node("a")
    b = start_node("b", "--join", a.ticket(), "--llama-bin", str(directory))
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", serve=True)
    assert {n["name"] for n in c.status()["serving"]["plan"]["nodes"]} == {"a", "b", "c"}
    # Answered once undisturbed: the model is loaded and warmed up over b before b goes bad (a node's API
    # answers /health before its first load ends, and a NaN in the warm-up is a failed start, not a retry).
    assert complete(c.serve_port) == reference_text
    assert metrics(c.serve_port)["mesh_corrupt_outputs_total{}"] == 0

    trigger.touch()  # from now on b's layer outputs come back as NaN
    assert complete(c.serve_port) == reference_text  # retried over a and c

    samples = metrics(c.serve_port)
    assert samples["mesh_corrupt_outputs_total{}"] >= 1 and samples["mesh_retries_total{}"] >= 1
    status = c.status()
    assert {n["name"] for n in status["serving"]["plan"]["nodes"]} == {"a", "c"}
    peers = {p["name"]: p for p in status["peers"]}
    assert peers["b"]["refused"] == CORRUPT_OUTPUT and peers["a"]["refused"] is None
    assert "NaN or Inf" in peers["b"]["refused_detail"]
    planned = cli("plan", "--home", str(c.home), "--json")
    assert planned.returncode == 0, planned.stderr
    refused = json.loads(planned.stdout)["refused"]
    assert [(r["name"], r["reason"]) for r in refused] == [("b", CORRUPT_OUTPUT)]
    assert "b returned a corrupt layer output" in c.text()

    # b's own output and status say why.
    line = wait_until(lambda: next((line for line in b.text().splitlines() if line.startswith(CORRUPT_OUTPUT)), None),
                      30, "b says it is left out")
    assert "c found NaN or Inf values in the layer outputs b's rpc-server returned" in line
    assert "restart mesh-inference there" in line
    row = next(p for p in b.status()["peers"] if p["name"] == "c")
    assert row["refused"] == CORRUPT_OUTPUT

    # Restarted (with sound hardware), b is given layers again.
    trigger.unlink()
    b.stop()
    b.restart()
    wait_until(lambda: {n["name"] for n in (c.status()["serving"]["plan"] or {"nodes": []})["nodes"]}
               == {"a", "b", "c"}, 180, "b is in the plan again")
    assert complete(c.serve_port) == reference_text
