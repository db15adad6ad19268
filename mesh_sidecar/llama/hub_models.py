"""Models named ``hf:USER/REPO[:QUANT]`` or ``hf:USER/REPO/FILE.gguf``: found on the Hugging Face hub,
fetched into the hub's own cache, and used from it.

Three steps, the first two pure:

    parse_model_name("hf:USER/REPO:Q8_0")  ->  HubModelName        (None for a name that is not hf:)
    choose_files(name, repo's file names)  ->  HubChoice           the quant as llama.cpp's -hf picks it
    resolve(name, progress=...)            ->  ResolvedModel       paths in the cache, fetched if missing

The quant is chosen as llama.cpp's ``-hf USER/REPO[:QUANT]`` chooses it: the tag (``Q4_K_M`` when none
is given, then ``Q8_0``, then the repo's first GGUF) matched case-insensitively in the GGUF file names,
followed by ``.`` or ``-`` (so ``Q4_K`` does not take ``Q4_K_M``); a split set is found by its first
shard and fetched whole; a projector (``mmproj*.gguf``) beside it is fetched too, for ``--mmproj``.

The files go where huggingface_hub keeps them (``HF_HUB_CACHE``, by default ``HF_HOME/hub``), in its
layout: ``models--USER--REPO/blobs/<sha256>``, ``snapshots/<commit>/<file>`` linking to the blob,
``refs/main``. So ``hf download`` and every other hub client share the one copy. Beside them, in
``.mesh-inference/``, the repo's file listing as the hub gave it (names, sizes, sha256s, commit): with it
a later start chooses the same files and finds them with no network call at all.

The download is ours, not ``hf_hub_download``'s: that one keeps a partial file under a name unique to
the process and deletes it on failure, so a download killed midway would start over. Ours writes
``blobs/<sha256>.incomplete``, resumes it with a Range request on the next start, checks the sha256 the
hub publishes for the file before the blob takes its name, and checks the free space first. The hub's
endpoint (``HF_ENDPOINT``), token (``HF_TOKEN``), HTTP session, cache folder names and file lock are
huggingface_hub's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import httpx2  # huggingface_hub's HTTP client: its errors are what a failed hub call raises
from huggingface_hub import HfApi, constants, get_session, hf_hub_url
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import WeakFileLock, build_hf_headers, hf_raise_for_status

from ..errors import ModelError, UsageError
from ..progress import ProgressCallback
from ..units import MIB, format_gib
from .model_files import shard_name

PREFIX = "hf:"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's -hf without a tag: the first the repo has, else its first GGUF
PROJECTOR_MARK = "mmproj"
PROJECTOR_PREFERENCE = ("f16", "bf16", "f32")  # when a repo has several projectors and none names the quant
REVISION = "main"
LISTING_DIR = ".mesh-inference"  # in the repo's cache folder, beside blobs/ and snapshots/
CHUNK_BYTES = 1 << 20
PROGRESS_NOTE_STEPS = 10  # the rate and time left are refreshed once per tenth of a file
SPACE_MARGIN_BYTES = 256 * MIB  # left free after a download: a full disk breaks more than the download
_NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_QUANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A quant as it shows in a file name: Q4_K_M, IQ2_XXS, UD-Q4_K_XL, Q4_0_4_4, F16, BF16, TQ1_0, MXFP4_MOE.
_QUANT_IN_NAME = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d+(?:_[A-Z0-9]+)*|TQ\d_\d|B?F\d+|MXFP4(?:_MOE)?))"
                            r"(?=[.-]|$)", re.IGNORECASE)
USAGE = ("write hf:USER/REPO, hf:USER/REPO:QUANT (for example hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M) "
         "or hf:USER/REPO/FILE.gguf")


# --- names and choices: pure -------------------------------------------------------------------


@dataclass(frozen=True)
class HubModelName:
    """A model named on the hub: its repo, and a quant or a file in it (neither: the default quant)."""

    repo: str  # USER/REPO
    quant: str | None = None
    file: str | None = None  # a path in the repo, ending in .gguf

    def __str__(self) -> str:
        if self.file is not None:
            return f"{PREFIX}{self.repo}/{self.file}"
        return f"{PREFIX}{self.repo}" + (f":{self.quant}" if self.quant is not None else "")


def parse_model_name(text: str) -> HubModelName | None:
    """The hub model ``text`` names, or None when it does not start with ``hf:`` (a path, then);
    UsageError for an ``hf:`` name that is malformed."""
    if not text.startswith(PREFIX):
        return None
    rest = text[len(PREFIX):]
    parts = rest.split("/")
    quant = None
    if len(parts) == 2 and ":" in parts[1]:
        parts[1], quant = parts[1].split(":", 1)
    if len(parts) < 2 or not all(_NAME_PART.fullmatch(part) for part in parts[:2]):
        raise UsageError(f"{text!r} is not a Hugging Face model name: {USAGE}.")
    repo = "/".join(parts[:2])
    if quant is not None and not _QUANT.fullmatch(quant):
        raise UsageError(f"{text!r} names no quant after the ':' ({USAGE}).")
    if len(parts) == 2:
        return HubModelName(repo, quant)
    file = "/".join(parts[2:])
    if not file.lower().endswith(".gguf") or any(part in ("", ".", "..") for part in parts[2:]):
        raise UsageError(f"{text!r} names a file that is not a .gguf in the repo: {USAGE}.")
    return HubModelName(repo, file=file)


@dataclass(frozen=True)
class HubChoice:
    """The files of a repo that a name asks for."""

    model_files: tuple[str, ...]  # one GGUF, or every shard of a split set, the first first
    projector: str | None  # an mmproj GGUF for --mmproj, or None
    quant: str  # the quant chosen (as the file name says it)

    @property
    def files(self) -> tuple[str, ...]:
        return self.model_files + ((self.projector,) if self.projector is not None else ())


def choose_files(name: HubModelName, repo_files: Iterable[str], *, projector: bool = True) -> HubChoice:
    """The files ``name`` asks for among ``repo_files`` (the repo's paths), as llama.cpp's ``-hf`` chooses
    them; with ``projector`` (no ``--mmproj none``), the repo's projector too. ModelError when none fits,
    listing the quants the repo has."""
    ggufs = sorted(f for f in repo_files if f.lower().endswith(".gguf"))
    models = [f for f in ggufs if not _is_projector(f) and _leads_its_set(f)]
    if name.file is not None:
        if name.file not in ggufs:
            raise ModelError(f"{name.repo} has no file {name.file}. Its GGUF files: {_listed(ggufs)}.")
        first = name.file
    else:
        first = _by_quant(name, models)
    files = _whole_set(name, first, ggufs)
    quant = quant_of(first)
    chosen_projector = _projector(first, quant, [f for f in ggufs if _is_projector(f)]) if projector else None
    return HubChoice(files, chosen_projector, quant)


def quant_of(path: str) -> str:
    """The quant a GGUF's file name says (``Q4_K_M``), or its name without ``.gguf`` when it says none."""
    stem = _set_stem(path)
    found = _QUANT_IN_NAME.findall(stem)
    return found[-1] if found else stem


def repo_quants(repo_files: Iterable[str]) -> list[str]:
    """The quants a repo offers, one per model (a split set counts once), sorted."""
    ggufs = (f for f in repo_files if f.lower().endswith(".gguf"))
    return sorted({quant_of(f) for f in ggufs if not _is_projector(f) and _leads_its_set(f)}, key=str.upper)


def _by_quant(name: HubModelName, models: list[str]) -> str:
    if not models:
        raise ModelError(f"{name.repo} has no GGUF model files. llama.cpp needs a GGUF: look for a repo whose name "
                         "ends in -GGUF, or convert the model with llama.cpp's convert_hf_to_gguf.py.")
    for tag in (name.quant,) if name.quant is not None else DEFAULT_QUANTS:
        pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?=[./-])", re.IGNORECASE)
        found = [f for f in models if pattern.search(f)]
        if found:
            return found[0]
    if name.quant is None:
        return models[0]
    raise ModelError(f"{name.repo} has no {name.quant} quant. It has: {', '.join(repo_quants(models))}. "
                     f"Name one, as in {PREFIX}{name.repo}:{repo_quants(models)[0]}.")


def _whole_set(name: HubModelName, first: str, ggufs: list[str]) -> tuple[str, ...]:
    """``first`` alone, or every shard of the split set it is in (any shard named means the set)."""
    shard = shard_name(first)
    if shard is None:
        return (first,)
    folder = PurePosixPath(first).parent
    files = tuple(str(folder / shard.of(number)) if str(folder) != "." else shard.of(number)
                  for number in range(1, shard.count + 1))
    missing = [f for f in files if f not in ggufs]
    if missing:
        raise ModelError(f"{name.repo} lists {shard.count - len(missing)} of the {shard.count} shards of "
                         f"{shard.prefix} (missing: {_listed(missing)}): the upload is incomplete. Choose another "
                         "quant, or ask the repo's owner.")
    return files


def _projector(model: str, quant: str, projectors: list[str]) -> str | None:
    """The projector for ``model``: one in its folder when there is one; the one naming its quant, else
    f16, bf16, f32, else the first."""
    folder = PurePosixPath(model).parent
    near = [p for p in projectors if PurePosixPath(p).parent == folder] or projectors
    if not near:
        return None
    for tag in (quant, *PROJECTOR_PREFERENCE):
        pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?=[.-])", re.IGNORECASE)
        found = [p for p in near if pattern.search(PurePosixPath(p).name)]
        if found:
            return found[0]
    return near[0]


def _is_projector(path: str) -> bool:
    return PROJECTOR_MARK in PurePosixPath(path).name.lower()


def _leads_its_set(path: str) -> bool:
    """A single GGUF, or the first shard of a split set (so a set counts once)."""
    shard = shard_name(path)
    return shard is None or shard.number == 1


def _set_stem(path: str) -> str:
    name = PurePosixPath(path).name
    shard = shard_name(name)
    return shard.prefix if shard is not None else name[: -len(".gguf")]


def _listed(names: list[str], most: int = 12) -> str:
    if not names:
        return "none"
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def transfer_note(done_bytes: int, total_bytes: int, fetched_bytes: int, elapsed_s: float) -> str:
    """``"12.5 MiB/s, 1 min 20 s left"``: the rate of this run's ``fetched_bytes`` in ``elapsed_s``, and the
    time the rest of ``total_bytes`` takes at it."""
    if fetched_bytes <= 0 or elapsed_s <= 0:
        return "starting"
    rate = fetched_bytes / elapsed_s
    left_s = round(max(total_bytes - done_bytes, 0) / rate)
    left = f"{left_s // 60} min {left_s % 60} s" if left_s >= 60 else f"{left_s} s"
    return f"{rate / MIB:.1f} MiB/s, {left} left"


# --- resolving: the hub and its cache ----------------------------------------------------------


@dataclass(frozen=True)
class RepoFile:
    """A file of the repo as the hub lists it: its size, and the name of its blob in the cache (the
    sha256 for a file in LFS, the git blob id otherwise)."""

    name: str
    size_bytes: int
    sha256: str | None  # the hub's LFS sha256; None for a small file kept in git
    blob_id: str

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class RepoListing:
    """A repo's files at one commit."""

    commit: str
    files: dict[str, RepoFile]


@dataclass(frozen=True)
class ResolvedModel:
    """A hub model in the cache, ready for llama.cpp."""

    model_path: Path  # the model's file, or a split set's first shard, in snapshots/<commit>/ (the shards beside)
    projector_path: Path | None
    repo: str
    revision: str  # the commit the files are from
    sha256: str  # the model file's (a split set's first shard's) sha256, as the hub publishes it
    # Every file of the model and its projector with the sha256 its bytes were checked against on arrival.
    checked_sha256s: tuple[tuple[Path, str], ...] = ()


def resolve(name: HubModelName, *, progress: ProgressCallback, offline: bool = False, projector: bool = True,
            endpoint: str | None = None, cache_dir: Path | None = None, token: str | None = None) -> ResolvedModel:
    """The files of ``name`` in the hub's cache, fetched when missing (resumed when a start was cut).

    Files already cached mean no network call. ``offline`` (or ``HF_HUB_OFFLINE=1``) uses the cache only.
    ``endpoint``, ``cache_dir`` and ``token`` default to huggingface_hub's (``HF_ENDPOINT``,
    ``HF_HUB_CACHE``/``HF_HOME``, ``HF_TOKEN`` or a ``hf auth login``). ModelError says what to do.
    """
    storage = Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=name.repo, repo_type="model")
    offline = offline or constants.is_offline_mode()
    cached = _read_listing(storage)
    if cached is not None:
        try:
            choice = choose_files(name, cached.files, projector=projector)
        except ModelError:
            if offline:
                raise
        else:  # a quant the repo lacked then may be there now: only a choice made and cached ends here
            if all(_pointer(storage, cached.commit, f).exists() for f in choice.files):
                return _resolved(name, storage, cached, choice)
    if offline:
        raise ModelError(f"{name} is not in the cache ({storage}) and the node is offline. Start once with the "
                         "network (HF_HUB_OFFLINE unset) to download it.")
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    listing = _fetch_listing(name, endpoint, token)
    _write_listing(storage, listing)
    choice = choose_files(name, listing.files, projector=projector)
    wanted = [listing.files[f] for f in choice.files]
    _check_space(storage, wanted)
    for file in wanted:
        if not _pointer(storage, listing.commit, file.name).exists():
            _fetch_file(_Source(name, listing.commit, endpoint, token), file, storage, progress)
    return _resolved(name, storage, listing, choice)


def _resolved(name: HubModelName, storage: Path, listing: RepoListing, choice: HubChoice) -> ResolvedModel:
    model = listing.files[choice.model_files[0]]
    files = [listing.files[f] for f in choice.files]
    return ResolvedModel(
        model_path=_pointer(storage, listing.commit, model.name),
        projector_path=_pointer(storage, listing.commit, choice.projector) if choice.projector else None,
        repo=name.repo, revision=listing.commit, sha256=model.sha256 or "",
        checked_sha256s=tuple((_pointer(storage, listing.commit, f.name), f.sha256) for f in files if f.sha256))


@dataclass(frozen=True)
class HubLocation:
    """Where a file of the hub's cache came from."""

    repo: str  # USER/REPO
    revision: str  # the commit of its snapshot
    file: str  # its path in the repo


def hub_location(path: Path | str) -> HubLocation | None:
    """The repo, commit and path of a file in the hub's cache (``.../models--USER--REPO/snapshots/<commit>/
    FILE``); None for a file elsewhere."""
    parts = PurePosixPath(path).parts
    at = next((i for i in range(len(parts) - 3, 0, -1)
               if parts[i] == "snapshots" and parts[i - 1].startswith("models--")), None)
    if at is None:
        return None
    owner_repo = parts[at - 1][len("models--"):].split("--")
    if len(owner_repo) != 2:
        return None
    return HubLocation("/".join(owner_repo), parts[at + 1], "/".join(parts[at + 2:]))


def hub_name_of(path: Path | str) -> str | None:
    """The ``hf:`` name of a model file in the hub's cache: ``hf:USER/REPO:QUANT`` when the file name says its
    quant, else ``hf:USER/REPO/FILE``; None for a file elsewhere. What `status` and `plan` show, so a model
    named on the hub is shown by that name."""
    location = hub_location(path)
    if location is None:
        return None
    quants = _QUANT_IN_NAME.findall(_set_stem(location.file))
    return str(HubModelName(location.repo, quant=quants[-1]) if quants else HubModelName(location.repo,
                                                                                         file=location.file))


def _pointer(storage: Path, commit: str, file: str) -> Path:
    return storage / "snapshots" / commit / file


def _fetch_listing(name: HubModelName, endpoint: str, token: str | None) -> RepoListing:
    """The repo's files with their sizes and sha256s, from the hub."""
    with _hub_errors(name, endpoint, token, "list its files"):
        info = HfApi(endpoint=endpoint, token=token).model_info(name.repo, revision=REVISION, files_metadata=True)
    files = {}
    for sibling in info.siblings or ():
        sha256 = sibling.lfs.sha256 if sibling.lfs is not None else None
        size = sibling.lfs.size if sibling.lfs is not None else sibling.size
        files[sibling.rfilename] = RepoFile(sibling.rfilename, size or 0, sha256, sibling.blob_id or "")
    if not info.sha:
        raise ModelError(f"{endpoint} gave no commit for {name.repo}: is HF_ENDPOINT a Hugging Face hub?")
    return RepoListing(info.sha, files)


@contextmanager
def _hub_errors(name: HubModelName, endpoint: str, token: str | None, doing: str) -> Iterator[None]:
    """The hub's errors, and the network's, as ModelErrors that say what to do."""
    try:
        yield
    except GatedRepoError as exc:
        raise ModelError(
            f"{name.repo} is gated: its owner grants access. Accept its terms at {endpoint}/{name.repo} "
            "while logged in, then set HF_TOKEN to a token of that account (or run `hf auth login`)."
            + (" The token given was refused for it." if _has_token(token) else "")) from exc
    except RepositoryNotFoundError as exc:
        raise ModelError(
            f"{endpoint} has no model repo {name.repo}. Check the name (USER/REPO, as in its address); a "
            "private repo needs HF_TOKEN set to a token that may read it.") from exc
    except RevisionNotFoundError as exc:
        raise ModelError(f"{name.repo} has no branch {REVISION!r} on {endpoint}.") from exc
    except HfHubHTTPError as exc:
        raise ModelError(f"{endpoint} refused to {doing} of {name.repo}: {exc}. Try again later; a download "
                         "already started resumes where it stopped.") from exc
    except httpx2.TransportError as exc:
        raise ModelError(f"Cannot reach {endpoint} to {doing} of {name.repo}: {exc or type(exc).__name__}. Check "
                         "the network (or HF_ENDPOINT, for a mirror); a download already started resumes where "
                         "it stopped on the next start.") from exc


def _has_token(token: str | None) -> bool:
    return "authorization" in build_hf_headers(token=token)


def _listing_path(storage: Path) -> Path:
    return storage / LISTING_DIR / f"{REVISION}.json"


def _read_listing(storage: Path) -> RepoListing | None:
    """The listing the last online start wrote, or None (none, or unreadable: then the hub is asked)."""
    try:
        document = json.loads(_listing_path(storage).read_text())
        files = {f["name"]: RepoFile(f["name"], int(f["size"]), f["sha256"], f["blob_id"])
                 for f in document["files"]}
        return RepoListing(str(document["commit"]), files)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_listing(storage: Path, listing: RepoListing) -> None:
    path = _listing_path(storage)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"commit": listing.commit,
                "files": [{"name": f.name, "size": f.size_bytes, "sha256": f.sha256, "blob_id": f.blob_id}
                          for f in listing.files.values()]}
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(document))
    partial.replace(path)


def _check_space(storage: Path, files: list[RepoFile]) -> None:
    """ModelError before any byte is fetched when the disk under the cache cannot hold what is missing."""
    blobs = storage / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    needed = 0
    for file in files:
        if not (blobs / file.etag).exists():
            partial = _partial(blobs, file)
            needed += file.size_bytes - (partial.stat().st_size if partial.exists() else 0)
    free = shutil.disk_usage(blobs).free
    if needed and needed + SPACE_MARGIN_BYTES > free:
        raise ModelError(f"The model needs {format_gib(needed, up=True)} GiB more in {blobs}, and "
                         f"{format_gib(free)} GiB is free there. Free some space, or set HF_HUB_CACHE (or HF_HOME) "
                         "to a larger disk.")


def _partial(blobs: Path, file: RepoFile) -> Path:
    return blobs / f"{file.etag}.incomplete"


@dataclass(frozen=True)
class _Source:
    """Where a repo's files come from: the repo at a commit, on a hub, with a token or not."""

    name: HubModelName
    commit: str
    endpoint: str
    token: str | None


def _fetch_file(source: _Source, file: RepoFile, storage: Path, progress: ProgressCallback) -> None:
    """``file`` into blobs/ (resumed from its .incomplete, checked) and linked from snapshots/<commit>/."""
    blobs = storage / "blobs"
    blob = blobs / file.etag
    lock = storage.parent / ".locks" / storage.name / f"{file.etag}.lock"  # huggingface_hub's own lock
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(str(lock)):
        if not blob.exists():
            partial = _partial(blobs, file)
            _check_digest(source.name, file, partial, _download(source, file, partial, progress))
            partial.replace(blob)
    pointer = _pointer(storage, source.commit, file.name)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if not pointer.exists():
        link = pointer.with_name(f"{pointer.name}.{os.getpid()}.link")
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, pointer.parent))
        link.replace(pointer)
    ref = storage / "refs" / REVISION
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(source.commit)


def _new_digest(file: RepoFile) -> Any:
    """What the hub names ``file``'s blob by: its sha256 (LFS), or its git blob id (sha1 of a header and it)."""
    return hashlib.sha256() if file.sha256 else hashlib.sha1(b"blob %d\0" % file.size_bytes)


def _download(source: _Source, file: RepoFile, partial: Path, progress: ProgressCallback) -> str:
    """The rest of ``file`` appended to ``partial`` (a Range request from what is there); the whole file's
    digest (hex)."""
    digest, done = _new_digest(file), 0
    if partial.exists():
        with open(partial, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
                done += len(chunk)
    if done > file.size_bytes:  # not this file's beginning: start over
        partial.unlink()
        digest, done = _new_digest(file), 0
    name = source.name
    label = f"Downloading {file.name} ({name.repo})"
    stage, next_note = f"{label}, starting", 0
    started, resumed_at = time.monotonic(), done
    progress(stage, done, file.size_bytes)
    url = hf_hub_url(name.repo, file.name, revision=source.commit, endpoint=source.endpoint)
    request_headers = {**build_hf_headers(token=source.token), "Accept-Encoding": "identity"}
    if done:
        request_headers["Range"] = f"bytes={done}-"
    try:
        with _hub_errors(name, source.endpoint, source.token, f"send {file.name}"), \
                get_session().stream("GET", url, headers=request_headers, follow_redirects=True,
                                     timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            if done and response.status_code != 206:  # the server ignored the Range: the whole file comes
                partial.unlink()
                digest, done, resumed_at = _new_digest(file), 0, 0
            with open(partial, "ab") as out:
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    if done >= next_note:  # a new note once per tenth: PlainProgress writes a line per stage
                        note = transfer_note(done, file.size_bytes, done - resumed_at, time.monotonic() - started)
                        stage, next_note = f"{label}, {note}", done + max(file.size_bytes // PROGRESS_NOTE_STEPS, 1)
                    progress(stage, min(done, file.size_bytes), file.size_bytes)
    except OSError as exc:
        raise ModelError(f"The download of {file.name} ({name.repo}) stopped at {done / MIB:.0f} of "
                         f"{file.size_bytes / MIB:.0f} MiB: {exc.strerror or exc}. Start again: it resumes where "
                         "it stopped.") from exc
    if done != file.size_bytes:
        raise ModelError(f"The download of {file.name} ({name.repo}) ended at {done} of {file.size_bytes} bytes. "
                         "Start again: it resumes where it stopped.")
    return str(digest.hexdigest())


def fetch_range(repo: str, revision: str, file: str, offset: int, size_bytes: int, out: BinaryIO, *,
                endpoint: str | None = None, token: str | None = None) -> None:
    """Bytes [offset, offset + size_bytes) of ``file`` in ``repo`` at ``revision`` written to ``out``: one
    Range request (llama/layer_fetch.py takes a worker's tensors so). ModelError if they do not all come."""
    name = HubModelName(repo, file=file)
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    url = hf_hub_url(repo, file, revision=revision, endpoint=endpoint)
    headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity",
               "Range": f"bytes={offset}-{offset + size_bytes - 1}"}
    done = 0
    with _hub_errors(name, endpoint, token, f"send part of {file}"), \
            get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                 timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)
        if response.status_code != 206:
            raise ModelError(f"{endpoint} does not answer range requests for {file} ({repo}), so this worker "
                             "cannot fetch only its layers; they come over the LAN instead.")
        for chunk in response.iter_bytes(CHUNK_BYTES):
            out.write(chunk[:size_bytes - done])
            done += len(chunk)
    if done != size_bytes:
        raise ModelError(f"{endpoint} sent {done} of the {size_bytes} bytes asked of {file} ({repo}) from byte "
                         f"{offset}.")


def _check_digest(name: HubModelName, file: RepoFile, partial: Path, digest: str) -> None:
    """ModelError, the file removed so that the next start fetches it afresh, unless it hashes to what the
    hub published for it."""
    if digest == file.etag:
        return
    partial.unlink(missing_ok=True)
    kind = "sha256" if file.sha256 else "git blob id"
    raise ModelError(f"{file.name} ({name.repo}) arrived with {kind} {digest}, but the hub publishes "
                     f"{file.etag}: it was damaged on the way or altered (a proxy, or a mirror set by HF_ENDPOINT?). "
                     "Nothing was kept: start again to download it afresh.")
