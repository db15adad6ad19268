"""A member without package access (an offline lab, a machine behind a proxy), with real processes:
without --model it fetches no model, joins, offers its memory and holds layers; without a llama.cpp
build it takes the pinned source from the member its ticket names (checked by its sha256) and goes
on to build it; with neither a build, an index nor a ticket it says what to do.

Such a node gets a cache of its own (the machine's, less what the test takes away) and pip an index
that nothing answers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mesh_sidecar import environment
from mesh_sidecar.home import cache_root
from mesh_sidecar.llama.build import SDIST_SHA256, SOURCES_DIR_NAME, ensure_source_archive, pinned_build_dir
from mesh_sidecar.llama.model import default_model_path, file_sha256
from tests.helpers.llama import complete, quiet
from tests.helpers.nodes import TICKET_LINE, cli
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"  # the discard port: nothing listens


def offline_cache(root: Path, *without: Path) -> dict[str, str]:
    """The environment of a node whose cache is this machine's without ``without``, and whose pip reaches
    no index."""
    root.mkdir()
    for entry in cache_root().iterdir():
        if entry not in without:
            (root / entry.name).symlink_to(entry)
    return {environment.CACHE_ENV: str(root), "PIP_INDEX_URL": UNREACHABLE_INDEX, "PIP_CONFIG_FILE": "/dev/null",
            "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}


def test_a_worker_without_package_access_joins_and_holds_layers(start_node, tmp_path, reference_text):
    offline = offline_cache(tmp_path / "offline-cache", default_model_path().parent)  # the builds, no model

    server = start_node("server", "--min-peers", "1", serve=True, wait=False)
    ticket = wait_until(lambda: TICKET_LINE.search(server.text()), 60, "the server's ticket").group(1)
    worker = start_node("worker", "--join", ticket, env=offline)
    server.wait_ready()
    plan = wait_until(lambda: server.status()["serving"]["plan"], 90, "a plan")
    held = {n["name"]: n["layers"][1] - n["layers"][0] for n in plan["nodes"]}
    assert held.get("worker", 0) > 0, held
    assert complete(server.serve_port) == reference_text

    status = worker.status()
    assert status["model"]["path"] is None and status["node"]["capacity"]["usable_bytes"] > 0
    assert "Downloading" not in worker.text()
    assert not (tmp_path / "offline-cache" / default_model_path().parent.name).exists()


def test_a_node_without_a_build_takes_the_source_from_a_member_and_builds_it(start_node, tmp_path):
    ensure_source_archive(quiet)  # what `setup` keeps on this member (downloaded here if it is not yet)
    member = start_node("member")
    cache = tmp_path / "bare-cache"
    bare = offline_cache(cache, pinned_build_dir(), cache_root() / SOURCES_DIR_NAME)
    # No cmake on its PATH, only git (it patches the source): the build stops at its first step once the
    # source is in and patched, instead of compiling.
    only_git = tmp_path / "only-git"
    only_git.mkdir()
    (only_git / "git").symlink_to(shutil.which("git"))
    no_cmake = {**bare, "PATH": str(only_git)}
    joined = cli("--home", str(tmp_path / "home"), "--no-mdns", "--join", member.ticket(), env=no_cmake,
                 timeout=300)
    assert joined.returncode == 1
    assert "taking the llama.cpp source from the member the ticket names" in joined.stdout, joined.stdout
    assert "`cmake` is not installed; it is needed to build llama.cpp" in joined.stderr, joined.stderr
    kept = cache / SOURCES_DIR_NAME / ensure_source_archive(quiet).name
    assert file_sha256(kept) == SDIST_SHA256
    assert (cache / pinned_build_dir().name / "src" / "CMakeLists.txt").exists()  # unpacked for the build

    # Without a ticket, nothing to take it from: the error says what to do.
    alone = cli("--home", str(tmp_path / "home2"), "--no-mdns", env=offline_cache(
        tmp_path / "bare-cache-2", pinned_build_dir(), cache_root() / SOURCES_DIR_NAME), timeout=300)
    assert alone.returncode == 1
    for advice in ("Could not download the llama.cpp source", "--join TICKET", "--llama-bin"):
        assert advice in alone.stderr, alone.stderr
