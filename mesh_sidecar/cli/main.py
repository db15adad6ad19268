"""The ``mesh-inference`` command line: run a node, set up, show status.

Every error a person can cause ends here as one clear message and a non-zero
exit, never a traceback: every command runs through ``_MeshCommands.invoke``,
the one place that turns a ``MeshError`` into its message on stderr and exit
status 1. Usage errors that typer finds itself (a missing argument, a bad
number) keep typer's own message and status 2.
"""

from __future__ import annotations

import asyncio
import json
import logging
import logging.handlers
import signal
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from .. import environment
from ..errors import MeshError, ReceiptError, UsageError
from ..home import DEFAULT_HOME, NodeHome
from ..identity import load_or_create_identity, short_id
from ..llama import weight_cache
from ..llama.build import B2B, STOCK, ensure_binaries
from ..llama.model import check_gguf, ensure_model, model_sha256
from ..llama.weight_cache import WeightCache
from ..logs import CHILD_LOG_BACKUPS, CHILD_LOG_MAX_BYTES, SIDECAR_LOG_NAME, log_files, tail
from ..logs import follow as follow_logs
from ..mesh.runtime import DEFAULT_QUIC_PORT
from ..mesh.saved import MESH_FILE_NAME, SavedMesh
from ..net.discovery import LAN_BROWSE_S, browse_lan
from ..node import control
from ..node.control import read_plan, read_status
from ..node.lifecycle import DEFAULT_CTX_SIZE, Node, NodeOptions
from ..ports import LOOPBACK, check_tcp_port_free
from ..progress import PlainProgress, ProgressCallback
from ..serve import receipt as receipts
from ..serve import speculation
from ..serve.access import ApiAccess
from ..serve.supervisor import PlanAnnouncement, ServeOptions
from ..serve.tiers import STEP_UP_AFTER_S, STEP_UP_INTERVAL_S, StepUpRules
from ..units import MIB, format_gib, parse_size
from ..wire.ticket import decode_ticket
from .views import plan_table

STATUS_WATCH_INTERVAL_S = 1.0
MESH_ERROR_EXIT_STATUS = 1

console = Console()
err_console = Console(stderr=True)


class _MeshCommands(TyperGroup):
    """The command group every command runs through: a ``MeshError`` becomes its message and exit status."""

    # The base Context's module depends on typer's version (click's, later typer's own copy): any of them.
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except MeshError as exc:
            # Escaped: a message may hold brackets ("[fd00::2]:47470") that rich would take for markup.
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(MESH_ERROR_EXIT_STATUS) from None


app = typer.Typer(
    cls=_MeshCommands,
    add_completion=False,
    no_args_is_help=False,
    help="Run one GGUF model across several machines: llama.cpp RPC over an authenticated QUIC mesh.",
)

HomeOption = Annotated[
    Path | None, typer.Option("--home", help=f"This node's state directory (default: {environment.HOME_ENV}, "
                                                f"else {DEFAULT_HOME}).")
]
CtxOption = Annotated[int, typer.Option("--ctx-size", min=256, help="Context length llama-server gets (tokens).")]
B2bOption = Annotated[bool, typer.Option(
    "--b2b", help="Use the b2b build of llama.cpp (patches/README.md): workers pass activations straight to "
                  "each other. Give it to every node; a node without it still works with the others.")]
LlamaBinOption = Annotated[
    Path | None,
    typer.Option("--llama-bin", help="Directory with your own ggml-rpc-server and llama-server (e.g. a CUDA "
                                     f"build); default: {environment.LLAMA_BIN_ENV}, else the pinned build."),
]


class _LazyProgress:
    """One live bar for the setup steps' (message, done, total) reports, on a terminal.

    Shown only once a step reports: when everything is cached, nothing is printed.
    """

    def __init__(self) -> None:
        self._bar: tuple[Progress, TaskID] | None = None  # made at the first report

    def __call__(self, message: str, done: int, total: int) -> None:
        if self._bar is None:
            progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                console=err_console, transient=True)
            progress.start()
            self._bar = progress, progress.add_task("", total=None)
        progress, task = self._bar
        progress.update(task, description=message, completed=done, total=total or None)

    def close(self) -> None:
        if self._bar is not None:
            self._bar[0].stop()


@contextmanager
def _setup_progress() -> Iterator[ProgressCallback]:
    """Where the setup steps report: a live bar on a terminal, else plain lines (CI logs, `| tee`)."""
    if not err_console.is_terminal:
        yield PlainProgress(lambda line: err_console.print(line, highlight=False, markup=False, soft_wrap=True))
        return
    bar = _LazyProgress()
    try:
        yield bar
    finally:
        bar.close()


def _prepare(llama_bin: Path | None, model: Path | None, *, identify_model: bool = False, b2b: bool = False,
             more_models: Sequence[Path] = ()):
    """Binaries, model and (if asked) the model's sha256, with a progress bar when slow; and
    ``more_models`` (the other tiers) as (path, sha256) pairs.

    Models the user named are checked first: a typo should not wait for a build.
    """
    if model is not None:
        check_gguf(model)
    more = [check_gguf(path) for path in more_models]
    with _setup_progress() as progress:
        binaries = ensure_binaries(llama_bin, progress, B2B if b2b else STOCK)
        model_path = ensure_model(model, progress)
        sha256 = model_sha256(model_path, progress) if identify_model else ""
        return binaries, model_path, sha256, tuple((path, model_sha256(path, progress)) for path in more)


def _draft_for(model: Path, draft: str | None, serving: bool) -> Path | None:
    """The draft model --draft-model names (checked against the model's tokenizer), or None."""
    if draft is None:
        return None
    if not serving:
        raise UsageError("--draft-model works on the serving node only: add --serve PORT.")
    path = speculation.find_draft(model) if draft == speculation.AUTO else check_gguf(Path(draft))
    speculation.check_pair(model, path)
    return path


def _prepare_weight_cache(home: NodeHome, model: Path, sha256: str) -> tuple[WeightCache, Path]:
    """This node's rpc-server weight cache (checked, seeded from the model file it holds) and its helper."""
    cache = WeightCache.in_home(home.root)
    with _setup_progress() as progress:
        tool = weight_cache.ensure_tool(progress)
        removed = weight_cache.verify(cache, tool, progress)
        if removed:
            _say(f"Removed {removed} damaged file(s) from the weight cache; their tensors will be sent again.")
        if sha256:
            weight_cache.seed(cache, tool, model, sha256, progress)
    return cache, tool


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
        message = plan_table(message.plan_json)
    # Never wrapped: tickets and commands must stay copy-pasteable.
    console.print(message, highlight=False, soft_wrap=True)


@app.callback(invoke_without_command=True)
def run_node(
    ctx: typer.Context,
    serve: Annotated[int | None, typer.Option("--serve", help="Serve the OpenAI-compatible API on this port.")] = None,
    model: Annotated[list[Path] | None, typer.Option(
        "--model", help="GGUF model file (default: SmolLM2-135M-Instruct). With --serve, give it several times for "
                        "model tiers: the node serves the largest that the mesh can hold now.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="A name for this node (default: the host name).")] = None,
    home: HomeOption = None,
    llama_bin: LlamaBinOption = None,
    b2b: B2bOption = False,
    join: Annotated[str | None, typer.Option(
        "--join", help="Join the mesh of the node that printed this ticket.")] = None,
    port: Annotated[int | None, typer.Option(
        "--port", help=f"UDP port for the mesh (default {DEFAULT_QUIC_PORT}, or a free one).")] = None,
    min_peers: Annotated[int, typer.Option(
        "--min-peers", help="With --serve: wait for this many peers before loading the model.")] = 0,
    step_up_after_s: Annotated[float, typer.Option(
        "--step-up-after-s", min=0,
        help="With several --model: switch to a bigger tier only once it has fitted the mesh this many seconds "
             "without a break (smaller ones are switched to at once).")] = STEP_UP_AFTER_S,
    step_up_interval_s: Annotated[float, typer.Option(
        "--step-up-interval-s", min=0,
        help="With several --model: at least this many seconds between a model switch and a step up.",
    )] = STEP_UP_INTERVAL_S,
    max_memory: Annotated[str | None, typer.Option(
        "--max-memory", help="Offer at most this much memory to the mesh, e.g. 4G (G means GiB).")] = None,
    ctx_size: CtxOption = DEFAULT_CTX_SIZE,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=environment.API_KEY_ENV, show_default=False,
        help=f"With --serve: clients must send 'Authorization: Bearer KEY'. Prefer the {environment.API_KEY_ENV} "
             "variable: a command-line argument is visible to every local user in ps.")] = None,
    cors_origin: Annotated[str | None, typer.Option(
        "--cors-origin", help="With --serve: let web pages from this origin call the API "
                              "(e.g. https://chat.example.org). Default: no CORS headers.")] = None,
    use_weight_cache: Annotated[bool, typer.Option(
        "--weight-cache/--no-weight-cache",
        help="Keep a cache of received weights (and seed it from --model) so loads send only hashes; "
             "costs disk space about the size of the model.")] = True,
    draft_model: Annotated[str | None, typer.Option(
        "--draft-model", help="With --serve: a small GGUF with the same tokenizer that drafts tokens on this "
                              "node's CPU for speculative decoding; 'auto' picks the smallest cached one.")] = None,
    speculation_mode: Annotated[str, typer.Option(
        "--speculation", help="With --serve: 'auto' (a draft model if given, else n-gram lookup on slow "
                              "links) or 'off' (plain decoding).")] = "auto",
    receipt: Annotated[Path | None, typer.Option(
        "--receipt", help="With --serve: write a signed receipt (plan, model hashes, RTTs, speeds, output hash) "
                          "for every request into this directory; check one with `mesh-inference verify`.")] = None,
    fetch_model: Annotated[bool, typer.Option(
        "--fetch-model", help="Without --serve: fetch the serving node's model file over the mesh (resumable, "
                              "sha256-checked) so later loads send only hashes.")] = False,
    no_mdns: Annotated[bool, typer.Option(
        "--no-mdns", help="Neither advertise this node on the LAN (mDNS) nor look for members there.")] = False,
    lan: Annotated[bool, typer.Option(
        "--lan", help="Only list the meshes seen on this LAN (mDNS) for a few seconds, then exit.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print the sidecar's log here too.")] = False,
) -> None:
    """Start a node (no subcommand). With --serve PORT it also serves the API."""
    if ctx.invoked_subcommand is not None:
        return
    node_home = NodeHome.resolve(home)
    if lan:
        _show_lan(node_home)
        return
    ticket = decode_ticket(join) if join is not None else None
    max_memory_bytes = parse_size(max_memory) if max_memory is not None else None
    api_access = ApiAccess(api_key, cors_origin)
    if serve is not None:
        check_tcp_port_free(LOOPBACK, serve, "the API (--serve)")
    if model and len(model) > 1 and serve is None:
        raise UsageError("Several --model files (model tiers) work on the serving node only: add --serve PORT, "
                         "or give a worker one --model.")
    binaries, model_path, sha256, more_models = _prepare(
        llama_bin, model[0] if model else None, identify_model=serve is not None or bool(model), b2b=b2b,
        more_models=model[1:] if model else ())
    if speculation_mode not in ("auto", "off"):
        raise UsageError(f"--speculation takes 'auto' or 'off', not {speculation_mode!r}.")
    if speculation_mode == "off" and draft_model is not None:
        raise UsageError("--speculation off and --draft-model contradict each other: drop one.")
    draft_path = _draft_for(model_path, draft_model, serve is not None)
    if receipt is not None and serve is None:
        raise UsageError("--receipt works on the serving node only: add --serve PORT.")
    node_home.create()
    _configure_logging(node_home, verbose)
    identity = load_or_create_identity(node_home.root)
    node_name = name or socket.gethostname()
    # Said before the weight cache is seeded, so the seeding lines belong to this node.
    console.print(f"Node {identity.short_id} ({node_name}), home {node_home.root}", highlight=False)
    cache, tool = _prepare_weight_cache(node_home, model_path, sha256) if use_weight_cache else (None, None)
    serving = ServeOptions(port=serve, models=((model_path, sha256), *more_models), ctx_size=ctx_size,
                           min_peers=min_peers, step_up=StepUpRules(step_up_after_s, step_up_interval_s),
                           access=api_access, draft_model=draft_path,
                           receipts=receipt.expanduser().resolve() if receipt else None,
                           speculate=speculation_mode == "auto") if serve is not None else None
    options = NodeOptions(home=node_home, name=node_name, model=model_path, binaries=binaries, serving=serving,
                          join=ticket, quic_port=port, max_memory_bytes=max_memory_bytes, ctx_size=ctx_size,
                          model_sha256=sha256, weight_cache=cache, weight_cache_tool=tool, fetch_model=fetch_model,
                          mdns=not no_mdns, plain_progress=not console.is_terminal)
    asyncio.run(_run_until_signal(Node(options, identity, _say)))


def _show_lan(node_home: NodeHome) -> None:
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


@app.command()
def setup(
    llama_bin: LlamaBinOption = None,
    model: Annotated[Path | None, typer.Option(
        "--model", help="Check this GGUF instead of fetching the default.")] = None,
    b2b: B2bOption = False,
) -> None:
    """Build the pinned llama.cpp (once) and fetch the default model. Prints the binaries' directory last."""
    binaries, model_path, _, _ = _prepare(llama_bin, model, b2b=b2b)
    console.print(f"model: {model_path}", highlight=False)
    print(binaries.directory)


@app.command()
def status(
    home: HomeOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object, for scripts.")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh every second until Ctrl-C.")] = False,
) -> None:
    """Show the running node: its processes, ports, model, plan, peers and counters."""
    node_home = NodeHome.resolve(home)
    try:
        snapshot = read_status(node_home)
        if as_json:
            print(json.dumps(snapshot, indent=2))
        elif watch:
            with Live(_status_view(snapshot), console=console, refresh_per_second=2) as live:
                while True:
                    time.sleep(STATUS_WATCH_INTERVAL_S)
                    live.update(_status_view(read_status(node_home)))
        else:
            console.print(_status_view(snapshot))
    except KeyboardInterrupt:
        pass


def _status_view(snapshot: dict) -> Group:
    parts: list = []
    node = snapshot["node"]
    parts.append(Text(f"{node['name']} {node['short_id']}  home {node['home']}", style="bold"))
    parts.append(Text(f"model: {snapshot['model']['path']} (context {snapshot['model']['ctx_size']})"))
    if node["capacity"]:
        parts.append(Text(f"offers: {format_gib(node['capacity']['usable_bytes'])} GiB"))
    if node.get("llama_build"):
        parts.append(Text(f"llama.cpp: {node['llama_build']}"))
    serving = snapshot["serving"]
    if serving:
        c = serving["counters"]
        parts.append(Text(f"API: {serving['api']['url']}  requests {c['requests']:.0f}, failovers "
                          f"{c['failovers']:.0f}, retries {c['retries']:.0f}, restarts {c['restarts']:.0f}"))
        if serving["plan"]:
            parts.append(plan_table(serving["plan"], title="Current plan"))
        elif serving["refusal"]:
            parts.append(Text(f"Not serving: {serving['refusal']}", style="bold red"))
        if step_up := serving.get("step_up"):
            parts.append(Text(f"stepping up to {step_up['model']} in {step_up['in_s']:.0f} s if it keeps fitting"))
        if serving.get("speculation"):
            parts.append(Text(f"speculation: {serving['speculation']['reason']}"))
    processes = Table("process", "pid", "state", "port", "log")
    for p in snapshot["processes"]:
        processes.add_row(p["name"], str(p["pid"]), "running" if p["running"] else "exited",
                          str(p["port"]), p["log"])
    parts.append(processes)
    connected = sum(p["state"] == "connected" for p in snapshot["peers"])
    mesh = snapshot["mesh"]
    parts.append(Text(f"Mesh: {connected} peer(s) connected, UDP port {mesh['quic_port']}, secret rotated "
                      f"{mesh.get('secret_epoch', 0)} time(s)"))
    lan = mesh.get("lan")
    if lan is None:
        parts.append(Text("LAN discovery (mDNS): off"))
    else:
        others = {r["mesh_id"] for r in lan if not r["this_mesh"]}
        parts.append(Text(f"LAN discovery (mDNS): on; {sum(r['this_mesh'] for r in lan)} member(s) and "
                          f"{len(others)} other mesh(es) seen (`mesh-inference --lan` lists them)"))
    if snapshot["peers"]:
        peers = Table("peer", "id", "address", "path", "state", "health", "rtt ms (p50/p95)", "datagram B",
                      "tunnel port", "rpc-server", "offers GiB", "MiB to/from")
        for peer in snapshot["peers"]:
            offers = peer["capacity"].get("usable_bytes")
            rtt = "-" if peer["rtt_ms"] is None else f"{peer['rtt_ms']:.1f}"
            if peer.get("rtt_p50_ms") is not None:
                rtt += f" ({peer['rtt_p50_ms']:.1f}/{peer['rtt_p95_ms']:.1f})"
            state = peer["state"] + (f" ({peer['refused']})" if peer.get("refused") else "")
            path = peer.get("path") or "-"
            if peer.get("via"):
                path += f" via {peer['via']}"
            peers.add_row(peer["name"], peer["short_id"], str(peer["address"]), path, state,
                          str(peer.get("health", "-")), rtt, str(peer.get("datagram_bytes") or "-"),
                          str(peer["tunnel_port"] or "-"),
                          "up" if peer["rpc_server_up"] else "down",
                          "-" if offers is None else format_gib(offers),
                          f"{peer['bytes_to_peer'] / MIB:.1f}/{peer['bytes_from_peer'] / MIB:.1f}")
        parts.append(peers)
        parts.extend(Text(f"{peer['name']}: {peer['refused']}: {peer['refused_detail']}.", style="bold red")
                     for peer in snapshot["peers"] if peer.get("refused"))
    return Group(*parts)


@app.command()
def ticket(
    home: HomeOption = None,
    rotate: Annotated[bool, typer.Option("--rotate", help="Give every member a new mesh secret first: "
                                         "tickets printed before stop admitting anyone.")] = False,
) -> None:
    """Print the ticket another machine joins this mesh with."""
    node_home = NodeHome.resolve(home)
    if rotate:
        new_ticket = control.rotate_secret(node_home)
        err_console.print("Rotated the mesh secret: current members keep their place; older tickets "
                          "no longer admit anyone.", highlight=False)
    else:
        new_ticket = control.read_ticket(node_home)
    print(new_ticket)


@app.command()
def leave(home: HomeOption = None) -> None:
    """Leave the mesh for good: the others are told and forget this node, this node forgets the mesh."""
    node_home = NodeHome.resolve(home)
    if not node_home.control_file.exists() and (node_home.root / MESH_FILE_NAME).exists():
        SavedMesh.forget(node_home)
        err_console.print("No node is running here: forgot its mesh (its members were not told; they will see it "
                          "as lost). The next start begins a new mesh.", highlight=False)
        return
    control.leave(node_home)
    err_console.print("Leaving: the node tells its peers, waits for them to move work off it, and stops. "
                      "Its next start begins a new mesh (or joins one with --join).", highlight=False)


@app.command()
def kick(
    node: Annotated[str, typer.Argument(help="The member's name or id, as `mesh-inference status` shows it.")],
    home: HomeOption = None,
) -> None:
    """Remove a member from the mesh and rotate the secret, so its old ticket stops working."""
    result = control.kick(NodeHome.resolve(home), node)
    err_console.print(f"Removed {result['removed']} from the mesh and rotated the secret. New ticket:",
                      highlight=False)
    print(result["ticket"])


@app.command()
def verify(
    receipt_file: Annotated[Path, typer.Argument(metavar="RECEIPT", help="A receipt written by --receipt DIR.")],
    replay: Annotated[bool, typer.Option("--replay", help="Also run the request again on the mesh of the node "
                                         "in --home and compare the output's hash.")] = False,
    home: HomeOption = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=environment.API_KEY_ENV, show_default=False,
        help="The serving node's API key, if it has one.")] = None,
) -> None:
    """Check a run receipt's signature (and with --replay, that the mesh reproduces its output)."""
    try:
        document = json.loads(receipt_file.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"Cannot read {receipt_file} as JSON: {exc}") from exc
    body = receipts.verify(document)
    served = body["served_by"]
    console.print(f"Signature OK: served by {served['name']} ({served['id'][:16]}...) at {body['created']}; "
                  f"model {body['model']['name']} sha256 {str(body['model']['sha256'])[:12]}...; "
                  f"{body['output']['n_tokens']} tokens, output sha256 {body['output']['token_ids_sha256'][:16]}...",
                  highlight=False)
    if replay:
        again = _replay(body, read_status(NodeHome.resolve(home)), api_key)
        if again != body["output"]["token_ids_sha256"]:
            raise ReceiptError(f"Replay gave other output (sha256 {again[:16]}... instead of "
                               f"{body['output']['token_ids_sha256'][:16]}...): a different model, plan or "
                               "build, or a request that was not greedy.")
        console.print("Replay OK: the mesh reproduced the same output token ids.", highlight=False)


RECEIPT_REPLAY_TIMEOUT_S = 300.0


def _replay(body: dict, node_status: dict, api_key: str | None) -> str:
    """Send a receipt's request again to the node's API; the output digest of its answer."""
    serving = node_status.get("serving")
    if not serving:
        raise ReceiptError("The node in --home does not serve the API: replay against a serving node.")
    replay = receipts.replay_request(body, api_key)
    url = f"http://{LOOPBACK}:{serving['api']['port']}{replay.path}"
    try:
        response = httpx.post(url, json=replay.body, headers=replay.headers, timeout=RECEIPT_REPLAY_TIMEOUT_S)
        response.raise_for_status()
        return receipts.replayed_digest(response.json())
    except (httpx.HTTPError, ValueError) as exc:
        raise ReceiptError(f"The replay request to {url} failed: {exc}") from exc


@app.command()
def logs(
    home: HomeOption = None,
    process: Annotated[str | None, typer.Option(
        "--process", "-p", help="Only this process: sidecar, rpc-server, llama-server.")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", min=0, help="How many recent lines to show.")] = 40,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until Ctrl-C.")] = False,
) -> None:
    """Show the node's logs: one file per process, size-capped, in <home>/logs."""
    node_home = NodeHome.resolve(home)
    files = [f for f in log_files(node_home.logs) if process is None or f.name.startswith(process)]
    if not files:
        raise UsageError(f"No logs{' for ' + process if process else ''} in {node_home.logs}. "
                         "Has a node run with this home (--home)?")
    try:
        if follow:
            for path, line in follow_logs(files, lines=lines):
                print(f"{path.stem}: {line}", flush=True)
        else:
            for path in files:
                console.print(f"== {path.name} ==", style="bold", highlight=False)
                for line in tail(path, lines):
                    print(line)
    except KeyboardInterrupt:
        pass


@app.command()
def plan(
    home: HomeOption = None,
    model: Annotated[Path | None, typer.Option(
        "--model", help="Plan for this GGUF instead of the node's model.")] = None,
    ctx_size: Annotated[int | None, typer.Option("--ctx-size", min=256, help="Plan for this context length.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object, for scripts.")] = False,
) -> None:
    """Show how the running node would spread the model over the mesh now, without launching."""
    if model is not None:
        model = check_gguf(model)
    result = read_plan(NodeHome.resolve(home), model, ctx_size)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        console.print(plan_table(result))


def main() -> None:
    app()
