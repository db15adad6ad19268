"""A node's options, owned here: what the user typed (``NodeArgs``) checked (``check``), and the
``NodeOptions`` a node runs with assembled from it and what the CLI readied (``node_options``).

Each option has one owner: a serving node's models, tiers and context size are its ``ServeOptions``'
(serve/options.py); a worker's model file and context size are its ``WorkerModel``'s. The CLI hands
over the user's words and does the slow steps (the build, the model, the weight cache) in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..home import NodeHome
from ..llama.build import LlamaBinaries
from ..llama.hub_models import parse_model_name
from ..llama.kv_cache import DEFAULT_CTX_SIZE, DEFAULT_KV_CACHE, KvCacheTypes
from ..llama.projector import Projector, read_projector
from ..llama.weight_cache import WeightCache
from ..ports import DEFAULT_API_PORT, LOOPBACK, check_tcp_port_free
from ..serve.access import OPEN_ACCESS, ApiAccess
from ..serve.options import ServeOptions
from ..serve.planner import PlanBy
from ..serve.step_up import StepUpRules
from ..units import parse_size
from ..wire.gossip import DEVICE_NAME_RE, MAX_DEVICES_PER_MEMBER
from ..wire.ticket import Ticket, decode_ticket

NO_PROJECTOR = "none"  # --mmproj none: this tier takes no images


@dataclass(frozen=True)
class NodeArgs:
    """The node's options as the user typed them (cli/main.py's ``run_node`` names and documents them)."""

    serve: int | None
    api_port: int | None
    no_api: bool
    model: list[str] | None  # files or hf: names (llama/hub_models.py)
    spread: bool
    plan_by: str
    name: str | None
    home: Path | None
    llama_bin: Path | None
    b2b: bool
    join: str | None
    port: int | None
    min_peers: int
    step_up_after_s: float
    step_up_interval_s: float
    max_memory: str | None
    devices: str | None
    threads: int | None
    ctx_size: int
    cache_type_k: str
    cache_type_v: str
    api_key: str | None
    cors_origin: str | None
    use_weight_cache: bool
    mmproj: list[str] | None
    draft_model: str | None
    speculation_mode: str
    receipt: Path | None
    fetch_model: bool
    data_path: str
    no_mdns: bool
    lan: bool
    verbose: bool

    @property
    def serving(self) -> bool:
        return self.serve is not None

    @property
    def uses_model(self) -> bool:
        """Whether this node needs a model: a worker without --model fetches none and hashes none (the
        serving node sends what it holds)."""
        return self.serving or bool(self.model)


@dataclass(frozen=True)
class ApiOptions:
    """The node's API: every node has one, on loopback."""

    port: int = DEFAULT_API_PORT
    enabled: bool = True  # --no-api: no port for people (a serving node still answers members' forwarded requests)
    port_given: bool = False  # the user chose the port: taken is an error, not a reason to use another
    access: ApiAccess = OPEN_ACCESS  # --api-key, --cors-origin: at whichever node a client calls


@dataclass(frozen=True)
class CheckedArgs:
    """The user's words, checked and parsed before anything slow runs."""

    args: NodeArgs
    ticket: Ticket | None
    api: ApiOptions
    max_memory_bytes: int | None
    kv_cache: KvCacheTypes
    devices: tuple[str, ...]
    projectors: tuple[Projector | None, ...]  # read, not yet checked against their models


def check(args: NodeArgs) -> CheckedArgs:
    """Every option checked on its own and against the others (UsageError naming what to change):
    a typo should not wait for a build."""
    ticket = decode_ticket(args.join) if args.join is not None else None
    max_memory_bytes = parse_size(args.max_memory) if args.max_memory is not None else None
    api = api_options(args.serve, args.api_port, args.no_api, ApiAccess(args.api_key, args.cors_origin))
    if args.spread and not args.serving:
        raise UsageError("--spread works on a serving node only: add --serve PORT.")
    if args.plan_by not in (rule.value for rule in PlanBy):
        raise UsageError(f"--plan-by takes 'speed' or 'memory', not {args.plan_by!r}.")
    kv_cache = KvCacheTypes(args.cache_type_k, args.cache_type_v)  # UsageError naming the allowed types
    if kv_cache != DEFAULT_KV_CACHE and not args.serving:
        raise UsageError("--cache-type-k and --cache-type-v work on the serving node only: add --serve PORT.")
    if args.model and len(args.model) > 1 and not args.serving:
        raise UsageError("Several --model files (model tiers) work on the serving node only: add --serve PORT, "
                         "or give a worker one --model.")
    for name in args.model or ():
        parse_model_name(name)  # UsageError for a malformed hf: name
    projectors = read_projectors(args.mmproj or [], len(args.model or [None]), serving=args.serving)
    if args.data_path not in ("auto", "quic"):
        raise UsageError(f"--data-path takes 'auto' or 'quic', not {args.data_path!r}.")
    if args.speculation_mode not in ("auto", "off"):
        raise UsageError(f"--speculation takes 'auto' or 'off', not {args.speculation_mode!r}.")
    if args.speculation_mode == "off" and args.draft_model is not None:
        raise UsageError("--speculation off and --draft-model contradict each other: drop one.")
    if args.draft_model is not None and not args.serving:
        raise UsageError("--draft-model works on the serving node only: add --serve PORT.")
    if args.receipt is not None and not args.serving:
        raise UsageError("--receipt works on the serving node only: add --serve PORT.")
    return CheckedArgs(args, ticket, api, max_memory_bytes, kv_cache, device_names(args.devices), projectors)


def api_options(serve: int | None, api_port: int | None, no_api: bool, access: ApiAccess) -> ApiOptions:
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


def read_projectors(mmproj: list[str], n_models: int, *, serving: bool) -> tuple[Projector | None, ...]:
    """--mmproj, checked as projectors (before any build): one per --model, or none at all."""
    if not mmproj:
        return ()
    if not serving:
        raise UsageError("--mmproj works on the serving node only: add --serve PORT (workers need no projector).")
    if len(mmproj) != n_models:
        raise UsageError(f"Give --mmproj once per --model, in the same order ('{NO_PROJECTOR}' for a model without "
                         f"one): {n_models} model(s), {len(mmproj)} projector(s).")
    return tuple(None if arg == NO_PROJECTOR else read_projector(Path(arg).expanduser()) for arg in mmproj)


def hub_projectors(paths: tuple[Path | None, ...]) -> tuple[Projector | None, ...]:
    """The projectors hub repos offered beside their models, read as --mmproj would read them."""
    return tuple(None if path is None else read_projector(path) for path in paths)


def device_names(devices: str | None) -> tuple[str, ...]:
    """--devices as names (UsageError for one llama.cpp could not name, or too many for gossip)."""
    if devices is None:
        return ()
    names = tuple(name.strip() for name in devices.split(","))
    if not all(DEVICE_NAME_RE.fullmatch(name) for name in names) or len(set(names)) != len(names):
        raise UsageError(f"--devices takes distinct device names as llama.cpp gives them, comma-separated "
                         f"(e.g. Vulkan0,CPU), not {devices!r}. `mesh-inference status` shows a node's devices.")
    if len(names) > MAX_DEVICES_PER_MEMBER:
        raise UsageError(f"--devices names {len(names)} devices; a node offers at most {MAX_DEVICES_PER_MEMBER}.")
    return names


@dataclass(frozen=True)
class WorkerModel:
    """A worker's model, as far as it has one: the file it holds and announces, the context its plans assume."""

    path: Path | None = None  # --model; None: it holds no model file (the serving node sends its layers)
    sha256: str = ""  # the file's, announced to members; "" when it holds none
    ctx_size: int = DEFAULT_CTX_SIZE  # --ctx-size, for `mesh-inference plan` on this node


@dataclass(frozen=True)
class Readied:
    """What the CLI readied for the node (cli/prepare.py): the build, the model and its identity, the rest."""

    binaries: LlamaBinaries
    models: tuple[tuple[Path, str], ...]  # (path, sha256) of every --model, the first the default one; () none
    projectors: tuple[Projector | None, ...] = ()  # checked against their models and hashed
    hub_projectors: tuple[Path | None, ...] = ()  # each hf: model's repo's projector, for want of --mmproj
    draft_model: Path | None = None
    weight_cache: WeightCache | None = None
    weight_cache_tool: Path | None = None
    data_relay: Path | None = None


@dataclass(frozen=True)
class NodeOptions:
    """What the user asked this node to be."""

    home: NodeHome
    name: str
    binaries: LlamaBinaries
    api: ApiOptions = ApiOptions()
    # --serve: this node serves a model, and these options own its models and context size. None: a worker.
    serving: ServeOptions | None = None
    worker: WorkerModel = WorkerModel()  # a worker's model (unused on a serving node: ``serving`` has its own)
    join: Ticket | None = None
    quic_port: int | None = None
    max_memory_bytes: int | None = None
    # The devices rpc-server offers (--devices), by ggml's names; (): its own rule (every GPU, else the CPU).
    devices: tuple[str, ...] = ()
    rpc_threads: int | None = None  # --threads: rpc-server's CPU threads; None: the physical cores
    # rpc-server's weight cache (`-c`), seeded from the model file; None: off.
    weight_cache: WeightCache | None = None
    weight_cache_tool: Path | None = None
    # Fetch the serving node's model file over the mesh when this node lacks it.
    fetch_model: bool = False
    # Advertise on the LAN and re-find members there (mDNS, discovery.py).
    mdns: bool = False
    # Also say the progress of steps a terminal shows nothing of (llama-server's load stages, seeding
    # the weight cache after a fetch): for output that is not a terminal, such as a CI log.
    plain_progress: bool = False
    # The native data relay's binary (--data-path auto); None: every tunnel over QUIC.
    data_relay: Path | None = None

    @property
    def model(self) -> Path | None:
        """The model file this node holds: a serving node's first tier, a worker's --model (or None)."""
        return self.serving.models[0][0] if self.serving is not None else self.worker.path

    @property
    def model_sha256(self) -> str:
        """That file's sha256, announced to members ("" on a worker that holds no model file)."""
        return self.serving.models[0][1] if self.serving is not None else self.worker.sha256

    @property
    def ctx_size(self) -> int:
        return self.serving.ctx_size if self.serving is not None else self.worker.ctx_size


def node_options(checked: CheckedArgs, home: NodeHome, name: str, readied: Readied, *,
                 plain_progress: bool) -> NodeOptions:
    """The options a node runs with: the checked words and what the CLI readied, each given one owner."""
    args = checked.args
    serving = worker = None
    if args.serving:
        assert readied.models  # prepare fetched or checked it: a serving node uses a model
        serving = ServeOptions(models=readied.models, projectors=readied.projectors, ctx_size=args.ctx_size,
                               min_peers=args.min_peers,
                               step_up=StepUpRules(args.step_up_after_s, args.step_up_interval_s),
                               spread=args.spread, plan_by=PlanBy(args.plan_by), draft_model=readied.draft_model,
                               receipts=args.receipt.expanduser().resolve() if args.receipt else None,
                               speculate=args.speculation_mode == "auto", kv_cache=checked.kv_cache)
    else:
        path, sha256 = readied.models[0] if readied.models else (None, "")
        worker = WorkerModel(path, sha256, args.ctx_size)
    return NodeOptions(home=home, name=name, binaries=readied.binaries, api=checked.api, serving=serving,
                       worker=worker or WorkerModel(), join=checked.ticket, quic_port=args.port,
                       max_memory_bytes=checked.max_memory_bytes, devices=checked.devices, rpc_threads=args.threads,
                       weight_cache=readied.weight_cache, weight_cache_tool=readied.weight_cache_tool,
                       fetch_model=args.fetch_model, mdns=not args.no_mdns, plain_progress=plain_progress,
                       data_relay=readied.data_relay)
