"""Start a node from the command line's options: checked and assembled by node/options.py, the build,
the model and the weight cache readied (prepare.py), then the node run until Ctrl-C or SIGTERM; or, with
--lan, the meshes nearby listed. main.py imports this only to run a node, so read-only commands stay quick."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import logging.handlers
import signal
import socket
import sys
from typing import Any

from rich.table import Table

from ..errors import SourceUnavailableError
from ..home import NodeHome
from ..identity import load_or_create_identity, short_id
from ..logs import CHILD_LOG_BACKUPS, CHILD_LOG_MAX_BYTES, SIDECAR_LOG_NAME
from ..mesh.saved import SavedMesh
from ..mesh.source_fetch import fetch_source_archive
from ..net.discovery import LAN_BROWSE_S, browse_lan
from ..node.lifecycle import Node
from ..node.options import NodeArgs, Readied, check, hub_projectors, node_options
from ..serve.plan_start import PlanAnnouncement
from .output import console
from .prepare import draft_for, identify_projectors, prepare, prepare_data_relay, prepare_weight_cache, setup_progress
from .views import plan_view


def start_node(**typed: Any) -> None:
    """`mesh-inference` without a subcommand, with its options as typed (main.py's ``run_node`` names them)."""
    args = NodeArgs(**typed)
    node_home = NodeHome.resolve(args.home)
    if args.lan:
        show_lan(node_home)
        return
    checked = check(args)
    try:
        readied = _ready(args)
    except SourceUnavailableError:
        if checked.ticket is None:
            raise  # its message says what to do
        node_home.create()
        console.print("No llama.cpp build here, and PyPI is out of reach: taking the llama.cpp source from the "
                      "member the ticket names, to build it here.", highlight=False, soft_wrap=True)
        with setup_progress() as progress:
            asyncio.run(fetch_source_archive(checked.ticket, load_or_create_identity(node_home.root), progress))
        readied = _ready(args)
    model_path, sha256 = readied.models[0] if readied.models else (None, "")
    draft_path = draft_for(model_path, args.draft_model)
    node_home.create()
    _configure_logging(node_home, args.verbose)
    identity = load_or_create_identity(node_home.root)
    node_name = args.name or socket.gethostname()
    # Said before the weight cache is seeded, so the seeding lines belong to this node.
    console.print(f"Node {identity.short_id} ({node_name}), home {node_home.root}", highlight=False)
    cache, tool = prepare_weight_cache(node_home, model_path, sha256, _say) if args.use_weight_cache else (None, None)
    readied = dataclasses.replace(
        readied, draft_model=draft_path, weight_cache=cache, weight_cache_tool=tool,
        data_relay=prepare_data_relay(_say) if args.data_path == "auto" else None)
    if args.serving:
        projectors = checked.projectors or hub_projectors(readied.hub_projectors)
        readied = dataclasses.replace(readied, projectors=identify_projectors(projectors,
                                                                              [p for p, _ in readied.models]))
    options = node_options(checked, node_home, node_name, readied, plain_progress=not console.is_terminal)
    asyncio.run(_run_until_signal(Node(options, identity, _say)))


def _ready(args: NodeArgs) -> Readied:
    """The build and the models (prepare.py): the node's model, its sha256 when it uses one, the other tiers'.
    A serving node given no --mmproj takes each hub repo's projector (a vision model's)."""
    prepared = prepare(args.llama_bin, args.model[0] if args.model else None, uses_model=args.uses_model,
                       identify_model=args.uses_model, b2b=args.b2b, more_models=args.model[1:] if args.model else (),
                       hub_projectors=args.serving and not args.mmproj)
    return Readied(prepared.binaries, prepared.models, hub_projectors=prepared.hub_projectors)


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


