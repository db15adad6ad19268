"""The ``mesh-inference`` command line: run a node, set up, show status.

Every error a person can cause ends here as one clear message and a non-zero
exit, never a traceback: every command runs through ``_MeshCommands.invoke``,
the one place that turns a ``MeshError`` into its message on stderr and exit
status 1. Usage errors that typer finds itself (a missing argument, a bad
number) keep typer's own message and status 2.

Read-only commands (status, plan, ticket, logs, --help) must answer at once, so this module imports
only what they use: a command that runs or builds something imports its layers in its own body
(start.py to run a node). tests/unit/test_cli_imports.py holds that line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup

from .. import environment
from ..errors import MeshError, ReceiptError, UsageError
from ..home import DEFAULT_HOME, NodeHome
from ..llama.backends import AUTO, BACKENDS, backend_named, detect_backend, record_backend
from ..llama.kv_cache import DEFAULT_CTX_SIZE, DEFAULT_KV_CACHE_TYPE, KV_CACHE_TYPES
from ..logs import follow as follow_logs
from ..logs import log_files, tail
from ..node import control_client as control
from ..node.control_client import read_plan, read_status
from ..ports import DEFAULT_API_PORT, DEFAULT_QUIC_PORT, LOOPBACK
from ..serve.step_up import STEP_UP_AFTER_S, STEP_UP_INTERVAL_S
from .output import console, err_console
from .views import plan_view, status_view

STATUS_WATCH_INTERVAL_S = 1.0
MESH_ERROR_EXIT_STATUS = 1


# The node's options in `mesh-inference --help`, one panel each (rich_help_panel), in this order; a
# subcommand's options stay in typer's one "Options" panel. An option that takes a value names it
# (metavar) and a flag shows none, so no "<list[Path]>" or "<bool>" narrows the help column.
MESH_PANEL = "Mesh"
SERVING_PANEL = "Serving"
SPEED_PANEL = "Model tiers & speed"
ADVANCED_PANEL = "Advanced"
PANEL_ORDER = (MESH_PANEL, SERVING_PANEL, SPEED_PANEL, ADVANCED_PANEL)
FLAG = ""  # the metavar of an option that takes no value
MODEL_METAVAR = "FILE|hf:NAME"


def _flag_help_option(option: Any) -> Any:
    """typer's own --help, shown as the flag it is (no "<bool>")."""
    if option is not None:
        option.metavar = FLAG
    return option


class _NamedArgument(TyperArgument):
    """An argument whose metavar (RECEIPT, NODE) says what it takes: no "<path>" beside it in --help."""

    def display_type_rich(self, ctx: Any) -> None:
        return None


class _MeshCommand(TyperCommand):
    """A subcommand: its --help shows names (metavars), not types."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if type(param) is TyperArgument:
                param.__class__ = _NamedArgument  # typer has no setting for an argument's class

    def get_help_option(self, ctx: Any) -> Any:
        return _flag_help_option(super().get_help_option(ctx))


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

    def get_help_option(self, ctx: Any) -> Any:
        option = _flag_help_option(super().get_help_option(ctx))
        if option is not None:
            option.rich_help_panel = ADVANCED_PANEL  # last, not alone in a panel above the others
        return option

    def get_params(self, ctx: Any) -> Any:
        """The node's options panel by panel (typer shows panels in the order it first meets them);
        each panel keeps the declaration order. Parsing does not depend on this order."""
        def panel(param: Any) -> int:
            name = getattr(param, "rich_help_panel", None)
            return PANEL_ORDER.index(name) if name in PANEL_ORDER else len(PANEL_ORDER)
        return sorted(super().get_params(ctx), key=panel)


app = typer.Typer(
    cls=_MeshCommands,
    add_completion=False,
    no_args_is_help=False,
    help="Run one GGUF model across several machines: llama.cpp RPC over an authenticated QUIC mesh.",
)

def _home_option(panel: str | None = None) -> Any:
    return typer.Option("--home", metavar="DIR", rich_help_panel=panel,
                        help=f"This node's state directory (default: ${environment.HOME_ENV}, else {DEFAULT_HOME}).")


def _llama_bin_option(panel: str | None = None) -> Any:
    return typer.Option("--llama-bin", metavar="DIR", rich_help_panel=panel,
                        help="Your own ggml-rpc-server and llama-server (e.g. a CUDA build); default: "
                             f"${environment.LLAMA_BIN_ENV}, else the pinned build.")


def _b2b_option(panel: str | None = None) -> Any:
    return typer.Option("--b2b", metavar=FLAG, rich_help_panel=panel,
                        help="Use llama.cpp's b2b build: workers pass activations straight to each other "
                             "(patches/README.md). Nodes without it still work with it.")


HomeOption = Annotated[Path | None, _home_option()]
B2bOption = Annotated[bool, _b2b_option()]
LlamaBinOption = Annotated[Path | None, _llama_bin_option()]


@app.callback(invoke_without_command=True)
def run_node(
    ctx: typer.Context,
    serve: Annotated[int | None, typer.Option(
        "--serve", min=1, max=65535, metavar="PORT", rich_help_panel=SERVING_PANEL,
        help="Serve a model (--model) here, with the API on this port.")] = None,
    api_port: Annotated[int | None, typer.Option(
        "--api-port", min=1, max=65535, metavar="PORT", rich_help_panel=SERVING_PANEL,
        help=f"The API's port on 127.0.0.1, on every node (default {DEFAULT_API_PORT}, else a free one).")] = None,
    no_api: Annotated[bool, typer.Option(
        "--no-api", metavar=FLAG, rich_help_panel=SERVING_PANEL,
        help="No API port on this node (with --serve, its port stays closed; members still reach the "
             "model it serves).")] = False,
    model: Annotated[list[str] | None, typer.Option(
        "--model", metavar=MODEL_METAVAR, rich_help_panel=SERVING_PANEL,
        help="GGUF file, or hf:USER/REPO[:QUANT] (default Q4_K_M) or hf:USER/REPO/FILE.gguf from the Hugging "
             "Face hub, kept in its cache (HF_TOKEN, HF_ENDPOINT honoured). Default: SmolLM2-135M-Instruct. "
             "With --serve, give several for tiers: the largest the mesh can hold is served.")] = None,
    spread: Annotated[bool, typer.Option(
        "--spread", metavar=FLAG, rich_help_panel=SERVING_PANEL,
        help="With --serve: split the model over every free member, even when it fits on fewer.")] = False,
    plan_by: Annotated[str, typer.Option(
        "--plan-by", metavar="speed|memory", rich_help_panel=SERVING_PANEL,
        help="With --serve: give the fast devices the layers they can hold, slower ones the rest ('speed', "
             "the default), or layers in proportion to the memory each member offers ('memory').")] = "speed",
    name: Annotated[str | None, typer.Option(
        "--name", metavar="NAME", rich_help_panel=MESH_PANEL,
        help="This node's name in the mesh (default: the host name).")] = None,
    home: Annotated[Path | None, _home_option(MESH_PANEL)] = None,
    llama_bin: Annotated[Path | None, _llama_bin_option(ADVANCED_PANEL)] = None,
    b2b: Annotated[bool, _b2b_option(ADVANCED_PANEL)] = False,
    join: Annotated[str | None, typer.Option(
        "--join", metavar="TICKET", rich_help_panel=MESH_PANEL,
        help="Join the mesh of the node that printed this ticket.")] = None,
    port: Annotated[int | None, typer.Option(
        "--port", metavar="PORT", rich_help_panel=MESH_PANEL,
        help=f"The mesh's port, UDP (QUIC) and TCP (the data path): open both in a firewall (default "
             f"{DEFAULT_QUIC_PORT}, else a free one).")] = None,
    min_peers: Annotated[int, typer.Option(
        "--min-peers", metavar="N", rich_help_panel=SERVING_PANEL,
        help="With --serve: wait for N peers before loading the model.")] = 0,
    step_up_after_s: Annotated[float, typer.Option(
        "--step-up-after-s", min=0, metavar="SECONDS", rich_help_panel=SPEED_PANEL,
        help="With several --model: step up to a bigger tier once it has fitted this long without a break "
             "(down: at once).")] = STEP_UP_AFTER_S,
    step_up_interval_s: Annotated[float, typer.Option(
        "--step-up-interval-s", min=0, metavar="SECONDS", rich_help_panel=SPEED_PANEL,
        help="With several --model: at least this long between a model switch and a step up.",
    )] = STEP_UP_INTERVAL_S,
    max_memory: Annotated[str | None, typer.Option(
        "--max-memory", metavar="SIZE", rich_help_panel=MESH_PANEL,
        help="Offer at most this much memory to the mesh, e.g. 4G (G means GiB).")] = None,
    devices: Annotated[str | None, typer.Option(
        "--devices", metavar="LIST", rich_help_panel=MESH_PANEL,
        help="The devices to offer, by llama.cpp's names, e.g. Vulkan0,CPU (default: every GPU, else the "
             "CPU). Each is planned on its own.")] = None,
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, metavar="N", rich_help_panel=MESH_PANEL,
        help="CPU threads for this node's share of the model (default: the machine's physical cores).")] = None,
    ctx_size: Annotated[int, typer.Option(
        "--ctx-size", min=256, metavar="TOKENS", rich_help_panel=SERVING_PANEL,
        help="Context length llama-server gets.")] = DEFAULT_CTX_SIZE,
    cache_type_k: Annotated[str, typer.Option(
        "--cache-type-k", metavar="TYPE", rich_help_panel=SERVING_PANEL,
        help=f"With --serve: the K cache's element type, one of {', '.join(KV_CACHE_TYPES)} (llama.cpp's "
             "--cache-type-k); q8_0 halves the cache of a long context.")] = DEFAULT_KV_CACHE_TYPE,
    cache_type_v: Annotated[str, typer.Option(
        "--cache-type-v", metavar="TYPE", rich_help_panel=SERVING_PANEL,
        help="With --serve: the V cache's element type, as --cache-type-k (a quantized one turns on flash "
             "attention).")] = DEFAULT_KV_CACHE_TYPE,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=environment.API_KEY_ENV, show_default=False, metavar="KEY", rich_help_panel=SERVING_PANEL,
        help=f"Clients must send 'Authorization: Bearer KEY'. Prefer ${environment.API_KEY_ENV}: other local "
             "users see arguments in ps.")] = None,
    cors_origin: Annotated[str | None, typer.Option(
        "--cors-origin", metavar="ORIGIN", rich_help_panel=SERVING_PANEL,
        help="Let web pages from this origin (e.g. https://chat.example.org) call the API. Default: no CORS.")] = None,
    use_weight_cache: Annotated[bool, typer.Option(
        "--weight-cache/--no-weight-cache", metavar=FLAG, rich_help_panel=ADVANCED_PANEL,
        help="Cache received weights (seeded from --model) so loads send only hashes; costs about the "
             "model's size on disk.")] = True,
    mmproj: Annotated[list[str] | None, typer.Option(
        "--mmproj", metavar="FILE", rich_help_panel=SERVING_PANEL,
        help="With --serve: the model's image projector (mmproj-*.gguf), so chats may hold images. With several "
             "--model, one per model in the same order ('none' for one without).")] = None,
    draft_model: Annotated[str | None, typer.Option(
        "--draft-model", metavar="FILE", rich_help_panel=SPEED_PANEL,
        help="With --serve: a small GGUF with the same tokenizer, drafting tokens on this CPU (speculative "
             "decoding); 'auto': the smallest cached one.")] = None,
    speculation_mode: Annotated[str, typer.Option(
        "--speculation", metavar="auto|off", rich_help_panel=SPEED_PANEL,
        help="With --serve: auto (the draft model if given, else n-gram lookup on slow links) or off.")] = "auto",
    receipt: Annotated[Path | None, typer.Option(
        "--receipt", metavar="DIR", rich_help_panel=SERVING_PANEL,
        help="With --serve: write a signed receipt of every request here (check one with "
             "`mesh-inference verify`).")] = None,
    fetch_model: Annotated[bool, typer.Option(
        "--fetch-model", metavar=FLAG, rich_help_panel=ADVANCED_PANEL,
        help="Without --serve: fetch the serving node's model over the mesh (resumable, sha256-checked) so "
             "loads send only hashes.")] = False,
    data_path: Annotated[str, typer.Option(
        "--data-path", metavar="auto|quic", rich_help_panel=MESH_PANEL,
        help="How RPC reaches members: auto (the native relay, TLS over TCP on the mesh's port number, to "
             "members reached directly; QUIC to the others) or quic (always QUIC).")] = "auto",
    no_mdns: Annotated[bool, typer.Option(
        "--no-mdns", metavar=FLAG, rich_help_panel=MESH_PANEL,
        help="Neither advertise this node on the LAN (mDNS) nor look for members there.")] = False,
    lan: Annotated[bool, typer.Option(
        "--lan", metavar=FLAG, rich_help_panel=MESH_PANEL,
        help="List the meshes seen on this LAN (mDNS) for a few seconds, then exit.")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", metavar=FLAG, rich_help_panel=ADVANCED_PANEL,
        help="Print the sidecar's log here too.")] = False,
) -> None:
    """Start a node (no subcommand): a member of the mesh with the OpenAI API on localhost:8080.
    With --serve PORT it also serves a model."""
    if ctx.invoked_subcommand is not None:
        return
    # Imported only to run a node: read-only commands must not pay for its layers (test_cli_imports.py).
    from .start import start_node

    start_node(**ctx.params)


@app.command(cls=_MeshCommand)
def setup(
    llama_bin: LlamaBinOption = None,
    model: Annotated[str | None, typer.Option(
        "--model", metavar=MODEL_METAVAR,
        help="Check this GGUF (a file, or hf:USER/REPO[:QUANT] fetched into the hub's cache) instead of "
             "fetching the default.")] = None,
    b2b: B2bOption = False,
    backend: Annotated[str, typer.Option(
        "--backend", metavar="|".join((*BACKENDS, AUTO)),
        help="Build llama.cpp for this compute backend; this machine's nodes then run that build. auto: the "
             "machine's GPU (one nvidia-smi lists, with the CUDA toolkit: cuda; macOS: metal; a GPU the Vulkan "
             "loader lists, with glslc: vulkan), else cpu.")] = AUTO,
) -> None:
    """Build the pinned llama.cpp (once per backend) and fetch the default model. Prints the binaries'
    directory last."""
    own_build = (llama_bin or environment.llama_bin_dir()) is not None
    if own_build and backend != AUTO:
        raise UsageError(f"--backend chooses which pinned build to make, --llama-bin (or "
                         f"{environment.LLAMA_BIN_ENV}) names your own: give one.")
    if own_build:
        chosen = None
    elif backend == AUTO:
        detection = detect_backend()
        chosen = detection.backend
        console.print(f"Found {detection.found}: building llama.cpp for {chosen.name} (choose with --backend).",
                      highlight=False)
    else:
        chosen = backend_named(backend)
    from .prepare import keep_source, prepare, prepare_data_relay

    prepared = prepare(llama_bin, model, b2b=b2b, backend=chosen)
    relay = prepare_data_relay(lambda line: console.print(line, highlight=False))
    source = keep_source(lambda line: console.print(line, highlight=False))
    if chosen is None:
        console.print("backend: your own build (--llama-bin)", highlight=False)
    else:
        record_backend(chosen)  # only now that its build is complete
        console.print(f"backend: {chosen.name}{' (detected)' if backend == AUTO else ''}", highlight=False)
    console.print(f"model: {prepared.models[0][0]}", highlight=False)
    console.print(f"data relay: {relay or 'missing (tunnels use QUIC)'}", highlight=False)
    console.print(f"llama.cpp source, offered to members without package access: {source or 'not kept'}",
                  highlight=False)
    print(prepared.binaries.directory)


@app.command(cls=_MeshCommand)
def status(
    home: HomeOption = None,
    as_json: Annotated[bool, typer.Option("--json", metavar=FLAG, help="Print one JSON object, for scripts.")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", metavar=FLAG,
                                        help="Refresh every second until Ctrl-C.")] = False,
    wide: Annotated[bool, typer.Option("--wide", metavar=FLAG, help="Show every column: ids, addresses, "
                                       "paths, ports, byte counts (needs about 160 columns).")] = False,
) -> None:
    """Show the running node: its API, the models in the mesh, its plan, processes and peers."""
    node_home = NodeHome.resolve(home)
    try:
        snapshot = read_status(node_home)
        if as_json:
            print(json.dumps(snapshot, indent=2))
        elif watch:
            with Live(status_view(snapshot, wide=wide), console=console, refresh_per_second=2) as live:
                while True:
                    time.sleep(STATUS_WATCH_INTERVAL_S)
                    live.update(status_view(read_status(node_home), wide=wide))
        else:
            console.print(status_view(snapshot, wide=wide))
    except KeyboardInterrupt:
        pass


@app.command(cls=_MeshCommand)
def ticket(
    home: HomeOption = None,
    rotate: Annotated[bool, typer.Option("--rotate", metavar=FLAG, help="Give every member a new mesh secret "
                                         "first: tickets printed before stop admitting anyone.")] = False,
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


@app.command(cls=_MeshCommand)
def leave(home: HomeOption = None) -> None:
    """Leave the mesh for good: the others are told and forget this node, this node forgets the mesh."""
    from ..mesh.saved import MESH_FILE_NAME, SavedMesh

    node_home = NodeHome.resolve(home)
    if not node_home.control_file.exists() and (node_home.root / MESH_FILE_NAME).exists():
        SavedMesh.forget(node_home)
        err_console.print("No node is running here: forgot its mesh (its members were not told; they will see it "
                          "as lost). The next start begins a new mesh.", highlight=False)
        return
    control.leave(node_home)
    err_console.print("Leaving: the node tells its peers, waits for them to move work off it, and stops. "
                      "Its next start begins a new mesh (or joins one with --join).", highlight=False)


@app.command(cls=_MeshCommand)
def kick(
    node: Annotated[str, typer.Argument(metavar="NODE",
                                        help="The member's name or id, as `mesh-inference status` shows it.")],
    home: HomeOption = None,
) -> None:
    """Remove a member from the mesh and rotate the secret, so its old ticket stops working."""
    result = control.kick(NodeHome.resolve(home), node)
    err_console.print(f"Removed {result['removed']} from the mesh and rotated the secret. New ticket:",
                      highlight=False)
    print(result["ticket"])


@app.command(cls=_MeshCommand)
def verify(
    receipt_file: Annotated[Path, typer.Argument(metavar="RECEIPT", help="A receipt written by --receipt DIR.")],
    replay: Annotated[bool, typer.Option("--replay", metavar=FLAG, help="Also run the request again on the mesh of "
                                         "the node in --home and compare the output's hash.")] = False,
    home: HomeOption = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=environment.API_KEY_ENV, show_default=False, metavar="KEY",
        help="The serving node's API key, if it has one.")] = None,
) -> None:
    """Check a run receipt's signature (and with --replay, that the mesh reproduces its output)."""
    from ..serve import receipt as receipts

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
                               "build, a request that was not greedy, or a prompt the answer took partly "
                               "from llama-server's cache (send \"cache_prompt\": false for answers to replay).")
        console.print("Replay OK: the mesh reproduced the same output token ids.", highlight=False)


RECEIPT_REPLAY_TIMEOUT_S = 300.0


def _replay(body: dict, node_status: dict, api_key: str | None) -> str:
    """Send a receipt's request again to the node's API; the output digest of its answer."""
    import httpx

    from ..serve import receipt as receipts

    serving = node_status.get("serving")
    if not serving:
        raise ReceiptError("The node in --home does not serve the API: replay against a serving node.")
    port = (node_status.get("api") or {}).get("port")
    if port is None:
        raise ReceiptError("The node in --home has no API port (--no-api): replay against a node with one.")
    replay = receipts.replay_request(body, api_key)
    url = f"http://{LOOPBACK}:{port}{replay.path}"
    try:
        response = httpx.post(url, json=replay.body, headers=replay.headers, timeout=RECEIPT_REPLAY_TIMEOUT_S)
        response.raise_for_status()
        return receipts.replayed_digest(response.json())
    except (httpx.HTTPError, ValueError) as exc:
        raise ReceiptError(f"The replay request to {url} failed: {exc}") from exc


@app.command(cls=_MeshCommand)
def logs(
    home: HomeOption = None,
    process: Annotated[str | None, typer.Option(
        "--process", "-p", metavar="NAME", help="Only this process: sidecar, rpc-server, llama-server.")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", min=0, metavar="N",
                                       help="How many recent lines to show.")] = 40,
    follow: Annotated[bool, typer.Option("--follow", "-f", metavar=FLAG,
                                         help="Keep printing new lines until Ctrl-C.")] = False,
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


@app.command(cls=_MeshCommand)
def plan(
    home: HomeOption = None,
    model: Annotated[str | None, typer.Option(
        "--model", metavar=MODEL_METAVAR,
        help="Plan for this GGUF instead of the node's model: a file, or an hf: name already in the hub's "
             "cache.")] = None,
    ctx_size: Annotated[int | None, typer.Option("--ctx-size", min=256, metavar="TOKENS",
                                                 help="Plan for this context length.")] = None,
    as_json: Annotated[bool, typer.Option("--json", metavar=FLAG, help="Print one JSON object, for scripts.")] = False,
    wide: Annotated[bool, typer.Option("--wide", metavar=FLAG, help="Also show each node's id and whom each "
                                       "member serves with.")] = False,
) -> None:
    """Show how the running node would spread the model over the mesh now, without launching."""
    model_path = None
    if model is not None:
        from .prepare import cached_model_file

        model_path = cached_model_file(model)
    result = read_plan(NodeHome.resolve(home), model_path, ctx_size)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        console.print(plan_view(result, wide=wide))


def main() -> None:
    app()
