"""One node: its rpc-server, its place in the mesh, optionally llama-server and the API port.

Lifecycle (``Node.run``): start the local rpc-server, join the mesh (print the
ticket, dial the one we were given), publish the control endpoint, and on a
serving node wait for the peers asked for, then start llama-server over the
local rpc-server plus one tunnel per peer, and the API proxy; then wait for a
stop request or a child's death. Whatever happens, children are stopped by pid
before ``run`` returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .control import ControlServer
from .errors import ChildExitedError, MeshError, PortInUseError, ProcessError
from .home import NodeHome
from .identity import NodeIdentity, short_id
from .launch import ChildProcess, llama_server_argv, start_llama_server, start_rpc_server
from .llama_build import LlamaBinaries
from .mesh import Mesh, load_or_create_secret
from .ports import LOOPBACK, free_tcp_port
from .proxy import ApiProxy
from .ticket import Ticket

log = logging.getLogger(__name__)

RPC_SERVER_START_ATTEMPTS = 3
LLAMA_SERVER_RESTART_DELAY_S = 1.0


@dataclass(frozen=True)
class NodeOptions:
    """What the user asked this node to be."""

    home: NodeHome
    name: str
    model: Path
    binaries: LlamaBinaries
    serve_port: int | None = None
    join: Ticket | None = None
    quic_port: int | None = None
    min_peers: int = 0


class _StopRequested(Exception):
    """Raised inside the task group to end it on a stop request."""


class Node:
    """Runs and supervises one node's processes until told to stop."""

    def __init__(self, options: NodeOptions, identity: NodeIdentity, say: Callable[[str], None]) -> None:
        self.options = options
        self.identity = identity
        self._say = say
        self._stop = asyncio.Event()
        self._started_at = time.time()
        self.rpc_server: ChildProcess | None = None
        self.rpc_port: int | None = None
        self.llama_server: ChildProcess | None = None
        self.llama_port: int | None = None
        self._proxy: ApiProxy | None = None
        self.mesh: Mesh | None = None
        self.restarts = 0
        self._rpc_peers: list[bytes] = []  # the peers in the running llama-server's --rpc list
        self._control = ControlServer(options.home, self.status_snapshot)

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    await self._start_rpc_server()
                    tg.create_task(self._watch(self.rpc_server))
                    await self._start_mesh()
                    tg.create_task(self.mesh.run())
                    await self._control.start()
                    if self.options.join is not None:
                        await self.mesh.join(self.options.join)
                    if self.options.serve_port is not None:
                        await self._wait_for_peers()
                        await self._start_proxy()
                        await self._start_llama_server()
                        tg.create_task(self._supervise_llama_server())
                    await self._stop.wait()
                    raise _StopRequested
            except* _StopRequested:
                pass
            except* MeshError as group:
                raise group.exceptions[0] from None
        finally:
            await self._shutdown()

    async def _start_rpc_server(self) -> None:
        # The free port is picked before rpc-server binds it; if another program
        # takes it in between, rpc-server exits and we try another.
        for attempt in range(RPC_SERVER_START_ATTEMPTS):
            port = free_tcp_port()
            try:
                self.rpc_server = await start_rpc_server(self.options.binaries, port, self.options.home.logs)
            except ChildExitedError:
                if attempt + 1 == RPC_SERVER_START_ATTEMPTS:
                    raise
                continue
            self.rpc_port = port
            self._say(f"rpc-server listening on {LOOPBACK}:{port} (local only)")
            return

    async def _start_mesh(self) -> None:
        assert self.rpc_port is not None
        secret = load_or_create_secret(self.options.home, self.options.join)
        self.mesh = Mesh(self.identity, self.options.name, secret, self.rpc_port,
                         self._say, serving=self.options.serve_port is not None)
        await self.mesh.start(self.options.quic_port)
        ticket = self.mesh.ticket()
        self._say(f"Node ticket: {ticket}")
        self._say(f"On another machine, run: mesh-inference --join {ticket}")

    async def _wait_for_peers(self) -> None:
        assert self.mesh is not None
        while (missing := self.options.min_peers - len(self.mesh.connected_peers())) > 0:
            self._say(f"Waiting for {missing} more peer(s) before loading the model...")
            self.mesh.changed.clear()
            await self.mesh.changed.wait()

    def rpc_endpoints(self) -> list[str]:
        """The ``--rpc`` list for llama-server: one tunnel per peer, then our own rpc-server.

        Ours goes last because llama.cpp puts the output layer on the last
        device: the logits (vocabulary x 4 bytes per token, ~200 KB for the
        default model) then stay on loopback instead of crossing the network.
        The order is announced to the peers: REGISTER_PEER names peers by index in it.
        """
        assert self.mesh is not None
        peers = self.mesh.connected_peers()
        self._rpc_peers = peers
        self.mesh.announce_rpc_order((*peers, self.identity.node_id))
        return [*(self.mesh.tunnel_endpoint(p) for p in peers), f"{LOOPBACK}:{self.rpc_port}"]

    async def _start_proxy(self) -> None:
        assert self.options.serve_port is not None
        self._proxy = ApiProxy(self._upstream_url)
        try:
            await self._proxy.start(self.options.serve_port)
        except OSError as exc:
            raise PortInUseError(
                f"Cannot listen on port {self.options.serve_port} ({exc.strerror}). "
                "Stop the program holding it or choose another with --serve PORT."
            ) from exc

    async def _start_llama_server(self) -> None:
        endpoints = self.rpc_endpoints()
        self._say(f"Loading {self.options.model.name} through {len(endpoints)} rpc-server(s)...")
        self.llama_port = free_tcp_port()
        argv = llama_server_argv(self.options.binaries, self.options.model, endpoints, self.llama_port)
        self.llama_server = await start_llama_server(argv, self.llama_port, self.options.home.logs)
        self._say(f"OpenAI-compatible API ready on http://localhost:{self.options.serve_port}/v1")

    async def _supervise_llama_server(self) -> None:
        """Restart llama-server over the peers still connected when it dies or loses one.

        llama.cpp aborts on any RPC transport error, and an idle llama-server
        would only find out at the next request: so a lost peer in its ``--rpc``
        list is a reason to restart at once. The API port stays up (answering
        503) while llama-server comes back.
        """
        while True:
            reason = await self._llama_server_trouble()
            if self._stop.is_set():
                return
            self._say(f"{reason}; restarting llama-server with the peers still connected...")
            assert self.llama_server is not None
            await self.llama_server.stop()
            self.restarts += 1
            await asyncio.sleep(LLAMA_SERVER_RESTART_DELAY_S)
            try:
                await self._start_llama_server()
            except ProcessError as exc:
                self._say(f"llama-server failed to start again: {exc}")

    async def _llama_server_trouble(self) -> str:
        """Wait until llama-server exits or a peer in its ``--rpc`` list is lost; say which."""
        assert self.llama_server is not None and self.mesh is not None
        exited = asyncio.ensure_future(self.llama_server.wait())
        try:
            while not exited.done():
                lost = [p for p in self._rpc_peers if p not in self.mesh.connected_peers()]
                if lost:
                    return f"Peer {', '.join(short_id(p) for p in lost)} is gone"
                self.mesh.changed.clear()
                changed = asyncio.ensure_future(self.mesh.changed.wait())
                await asyncio.wait({exited, changed}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
            return str(self.llama_server.exited_error())
        finally:
            exited.cancel()

    def _upstream_url(self) -> str | None:
        if self.llama_server is None or not self.llama_server.running:
            return None
        return f"http://{LOOPBACK}:{self.llama_port}"

    async def _watch(self, child: ChildProcess | None) -> None:
        assert child is not None
        await child.wait()
        if not self._stop.is_set():
            raise child.exited_error()

    async def _shutdown(self) -> None:
        if self._proxy is not None:
            await self._proxy.close()
        if self.llama_server is not None:
            await self.llama_server.stop()
        if self.mesh is not None:
            await self.mesh.close()
        if self.rpc_server is not None:
            await self.rpc_server.stop()
        await self._control.close()

    def status_snapshot(self) -> dict[str, Any]:
        """Everything ``mesh-inference status`` shows, as JSON-ready data."""
        processes = []
        for child, port in ((self.rpc_server, self.rpc_port), (self.llama_server, self.llama_port)):
            if child is not None:
                processes.append({"name": child.name, "pid": child.pid, "running": child.running,
                                  "port": port, "log": str(child.log_path)})
        return {
            "node": {
                "id": self.identity.node_id.hex(),
                "short_id": self.identity.short_id,
                "name": self.options.name,
                "version": __version__,
                "home": str(self.options.home.root),
                "uptime_s": round(time.time() - self._started_at, 1),
            },
            "model": {"path": str(self.options.model), "bytes": self.options.model.stat().st_size},
            "api": ({"port": self.options.serve_port, "url": f"http://localhost:{self.options.serve_port}/v1"}
                    if self.options.serve_port is not None else None),
            "processes": processes,
            "llama_server_restarts": self.restarts,
            "mesh": {"quic_port": self.mesh.port if self.mesh else None},
            "peers": self.mesh.status() if self.mesh else [],
        }
