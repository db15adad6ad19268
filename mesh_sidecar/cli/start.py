"""Start a node from the command line's options: check them, ready the build, the model and the
weight cache (prepare.py), then run the node until Ctrl-C or SIGTERM; or, with --lan, list the meshes
nearby. main.py imports this only to run a node, so read-only commands stay quick."""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import signal
import socket
import sys
from pathlib import Path

from rich.table import Table

from ..errors import SourceUnavailableError, UsageError
from ..home import NodeHome
from ..identity import load_or_create_identity, short_id
from ..llama.build import LlamaBinaries
from ..llama.kv_cache import DEFAULT_KV_CACHE, KvCacheTypes
from ..logs import CHILD_LOG_BACKUPS, CHILD_LOG_MAX_BYTES, SIDECAR_LOG_NAME
from ..mesh.saved import SavedMesh
from ..mesh.source_fetch import fetch_source_archive
from ..net.discovery import LAN_BROWSE_S, browse_lan
from ..node.lifecycle import ApiOptions, Node, NodeOptions
from ..ports import DEFAULT_API_PORT, LOOPBACK, check_tcp_port_free
from ..serve.access import ApiAccess
from ..serve.planner import PlanBy
from ..serve.step_up import StepUpRules
from ..serve.supervisor import PlanAnnouncement, ServeOptions
from ..units import parse_size
from ..wire.ticket import decode_ticket
from .output import console
from .prepare import (
    device_names,
    draft_for,
    identify_projectors,
    prepare,
    prepare_data_relay,
    prepare_weight_cache,
    read_projectors,
    setup_progress,
)
from .views import plan_view


def start_node(*, serve: int | None, api_port: int | None, no_api: bool, model: list[Path] | None, spread: bool,
               plan_by: str, name: str | None, home: Path | None, llama_bin: Path | None, b2b: bool,
               join: str | None, port: int | None, min_peers: int, step_up_after_s: float,
               step_up_interval_s: float, max_memory: str | None, devices: str | None, threads: int | None,
               ctx_size: int, cache_type_k: str, cache_type_v: str, api_key: str | None, cors_origin: str | None,
               use_weight_cache: bool, mmproj: list[str] | None, draft_model: str | None, speculation_mode: str,
               receipt: Path | None, fetch_model: bool, data_path: str, no_mdns: bool, lan: bool,
               verbose: bool) -> None:
    """`mesh-inference` without a subcommand, with its options (main.py's ``run_node`` names them)."""
    node_home = NodeHome.resolve(home)
    if lan:
        show_lan(node_home)
        return
    ticket = decode_ticket(join) if join is not None else None
    max_memory_bytes = parse_size(max_memory) if max_memory is not None else None
    api = _api_options(serve, api_port, no_api, ApiAccess(api_key, cors_origin))
    if spread and serve is None:
        raise UsageError("--spread works on a serving node only: add --serve PORT.")
    if plan_by not in (rule.value for rule in PlanBy):
        raise UsageError(f"--plan-by takes 'speed' or 'memory', not {plan_by!r}.")
    kv_cache = KvCacheTypes(cache_type_k, cache_type_v)  # UsageError naming the allowed types
    if kv_cache != DEFAULT_KV_CACHE and serve is None:
        raise UsageError("--cache-type-k and --cache-type-v work on the serving node only: add --serve PORT.")
    if model and len(model) > 1 and serve is None:
        raise UsageError("Several --model files (model tiers) work on the serving node only: add --serve PORT, "
                         "or give a worker one --model.")
    projectors = read_projectors(mmproj or [], len(model or [None]), serving=serve is not None)
    # A worker without --model fetches no model and hashes none: the serving node sends what it holds.
    uses_model = serve is not None or bool(model)

    def ready() -> tuple[LlamaBinaries, Path | None, str, tuple[tuple[Path, str], ...]]:
        return prepare(llama_bin, model[0] if model else None, uses_model=uses_model, identify_model=uses_model,
                       b2b=b2b, more_models=model[1:] if model else ())

    try:
        binaries, model_path, sha256, more_models = ready()
    except SourceUnavailableError:
        if ticket is None:
            raise  # its message says what to do
        node_home.create()
        console.print("No llama.cpp build here, and PyPI is out of reach: taking the llama.cpp source from the "
                      "member the ticket names, to build it here.", highlight=False, soft_wrap=True)
        with setup_progress() as progress:
            asyncio.run(fetch_source_archive(ticket, load_or_create_identity(node_home.root), progress))
        binaries, model_path, sha256, more_models = ready()
    if data_path not in ("auto", "quic"):
        raise UsageError(f"--data-path takes 'auto' or 'quic', not {data_path!r}.")
    if speculation_mode not in ("auto", "off"):
        raise UsageError(f"--speculation takes 'auto' or 'off', not {speculation_mode!r}.")
    if speculation_mode == "off" and draft_model is not None:
        raise UsageError("--speculation off and --draft-model contradict each other: drop one.")
    draft_path = draft_for(model_path, draft_model, serve is not None)
    if receipt is not None and serve is None:
        raise UsageError("--receipt works on the serving node only: add --serve PORT.")
    node_home.create()
    _configure_logging(node_home, verbose)
    identity = load_or_create_identity(node_home.root)
    node_name = name or socket.gethostname()
    # Said before the weight cache is seeded, so the seeding lines belong to this node.
    console.print(f"Node {identity.short_id} ({node_name}), home {node_home.root}", highlight=False)
    cache, tool = prepare_weight_cache(node_home, model_path, sha256, _say) if use_weight_cache else (None, None)
    data_relay = prepare_data_relay(_say) if data_path == "auto" else None
    serving = None
    if serve is not None:
        assert model_path is not None  # prepare fetched or checked it: a serving node uses a model
        models = ((model_path, sha256), *more_models)
        serving = ServeOptions(models=models, projectors=identify_projectors(projectors, [p for p, _ in models]),
                               ctx_size=ctx_size, min_peers=min_peers,
                               step_up=StepUpRules(step_up_after_s, step_up_interval_s),
                               spread=spread, plan_by=PlanBy(plan_by), draft_model=draft_path,
                               receipts=receipt.expanduser().resolve() if receipt else None,
                               speculate=speculation_mode == "auto", kv_cache=kv_cache)
    options = NodeOptions(home=node_home, name=node_name, model=model_path, binaries=binaries, api=api,
                          serving=serving,
                          join=ticket, quic_port=port, max_memory_bytes=max_memory_bytes, ctx_size=ctx_size,
                          devices=device_names(devices), rpc_threads=threads,
                          model_sha256=sha256, weight_cache=cache, weight_cache_tool=tool, fetch_model=fetch_model,
                          mdns=not no_mdns, plain_progress=not console.is_terminal, data_relay=data_relay)
    asyncio.run(_run_until_signal(Node(options, identity, _say)))



def _api_options(serve: int | None, api_port: int | None, no_api: bool, access: ApiAccess) -> ApiOptions:
    """Where this node's API listens: --serve PORT and --api-port name the same port; a port the user
    chose must be free now (the default one may fall back to a free port)."""
    if serve is not None and api_port is not None and serve != api_port:
        raise UsageError(f"--serve {serve} and --api-port {api_port} both set the API's port: give one.")
    if no_api and api_port is not None:
        raise UsageError("--no-api and --api-port contradict each other: drop one.")
    # With --no-api, --serve's port stays closed: members still reach the model through the mesh.
    chosen = None if no_api else serve if serve is not None else api_port
    if chosen is not None:
        check_tcp_port_free(LOOPBACK, chosen, "the API (--serve / --api-port)")
    return ApiOptions(port=DEFAULT_API_PORT if chosen is None else chosen, enabled=not no_api,
                      port_given=chosen is not None, access=access)


def show_lan(node_home: NodeHome) -> None:
    """`mesh-inference --lan`: the meshes nearby, and how to get into one."""
    console.print(f"Looking for meshes on this LAN (mDNS, {LAN_BROWSE_S:.0f} s)...", highlight=False)
    records = asyncio.run(browse_lan())
    ours = SavedMesh.remembered_mesh_id(node_home)
    if not records:
        console.print("No mesh seen. On a member, check that it runs without --no-mdns and that the "
                      "firewalls allow mDNS (UDP 5353); or ask a member for its ticket "
                      "(`mesh-inference ticket`).", highlight=False)
        return
    table = Table(title="Meshes on this LAN")
    for column in ("mesh id", "node", "name", "addresses"):
        table.add_column(column)
    for record in records:
        mesh = record.mesh_id + (" (yours)" if record.mesh_id == ours else "")
        table.add_row(mesh, short_id(record.node_id), record.name, ", ".join(map(str, record.addresses)))
    console.print(table)
    console.print("A mesh admits only holders of its secret. Ask a member of the mesh you want for its ticket "
                  "(`mesh-inference ticket` on that machine), then run here: mesh-inference --join TICKET",
                  highlight=False)


async def _run_until_signal(node: Node) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, node.request_stop)
    await node.run()
    console.print("Stopped.")


def _configure_logging(home: NodeHome, verbose: bool) -> None:
    file_handler = logging.handlers.RotatingFileHandler(
        home.logs / SIDECAR_LOG_NAME, maxBytes=CHILD_LOG_MAX_BYTES, backupCount=CHILD_LOG_BACKUPS
    )
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    stderr_handler = logging.StreamHandler(sys.stderr)
    stderr_handler.setLevel(logging.INFO if verbose else logging.WARNING)
    stderr_handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[file_handler, stderr_handler], force=True)
    # httpx logs every request at INFO: readiness polls (20 a second while a model
    # loads) and every proxied API call would crowd out what the log is for.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _say(message: object) -> None:
    if isinstance(message, PlanAnnouncement):
        message = plan_view(message.plan_json)
    # Never wrapped: tickets and commands must stay copy-pasteable.
    console.print(message, highlight=False, soft_wrap=True)


