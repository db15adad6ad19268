"""One node's lifecycle: its rpc-server, its place in the mesh, its API, and on a serving node the model.

Lifecycle (``Node.run``): start the local rpc-server, join the mesh (print the
ticket, dial the one we were given), open the API (every node has one: requests
for a model another member serves are forwarded to it over the mesh), publish
the control endpoint, and on a serving node hand over to the ServingSupervisor
(plan, llama-server); then wait for a stop request or the rpc-server's death.
Whatever happens, children are stopped by pid before ``run`` returns.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import ChildExitedError, MeshError, ModelError, PlanError, PortInUseError, UsageError
from ..identity import NodeIdentity
from ..llama import weight_cache
from ..llama.announced_build import local_build
from ..llama.calibration import DeviceSpeed, SpeedRecord, calibrate_devices, measure_while_idle
from ..llama.capacity import AVAILABLE_DEVICES_HEADING, Capacity, Device, backend_of, measure, parse_device_listing
from ..llama.hub_models import hub_name_of
from ..llama.kv_cache import DEFAULT_KV_CACHE
from ..llama.launch import ChildProcess, start_rpc_server
from ..llama.layer_fetch import FetchedFor, fetch_layers
from ..llama.model_files import model_files
from ..logs import SIDECAR_LOG_NAME
from ..mesh.config import MeshConfig
from ..mesh.exclusion import LLAMA_BUILD_MISMATCH, SAME_BUILD_REMEDY
from ..mesh.runtime import Mesh
from ..mesh.saved import SavedMesh
from ..mesh.status import PeerView, mesh_json, peers_json
from ..net.api_forward import ApiServer, MeshForwardTransport
from ..net.data_plane.build import BINARY_NAME
from ..ports import LOOPBACK, free_tcp_port
from ..progress import PlainProgress, ProgressCallback, ignore_progress
from ..serve import dashboard
from ..serve.activity import RecentEvents
from ..serve.catalog import MeshCatalog, mesh_catalog
from ..serve.estimates import estimate_off_loop
from ..serve.layer_share import share_layers
from ..serve.mesh_round import plan_over_mesh
from ..serve.metrics import Metrics
from ..serve.options import ServeOptions
from ..serve.planner import Plan, PlanBy
from ..serve.proxy import ApiProxy, ProxyOptions
from ..serve.replan import Tier
from ..serve.routing import MeshRoutes
from ..serve.supervisor import ServingHost, ServingSupervisor
from ..units import format_gib
from ..wire.gossip import LlamaBuild, OfferedDevice
from ..wire.layer_share import LayersFetched
from .control import ControlServer
from .options import NodeOptions

log = logging.getLogger(__name__)

RPC_SERVER_START_ATTEMPTS = 3
SECRET_BYTES = 32  # the forwarded requests' token, and llama-server's key
MODEL_FETCH_POLL_S = 2.0
MODEL_FETCH_RETRY_S = 10.0
# After a calibration that left a device unmeasured: how long an rpc-server that aborted on it takes to be seen gone.
CALIBRATION_EXIT_GRACE_S = 0.5


class _StopRequested(Exception):
    """Raised inside the task group to end it on a stop request."""


class Node:
    """Runs and supervises one node's processes until told to stop."""

    def __init__(self, options: NodeOptions, identity: NodeIdentity, say: Callable[[Any], None]) -> None:
        self.options = options
        self.identity = identity
        self._say_out = say
        self.events = RecentEvents()
        self._stop = asyncio.Event()
        self._started_at = time.time()
        self.rpc_server: ChildProcess | None = None
        self.rpc_port: int | None = None
        self.build: LlamaBuild | None = None  # asked of our rpc-server before anyone else connects
        self._devices: tuple[Device, ...] = ()  # what our rpc-server offers, as it listed them
        # Each of them: its calibrations (llama/calibration.py), in the same order; () when not measured at all.
        self._speed_records: tuple[SpeedRecord, ...] = ()
        self.mesh: Mesh | None = None
        self.serving: ServingSupervisor | None = None
        self.metrics = Metrics(self.peer_views, lambda: self.mesh.mesh_view() if self.mesh else None)
        self.proxy: ApiProxy | None = None
        self.api_port: int | None = None  # where the API listens (None: nowhere)
        self.api_fallback_from: int | None = None  # the port asked for, when it was taken
        # Forwarded requests carry this to our API: they come from an admitted member.
        self._forward_token = secrets.token_hex(SECRET_BYTES)
        self._upstream_key = secrets.token_hex(SECRET_BYTES)  # llama-server's, known only to our proxy
        self._force = False
        self._for_good = False
        self._closing: asyncio.Task | None = None
        self._control = ControlServer(options.home, self)

    def _say(self, message: Any) -> None:
        """Every line for the user also goes to the recent events (`status --json`, the dashboard)."""
        self.events.add(time.time(), message)
        self._say_out(message)

    def _plain_progress(self) -> ProgressCallback:
        """A fresh reporter of one step's progress: plain lines with plain_progress set, else nothing."""
        if not self.options.plain_progress:
            return ignore_progress
        return PlainProgress(self._say_out, in_bytes=True)

    def leave(self) -> None:
        """`mesh-inference leave`: stop, telling the others this node leaves for good, and forget the mesh."""
        self._for_good = True
        self.request_stop()

    def request_stop(self) -> None:
        """First call: stop gracefully. A second call: stop now, without waiting for peers."""
        if self._stop.is_set():
            self._force = True
            if self._closing is not None:
                self._closing.cancel()
        self._stop.set()

    async def run(self) -> None:
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    await self._start_rpc_server()
                    tg.create_task(self._watch_rpc_server())
                    mesh = await self._start_mesh()
                    tg.create_task(self._fetch_shared_layers(mesh))  # told of every --rpc order from the start
                    tg.create_task(mesh.run())
                    if self._speed_records:
                        assert self.rpc_port is not None
                        tg.create_task(measure_while_idle(self.rpc_port, self._speed_records,
                                                          functools.partial(self._measured_again, mesh)))
                    await self._start_api(mesh)
                    await self._control.start()
                    if self.options.join is not None:
                        await mesh.join(self.options.join)
                    elif remembered := mesh.rejoin():
                        self._say(f"Rejoining the mesh: dialing {remembered} member(s) remembered from the last run "
                                  "(`mesh-inference leave` forgets them).")
                    if self.options.serving is not None:
                        self.serving = self._serving_supervisor(self.options.serving)
                        tg.create_task(self.serving.run())
                    elif self.options.fetch_model:
                        tg.create_task(self._fetch_served_model())
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
        calibrate = True
        for attempt in range(RPC_SERVER_START_ATTEMPTS):
            port = free_tcp_port()
            try:
                self.rpc_server = await start_rpc_server(self.options.binaries, port, self.options.home.logs,
                                                         weight_cache=self.options.weight_cache,
                                                         devices=self.options.devices,
                                                         threads=self.options.rpc_threads)
            except ChildExitedError as exc:
                available = parse_device_listing(str(exc), AVAILABLE_DEVICES_HEADING)
                if self.options.devices and available:
                    raise UsageError(f"--devices {','.join(self.options.devices)}: this rpc-server has no such "
                                     f"device; it has: {', '.join(d.name for d in available)}. Give some of "
                                     "those (or leave --devices out: every GPU, else the CPU).") from exc
                if attempt + 1 == RPC_SERVER_START_ATTEMPTS:
                    raise
                continue
            self.rpc_port = port
            self._devices = parse_device_listing(self.rpc_server.log_path.read_text(errors="replace"))
            self.build = await local_build(self.options.binaries, port)
            self._speed_records = ()
            if calibrate and self.build.rpc is not None:
                self._speed_records = tuple(SpeedRecord() for _ in self._devices)
                speeds = await calibrate_devices(port, len(self._devices))
                self._add_calibration(speeds)
                if None in speeds and await self._rpc_server_exited():
                    # A backend that cannot run the calibration's graph aborts rpc-server: start it again, unmeasured.
                    self._say(f"rpc-server stopped while measuring its devices' speed (its log: "
                              f"{self.rpc_server.log_path}); starting it again without measuring: the planner "
                              "takes its devices as of unknown speed.")
                    if attempt + 1 == RPC_SERVER_START_ATTEMPTS:
                        raise self.rpc_server.exited_error()
                    calibrate = False
                    continue
            self._say(f"rpc-server listening on {LOOPBACK}:{port} (local only; {self.build}); offering "
                      f"{format_gib(self.capacity().usable_bytes)} GiB")
            for device, speed in zip(self._devices, self._speeds(), strict=True):
                if speed is not None:
                    self._say(f"Measured {device.name}: {format_gib(speed.decode_bytes_per_s)} GiB/s of weights "
                              f"per token (decode), {format_gib(speed.prefill_bytes_per_s)} GiB/s per prompt token "
                              "(prefill); measured again while its rpc-server is idle, until two measurements agree")
                elif calibrate:
                    self._say(f"Could not measure {device.name}'s speed ({SIDECAR_LOG_NAME} says why): the planner "
                              "takes it as of unknown speed.")
            if self.build.rpc is None:
                self._say(f"{self.options.binaries.rpc_server} answered no RPC HELLO this release reads, so a "
                          f"serving node will leave this node out ({LLAMA_BUILD_MISMATCH}). {SAME_BUILD_REMEDY}")
            return

    def _speeds(self) -> tuple[DeviceSpeed | None, ...]:
        """Each device's speed as rated now: the best of its calibrations (None: not measured)."""
        return tuple(record.best() for record in self._speed_records) or (None,) * len(self._devices)

    def _add_calibration(self, speeds: tuple[DeviceSpeed | None, ...]) -> None:
        for record, speed in zip(self._speed_records, speeds, strict=True):
            if speed is not None:
                record.add(speed)

    def _offered_devices(self) -> tuple[OfferedDevice, ...]:
        """Our devices as gossip announces them: each one's speed as rated now, and whether it is settled."""
        records = self._speed_records or (SpeedRecord(),) * len(self._devices)
        return tuple(OfferedDevice(device.name, device.total_bytes, device.free_bytes,
                                   speed.decode_bytes_per_s if speed else 0, speed.prefill_bytes_per_s if speed else 0,
                                   record.settled())
                     for device, record, speed in zip(self._devices, records, self._speeds(), strict=True))

    def _measured_again(self, mesh: Mesh, settled_before: Sequence[bool]) -> None:
        """Our devices were calibrated again with news (measure_while_idle): announce them as rated now."""
        devices = self._offered_devices()
        log.info("devices measured again: %s", ", ".join(
            f"{d.name} {format_gib(d.decode_bytes_per_s)} GiB/s{'' if d.settled else ' (not settled)'}"
            for d in devices))
        for device, was_settled in zip(devices, settled_before, strict=True):
            if device.settled and not was_settled:
                self._say(f"{device.name}'s speed is settled: {format_gib(device.decode_bytes_per_s)} GiB/s of "
                          "weights per token (decode), two measurements agreeing")
        mesh.devices_measured(devices)

    async def _rpc_server_exited(self) -> bool:
        """Whether our rpc-server exits within CALIBRATION_EXIT_GRACE_S (it has, if it aborted)."""
        assert self.rpc_server is not None
        try:
            await asyncio.wait_for(self.rpc_server.wait(), CALIBRATION_EXIT_GRACE_S)
        except TimeoutError:
            return False
        return True

    def capacity(self) -> Capacity:
        """What this node offers the mesh now."""
        assert self.rpc_server is not None
        # llama-server counts as ours too: alone, it holds the model (a replan frees it).
        llama = self.serving.llama_server if self.serving is not None else None
        pids = [pid for pid in (self.rpc_server.pid, llama.pid if llama else None) if pid is not None]
        return measure(self._devices, pids, self.options.max_memory_bytes)

    async def _start_mesh(self) -> Mesh:
        assert self.rpc_port is not None and self.build is not None
        self.mesh = Mesh(MeshConfig(
            self.identity, self.options.name, self.options.home, self.rpc_port, self.capacity, self._say,
            saved=SavedMesh.load(self.options.home, self.options.join), build=self.build,
            serving=self.options.serving is not None, model_sha256=self.options.model_sha256,
            model_file=self.options.model if self.options.model_sha256 else None, lan=self.options.mdns,
            local_api=self._local_api, forward_token=self._forward_token, devices=self._offered_devices(),
            data_relay=self.options.data_relay))
        await self.mesh.start(self.options.quic_port)
        ticket = self.mesh.ticket()
        self._say(f"Node ticket: {ticket}")
        self._say(f"On another machine, run: mesh-inference --join {ticket}")
        return self.mesh

    async def _start_api(self, mesh: Mesh) -> None:
        """The API on every node: this node's model, and every other member's through the mesh."""
        api = self.options.api
        routes = MeshRoutes(catalog=self.catalog, version=lambda: mesh.changes.version,
                            wait_after=mesh.changes.wait_after, transport=MeshForwardTransport(mesh.open_stream),
                            name_of=mesh.name_of)
        self.proxy = ApiProxy(self.metrics, ProxyOptions(access=api.access, public=api.enabled), mesh=routes,
                              forward_token=self._forward_token)
        dashboard.add_routes(self.proxy.app, self.status_snapshot, mesh.peer_views)
        if not api.enabled and self.options.serving is None:
            return  # members' forwarded requests are told this node has no API
        port = api.port if api.enabled else free_tcp_port()
        try:
            await self.proxy.start(port)
        except OSError as exc:
            if api.port_given or not api.enabled:
                raise PortInUseError(f"Cannot listen on port {port} for the API ({exc.strerror}). Stop the "
                                     "program holding it, or choose another port with --api-port PORT.") from exc
            taken, port = port, free_tcp_port()
            await self.proxy.start(port)
            self.api_fallback_from = taken
            self._say(f"Port {taken} is taken ({exc.strerror}), so the API listens on port {port} instead "
                      "(`mesh-inference status` shows it; --api-port PORT picks one).")
        self.api_port = port
        if api.enabled:
            self._say(f"OpenAI-compatible API on {self.api_url()}: every model served in the mesh"
                      + (" (requires the API key: Authorization: Bearer KEY)" if api.access.api_key else ""))

    def _local_api(self) -> ApiServer | None:
        """The API server this node's forwarding streams hand members' requests to."""
        return self.proxy.connection_factory() if self.proxy is not None else None

    def api_url(self) -> str | None:
        """The API's address for people (None: --no-api)."""
        return f"http://localhost:{self.api_port}/v1" if self.api_port and self.options.api.enabled else None

    def catalog(self, own_in_flight: int = 0) -> MeshCatalog:
        """The models served in the mesh now, as this node sees them."""
        if self.mesh is None:
            return MeshCatalog((), None)
        return mesh_catalog(self.mesh.self_info, self.mesh.connected_members(), self.mesh.name_of, own_in_flight)

    async def _fetch_served_model(self) -> None:
        """--fetch-model: get the file the serving node loads, seed the weight cache, announce it."""
        assert self.mesh is not None
        while True:
            source = next((info for info in self.mesh.connected_members()
                           if info.serving and info.model_sha256 and info.model_sha256 != self.mesh.model_sha256),
                          None)
            if source is not None:
                try:
                    await self._take_model_from(source.node_id, source.model_sha256)
                except ModelError as exc:
                    self._say(f"Model fetch: {exc}")
                    await asyncio.sleep(MODEL_FETCH_RETRY_S)
                    continue
            await asyncio.sleep(MODEL_FETCH_POLL_S)

    async def _take_model_from(self, node_id: bytes, sha256: str) -> None:
        assert self.mesh is not None
        path = await self.mesh.fetch_model(node_id, sha256, PlainProgress(self._say, in_bytes=True))
        cache, tool = self.options.weight_cache, self.options.weight_cache_tool
        if cache is not None and tool is not None:
            await asyncio.to_thread(weight_cache.seed, cache, tool, path, sha256, self._plain_progress())
        self.mesh.holds_model(sha256, path)
        self._say(f"Now holding the served model ({path.name}): its loads here send only hashes.")

    async def _fetch_shared_layers(self, mesh: Mesh) -> None:
        """Fetch the layers a serving node shares with this node from the hub (llama/layer_fetch.py), each
        time it does, and tell it how that went."""
        cache, tool = self.options.weight_cache, self.options.weight_cache_tool
        fetched_for = FetchedFor(cache) if cache is not None else None
        if fetched_for is not None:
            mesh.layers.on_used_by = fetched_for.used_by
        while True:
            sender, share = await mesh.layers.next_share()
            if fetched_for is None or tool is None:
                report = LayersFetched(share.model_sha256, 0, 0, "it runs with --no-weight-cache")
            else:
                report = await asyncio.to_thread(fetch_layers, share, sender, fetched_for, tool,
                                                 PlainProgress(self._say, in_bytes=True))
            mesh.send_layers(sender, report)

    def _serving_supervisor(self, options: ServeOptions) -> ServingSupervisor:
        assert self.mesh is not None and self.rpc_port is not None
        assert self.proxy is not None
        return ServingSupervisor(options, ServingHost(
            identity=self.identity, name=self.options.name, mesh=self.mesh, binaries=self.options.binaries,
            rpc_port=self.rpc_port, logs=self.options.home.logs, metrics=self.metrics, proxy=self.proxy,
            api_url=self.api_url, upstream_key=self._upstream_key, own_capacity=self.capacity, say=self._say,
            before_load=functools.partial(share_layers, self.mesh, cache=self.options.weight_cache, say=self._say),
            load_progress=self._plain_progress if self.options.plain_progress else None))

    async def _watch_rpc_server(self) -> None:
        assert self.rpc_server is not None
        await self.rpc_server.wait()
        if not self._stop.is_set():
            raise self.rpc_server.exited_error()

    async def _shutdown(self) -> None:
        if self.serving is not None:
            await self.serving.close()
        if self.proxy is not None:
            await self.proxy.close()
        if self.mesh is not None:
            # Cancelled by a second Ctrl-C; then the mesh closes without waiting.
            self._closing = asyncio.ensure_future(self.mesh.close(graceful=not self._force, for_good=self._for_good))
            try:
                await self._closing
            except asyncio.CancelledError:
                await self.mesh.close(graceful=False)
        if self.rpc_server is not None:
            await self.rpc_server.stop()
        await self._control.close()

    def model_paths(self) -> list[Path]:
        """The model files this node plans for by default: a serving node's tiers, or a worker's --model."""
        if self.options.serving is not None:
            return [path for path, _ in self.options.serving.models]
        return [self.options.model] if self.options.model is not None else []

    async def plan_snapshot(self, model: Path | None, ctx_size: int | None) -> Plan:
        """A plan over the members connected now, for `mesh-inference plan` (PlanError if none fits).

        Without ``model``, for the largest of the node's --model tiers that fits; on a serving node with
        neither ``model`` nor ``ctx_size``, the plan its llama-server runs, as `status` shows it.
        """
        assert self.mesh is not None
        if (model is None and ctx_size is None and self.serving is not None
                and (running := self.serving.plan_in_service()) is not None):
            return running
        serving = self.options.serving
        paths = [model] if model is not None else self.model_paths()
        if not paths:
            raise PlanError("This node serves no model and holds none: plan for a file with `mesh-inference plan "
                            "--model FILE`, or run `mesh-inference plan` on the serving node.")
        # A worker plans with llama.cpp's default cache types: --cache-type-k/-v are the serving node's.
        kv_cache = serving.kv_cache if serving else DEFAULT_KV_CACHE
        tiers = []
        for i, path in enumerate(paths):
            estimate = await estimate_off_loop(path, ctx_size or self.options.ctx_size, kv_cache)
            if model is None and serving is not None:  # the node's own tiers: each with its projector
                estimate = serving.tier_estimate(i, estimate)
            tiers.append(Tier(path, estimate))
        # On a serving node, its own claim's place and --spread; elsewhere, as if it began serving now.
        since = self.serving.since if self.serving is not None else time.time()
        return plan_over_mesh(self.mesh, self.identity, self.options.name, self.capacity(), tiers, since=since,
                              spread=serving.spread if serving else False,
                              by=serving.plan_by if serving else PlanBy.SPEED,
                              observed=self.serving.speeds if self.serving is not None else None)

    def ticket(self) -> str:
        assert self.mesh is not None
        return self.mesh.ticket()

    def rotate_secret(self) -> str:
        """`mesh-inference ticket --rotate`: a new secret for every member; the new ticket."""
        assert self.mesh is not None
        return self.mesh.rotate_secret()

    def kick(self, which: str) -> tuple[str, str]:
        """`mesh-inference kick`: remove a member and rotate the secret; its name and the new ticket."""
        assert self.mesh is not None
        node_id = self.mesh.find_member(which)
        name = self.mesh.name_of(node_id)
        return name, self.mesh.rotate_secret(remove=(node_id,))

    def peer_views(self) -> tuple[PeerView, ...]:
        """The members this node's mesh knows of (none before it starts)."""
        return self.mesh.peer_views() if self.mesh else ()

    def status_snapshot(self) -> dict[str, Any]:
        """Everything ``mesh-inference status`` shows, as JSON-ready data."""
        children = [(self.rpc_server, self.rpc_port)]
        if self.serving is not None:
            children.append((self.serving.llama_server, self.serving.llama_port))
        processes = [{"name": child.name, "pid": child.pid, "running": child.running, "port": port,
                      "log": str(child.log_path)} for child, port in children if child is not None]
        if self.mesh is not None and (relay := self.mesh.data_paths.relay) is not None:
            # It writes no log of its own: the sidecar logs what it reports.
            processes.append({"name": BINARY_NAME, "pid": relay.pid, "running": relay.running,
                              "port": relay.port, "log": str(self.options.home.logs / SIDECAR_LOG_NAME),
                              "restarts": relay.restarts})
        # With model tiers, the one in service (or last planned).
        model = self.serving.model if self.serving is not None else self.options.model
        return {
            "node": {
                "id": self.identity.node_id.hex(),
                "short_id": self.identity.short_id,
                "name": self.options.name,
                "version": __version__,
                "llama_build": None if self.build is None else str(self.build),
                "home": str(self.options.home.root),
                "uptime_s": round(time.time() - self._started_at, 1),
                "capacity": self.capacity().__dict__ if self.rpc_server else None,
                "backend": backend_of(self._devices) if self._devices else None,
                "devices": [{"name": d.name, "description": d.description, "total_bytes": d.total_bytes,
                             "free_bytes": d.free_bytes,
                             # null: not measured (llama/calibration.py)
                             "decode_bytes_per_s": speed.decode_bytes_per_s if speed else None,
                             "prefill_bytes_per_s": speed.prefill_bytes_per_s if speed else None,
                             "speed_settled": offered.settled}
                            for d, speed, offered in zip(self._devices, self._speeds(), self._offered_devices(),
                                                         strict=True)],
            },
            "model": {"path": None if model is None else str(model),
                      "name": None if model is None else hub_name_of(model),  # hf:USER/REPO:QUANT, for one there
                      "bytes": 0 if model is None else _model_bytes(model), "ctx_size": self.options.ctx_size},
            "processes": processes,
            "serving": ({**self.serving.status(), "counters": self.metrics.summary()}
                        if self.serving else None),
            "api": {"enabled": self.options.api.enabled and self.api_port is not None, "port": self.api_port,
                    "url": self.api_url(), "requires_key": self.options.api.access.api_key is not None,
                    "fallback_from": self.api_fallback_from},
            "models": self.catalog(self.proxy.in_flight if self.proxy else 0).to_json(),
            "mesh": mesh_json(self.mesh.mesh_view()) if self.mesh else {"quic_port": None},
            "peers": peers_json(self.peer_views()),
            "events": self.events.to_json(),
        }


@functools.lru_cache(maxsize=8)
def _model_bytes(model: Path) -> int:
    """The bytes of every file of ``model`` (a split model's shards): read once, status asks often."""
    return sum(file.stat().st_size for file in model_files(model))

