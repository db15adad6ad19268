"""Two native data relays told of each other as two sidecars would, in one process (the relays
themselves are their own processes): what the relay's tests and ``benchmarks.data_path`` run on.

    client --TCP--> (socket handed to) relay A ==TLS 1.3 over TCP==> relay B --TCP--> target_port
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

from mesh_sidecar.identity import generate_identity
from mesh_sidecar.net.data_plane import control_lines as reports
from mesh_sidecar.net.data_plane.process import DataRelay, bind_data_port
from mesh_sidecar.wire.rpc_outputs import HISTORY_SAMPLES, MIN_HISTORY_SAMPLES, NORM_RATIO


class RelayPair:
    """Two relays, A and B, told of each other as two sidecars would; B leads to ``target_port``.
    Their asyncio side runs on a loop thread of its own; every report A and B make is kept in order."""

    def __init__(self, binary: Path, target_port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.a_id, self.b_id = generate_identity(), generate_identity()
        self.reports: dict[str, list[reports.Report | reports.HandedBack]] = {"a": [], "b": []}
        self._changed = threading.Condition()
        guard = (HISTORY_SAMPLES, MIN_HISTORY_SAMPLES, NORM_RATIO)
        self.taken_back: list[tuple[reports.HandedBack, socket.socket]] = []  # A's tunnels it gave back
        self.a = DataRelay(binary, self.a_id, bind_data_port(None), lambda r: self._report("a", r), lambda: None,
                           guard=guard, take_back=lambda r, sock: self._report("a", r, sock))
        self.b = DataRelay(binary, self.b_id, bind_data_port(None), lambda r: self._report("b", r), lambda: None,
                           guard=guard)
        self.b.set_rpc_port(target_port)
        self.a.member(self.b_id.node_id, ("127.0.0.1",))  # where each one's relay dials from
        self.b.member(self.a_id.node_id, ("127.0.0.1",))
        self._tasks = [self.loop.create_task(self.a.run()), self.loop.create_task(self.b.run())]
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.wait_for("a", lambda r: isinstance(r, reports.Hello), "relay A started")
        self.wait_for("b", lambda r: isinstance(r, reports.Hello), "relay B started")
        # Both run and know each other (told before they started): the first probe answers.
        self.call(lambda: self.a.probe(self.b_id.node_id, "127.0.0.1", self.b.port))
        result = self.wait_for("a", lambda r: isinstance(r, reports.ProbeResult), "a probe's result")
        if not result.ok:
            raise RuntimeError(f"the relays did not answer each other's probe: {result.why}")

    def _report(self, relay: str, report: reports.Report | reports.HandedBack,
                sock: socket.socket | None = None) -> None:
        with self._changed:
            self.reports[relay].append(report)
            if sock is not None:
                self.taken_back.append((report, sock))
            self._changed.notify_all()

    def wait_for(self, relay: str, match, what: str, after: int = 0, timeout_s: float = 10.0):
        """The first report of ``relay`` (from index ``after``) that ``match``es; RuntimeError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = next((r for r in self.reports[relay][after:] if match(r)), None)
                if found is not None:
                    return found
                if not self._changed.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"not within {timeout_s} s: {what}; reports: {self.reports[relay][after:]}")

    def call(self, fn) -> None:
        """Run ``fn`` on the relays' loop (where DataRelay lives) and wait for it."""
        done = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (fn(), done.set()))
        done.wait(10)

    def tunnel(self, conn_id: int, check: bool = False) -> socket.socket:
        """A client socket whose other end relay A carries to relay B, and B to the target."""
        with socket.create_server(("127.0.0.1", 0)) as listener:
            client = socket.create_connection(listener.getsockname())
            accepted, _ = listener.accept()
        seen = len(self.reports["a"])
        self.call(lambda: self.a.tunnel(conn_id, self.b_id.node_id, "127.0.0.1", self.b.port, check, accepted))
        accepted.close()  # relay A holds its own copy
        self.wait_for("a", lambda r: isinstance(r, reports.Opened) and r.id == conn_id, "the tunnel opened", seen)
        return client

    def close(self) -> None:
        async def stop() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
