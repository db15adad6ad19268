"""What a command readies before a node runs: the llama.cpp build, the model and its identity, a draft
model, the projectors' identity, the weight cache, the data relay; slow steps report on a live bar on a
terminal, else in plain lines."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from ..errors import ModelError, SetupError
from ..home import NodeHome
from ..llama import weight_cache
from ..llama.backends import Backend, recorded_backend
from ..llama.build import B2B, STOCK, LlamaBinaries, ensure_binaries, ensure_source_archive
from ..llama.hub_models import parse_model_name, resolve
from ..llama.model import check_gguf, ensure_model, model_sha256, remember_sha256
from ..llama.model_files import read_model_header
from ..llama.projector import Projector, check_pair
from ..llama.weight_cache import WeightCache
from ..net.data_plane.build import ensure_data_relay
from ..progress import PlainProgress, ProgressCallback
from ..serve import speculation
from .output import err_console


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
def setup_progress() -> Iterator[ProgressCallback]:
    """Where the setup steps report: a live bar on a terminal, else plain lines (CI logs, `| tee`)."""
    if not err_console.is_terminal:
        yield PlainProgress(lambda line: err_console.print(line, highlight=False, markup=False, soft_wrap=True))
        return
    bar = _LazyProgress()
    try:
        yield bar
    finally:
        bar.close()


@dataclass(frozen=True)
class PreparedModels:
    """What `prepare` readied: the build, and the models as files."""

    binaries: LlamaBinaries
    models: tuple[tuple[Path, str], ...]  # (path, sha256) of every model, the first the node's own; () none
    # Each model's projector as its hub repo offers it (a vision repo's mmproj), in the same order; None: none.
    hub_projectors: tuple[Path | None, ...] = ()


def prepare(llama_bin: Path | None, model: str | None, *, uses_model: bool = True, identify_model: bool = False,
            b2b: bool = False, more_models: Sequence[str] = (), backend: Backend | None = None,
            hub_projectors: bool = False) -> PreparedModels:
    """Binaries, model and (if asked) the model's sha256, with a progress bar when slow; and ``more_models``
    (the other tiers) with theirs. The pinned build is ``backend``'s, by default the one the last `setup`
    built (cpu if none did). A model is a file or an ``hf:`` name (llama/hub_models.py), fetched into the
    hub's cache when missing, with its repo's projector when ``hub_projectors``. Without ``model`` the
    default model is fetched when ``uses_model``; else there is none (a worker holds no model file: nothing
    to fetch, nothing to hash).

    Models are found before the build starts: a typo or a missing repo should not wait for a build.
    """
    named = [name for name in (model, *more_models) if name is not None]
    for name in named:
        if parse_model_name(name) is None:
            check_gguf(Path(name).expanduser())
    with setup_progress() as progress:
        located = [_locate(name, progress, projector=hub_projectors) for name in named]
        variant = B2B if b2b else STOCK
        binaries = ensure_binaries(llama_bin, progress, variant.on(backend or recorded_backend()))
        if model is None and uses_model:
            located.insert(0, (ensure_model(None, progress), None))
        models = tuple((path, model_sha256(path, progress) if index or identify_model else "")
                       for index, (path, _) in enumerate(located))
        return PreparedModels(binaries, models, tuple(projector for _, projector in located))


def _locate(name: str, progress: ProgressCallback, *, projector: bool) -> tuple[Path, Path | None]:
    """The model file ``name`` names, and its hub repo's projector if asked: a path checked, or an ``hf:``
    name found in the hub's cache (fetched into it when missing)."""
    hub_name = parse_model_name(name)
    if hub_name is None:
        return check_gguf(Path(name).expanduser()), None
    resolved = resolve(hub_name, progress=progress, projector=projector)
    for path, sha256 in resolved.checked_sha256s:  # checked as they arrived: not hashed again
        remember_sha256(path, sha256)
    return check_gguf(resolved.model_path), resolved.projector_path


def cached_model_file(name: str) -> Path:
    """The model file ``name`` names, for a command that downloads nothing (`plan`): a path checked, or an
    ``hf:`` name's file in the hub's cache."""
    hub_name = parse_model_name(name)
    if hub_name is None:
        return check_gguf(Path(name).expanduser())
    try:
        return resolve(hub_name, progress=lambda *_: None, offline=True, projector=False).model_path
    except ModelError as exc:
        raise ModelError(f"{hub_name} is not downloaded here, and planning reads the model's header from its "
                         f"file. Download it first: mesh-inference setup --model {hub_name}") from exc


def identify_projectors(projectors: Sequence[Projector | None],
                        models: Sequence[Path]) -> tuple[Projector | None, ...]:
    """Each projector checked against its model's embedding width, and hashed (its identity in gossip)."""
    identified: list[Projector | None] = []
    with setup_progress() as progress:
        for projector, model in zip(projectors, models, strict=False):
            if projector is not None:
                check_pair(projector, model, read_model_header(model))
                projector = dataclasses.replace(projector, sha256=model_sha256(projector.path, progress))
            identified.append(projector)
    return tuple(identified)


def draft_for(model: Path | None, draft: str | None) -> Path | None:
    """The draft model --draft-model names (checked against the model's tokenizer), or None. Only a
    serving node takes one (node/options.py checks), and it has its model."""
    if draft is None:
        return None
    assert model is not None
    path = speculation.find_draft(model) if draft == speculation.AUTO else check_gguf(Path(draft))
    speculation.check_pair(model, path)
    return path


def prepare_weight_cache(home: NodeHome, model: Path | None, sha256: str,
                         say: Callable[[str], None]) -> tuple[WeightCache, Path]:
    """This node's rpc-server weight cache (checked, seeded from the model file it holds) and its helper."""
    cache = WeightCache.in_home(home.root)
    with setup_progress() as progress:
        tool = weight_cache.ensure_tool(progress)
        removed = weight_cache.verify(cache, progress)
        if removed:
            say(f"Removed {removed} file(s) from the weight cache that this node did not seed, or that changed "
                "since; they are seeded again from the model file, else their tensors are sent over the network.")
        if model is not None and sha256:
            weight_cache.seed(cache, tool, model, sha256, progress)
    return cache, tool


def keep_source(say: Callable[[str], None]) -> Path | None:
    """The pinned llama.cpp source, kept so members without package access can build from it (mesh/
    source_fetch.py); None (said why) if it cannot be had."""
    try:
        with setup_progress() as progress:
            return ensure_source_archive(progress)
    except SetupError as exc:
        say(f"The llama.cpp source is not kept here, so members without package access cannot take it from "
            f"this machine: {exc}")
        return None


def prepare_data_relay(say: Callable[[str], None]) -> Path | None:
    """The native data relay's binary, built if missing; None (said why: tunnels then use QUIC) if it cannot be."""
    try:
        with setup_progress() as progress:
            return ensure_data_relay(progress)
    except SetupError as exc:
        say(f"The native data relay is not available, so every tunnel uses QUIC (slower): {exc}")
        return None
