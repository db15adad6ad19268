"""The sidecar's log of what the native relay's data port refused (mesh/data_paths.py): one warning a
minute at most, whatever a stranger's flood makes the relay report."""

from __future__ import annotations

import asyncio
import logging

from mesh_sidecar.mesh import data_paths
from mesh_sidecar.mesh.data_paths import DataPaths
from mesh_sidecar.net.data_plane import control_lines as reports


class NoChecks:
    def check_for(self, node_id):
        return None

    def rejected(self, node_id, event):
        raise AssertionError("nothing is rejected here")


async def test_a_flood_of_refusals_is_one_warning_an_interval(caplog, monkeypatch):
    """One warning at once, the rest summed after the interval; a reason new in it is logged at once."""
    monkeypatch.setattr(data_paths, "REFUSED_LOG_INTERVAL_S", 0.2)
    paths = DataPaths(None, NoChecks(), lambda _: None)
    with caplog.at_level(logging.WARNING, logger=data_paths.__name__):
        for i in range(100):  # the relay's lines of 100 seconds, in a burst
            paths.on_report(reports.Refused(40, f"10.0.0.{i % 3}", (("not-allowed", 39), ("handshake-timeout", 1))))
        paths.on_report(reports.Refused(1, "127.0.0.1", (("not-a-member", 1),)))
        await asyncio.sleep(0.3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "data port: refused 40 connection(s) (not-allowed 39, handshake-timeout 1), the last from 10.0.0.0",
        "data port: refused 3961 connection(s) (not-allowed 3861, handshake-timeout 99, not-a-member 1), "
        "the last from 127.0.0.1",
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=data_paths.__name__):
        paths.on_report(reports.Refused(2, "10.0.0.5", (("not-allowed", 2),)))  # a new interval: at once
    assert [r.getMessage() for r in caplog.records] == [
        "data port: refused 2 connection(s) (not-allowed 2), the last from 10.0.0.5"]
