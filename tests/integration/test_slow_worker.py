"""A worker whose rpc-server answers every RPC late: left out as slow within seconds, and the stream goes on."""

from __future__ import annotations

import time

import pytest

from mesh_sidecar.mesh.exclusion import SLOW
from tests.helpers.nodes import metrics
from tests.helpers.waiting import wait_until
from tests.integration.test_failover import LONG, Received, assert_goes_on_exactly, receive

REPLY_DELAY_S = 4.0  # far past a token's time (tens of ms) and past pace.py's STALL_FLOOR_S


@pytest.mark.slow
def test_a_worker_answering_late_is_left_out_and_the_stream_continues(start_node, faulty_rpc_build):
    directory, trigger = faulty_rpc_build("--delay-s", str(REPLY_DELAY_S))
    a = start_node("a")
    b = start_node("b", "--join", a.ticket(), "--llama-bin", str(directory))
    c = start_node("c", "--join", a.ticket(), "--min-peers", "2", serve=True)
    assert {n["name"] for n in c.status()["serving"]["plan"]["nodes"]} == {"a", "b", "c"}
    # Undisturbed, it also tells the proxy how long a token takes.
    undisturbed = receive(c.serve_port, "/v1/completions", {**LONG, "logprobs": 1})
    armed_at: list[float] = []

    def arm_once_started(received: Received) -> None:
        if not armed_at and len(received.text()) > 100:
            armed_at.append(time.monotonic())
            trigger.touch()  # from now on b's rpc-server answers every command REPLY_DELAY_S late

    survived = receive(c.serve_port, "/v1/completions", LONG, arm_once_started)
    seam = survived.seam()
    assert survived.text(seam) == undisturbed.text(seam)
    assert_goes_on_exactly(c, "/v1/completions", LONG, survived, undisturbed.token_ids(seam))
    assert survived.events[-1]["choices"][0]["finish_reason"] == "length"
    print(f"\nreplies {REPLY_DELAY_S:.0f} s late -> next token on the plan without b: "
          f"{survived.at_s[seam] - armed_at[0]:.1f} s")

    samples = metrics(c.serve_port)
    assert samples["mesh_slow_workers_total{}"] == 1
    assert samples["mesh_streams_resumed_total{how=continued}"] == 1
    status = c.status()
    assert {n["name"] for n in status["serving"]["plan"]["nodes"]} == {"a", "c"}
    peers = {p["name"]: p for p in status["peers"]}
    assert peers["b"]["refused"] == SLOW and peers["a"]["refused"] is None
    assert "for the replies of b's rpc-server" in peers["b"]["refused_detail"]
    # Judged against the token's time, not by the 60 s stall timer.
    assert "b is holding tokens up" in c.text() and "No progress" not in c.text()

    line = wait_until(lambda: next((line for line in b.text().splitlines() if line.startswith(f"{SLOW}:")), None),
                      30, "b says it is left out")
    assert "c waited" in line and "when mesh-inference restarts there" in line
