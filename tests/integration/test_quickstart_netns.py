"""docs/quickstart.md followed as written, on three fresh machines: network namespaces A, B and C on a bridge,
each with a home of its own (only the llama.cpp build and the default model are shared, as the bootstrap
would have left them) and the quickstart's own ports (47470, 8080).

The commands are read from the quickstart's sections, so the page and this test cannot drift apart: A starts
the mesh, B joins with A's ticket, C joins and serves the model the page names by its hub name. The hub is a
local one (tests/helpers/local_hub.py) in C's namespace, holding that repo with the default model's bytes
under the page's file name (C finds it through HF_ENDPOINT, as a mirror). C also takes `--spread`, which the
page gives for a model that fits on C alone, so the split spans all three. Then the page's first request
(curl) is answered on A, and every member reaches every other on the native path (`tcp+tls`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mesh_sidecar.home import cache_root
from mesh_sidecar.llama.hub_models import parse_model_name
from mesh_sidecar.llama.model import ensure_model
from tests.helpers.llama import quiet
from tests.helpers.netns import Lab, can_make_namespaces, ticket_of
from tests.helpers.nodes import NodeProcess, cli
from tests.helpers.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(not can_make_namespaces(), reason="needs root and `ip netns`"),
]

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
HUB_PORT = 5000  # inside C's namespace
TICKET_PLACEHOLDER = re.compile(r"meshinf[a-z0-9]+\.\.\.")
LOAD_TIMEOUT_S = 240


def commands_under(heading: str) -> list[list[str]]:
    """The commands of the first bash block after ``heading`` in the quickstart, continuation lines joined
    and comments dropped, each split as the shell would."""
    text = QUICKSTART.read_text()
    at = text.index(f"\n## {heading}\n")
    block = re.search(r"```bash\n(.*?)```", text[at:], re.DOTALL)
    assert block, f"no bash block under '## {heading}' in {QUICKSTART}"
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if shlex.split(line, comments=True)]


def as_run(argv: list[str], ticket: str | None = None) -> list[str]:
    """A quickstart command as this test runs it: `mesh-inference` is this interpreter's module, the page's
    sample ticket the mesh's own."""
    if ticket is not None:
        argv = [TICKET_PLACEHOLDER.sub(ticket, arg) for arg in argv]
    return [sys.executable, "-m", "mesh_sidecar", *argv[1:]] if argv[0] == "mesh-inference" else argv


def machine_env(root: Path, name: str, **more: str) -> dict[str, str]:
    """A fresh machine's environment: a HOME of its own (its node's home and hub cache under it), the build
    and default model where the bootstrap put them."""
    home = root / f"machine-{name}"
    home.mkdir()
    return {**os.environ, "HOME": str(home), "MESH_CACHE": str(cache_root()), **more}


def start(host, root: Path, argv: list[str], env: dict[str, str]) -> NodeProcess:
    output = root / f"{host.name}.out"
    proc = subprocess.Popen(host.exec_argv(*argv), stdout=open(output, "w"), stderr=subprocess.STDOUT, env=env)
    return NodeProcess(Path(env["HOME"]) / ".local" / "share" / "mesh-inference", proc, output,
                       prefix=host.exec_argv())


def test_the_quickstart_as_written_gives_a_split_on_the_native_path(tmp_path):
    (start_a,) = commands_under("Start machine A")
    (join_b,) = commands_under("Join machine B")
    (join_c,) = commands_under("Join machine C, which serves the model")
    model_name = join_c[join_c.index("--model") + 1]
    hub_model = parse_model_name(model_name)
    assert hub_model is not None and hub_model.quant, f"the quickstart's C names no hf: model: {join_c}"
    repo_file = f"{hub_model.repo.split('/')[1].removesuffix('-GGUF')}-{hub_model.quant}.gguf"
    default_model = ensure_model(None, quiet)
    lab, nodes, hub = Lab(), [], None
    try:
        a_host, b_host, c_host = (lab.add_host(name) for name in "abc")
        hub = subprocess.Popen(c_host.exec_argv(sys.executable, "-m", "tests.helpers.local_hub", "--port",
                                                str(HUB_PORT), "--repo", hub_model.repo, "--file",
                                                f"{repo_file}={default_model}"),
                               stdout=subprocess.PIPE, text=True)
        assert hub.stdout is not None and hub.stdout.readline().startswith("http://127.0.0.1:")
        a = start(a_host, tmp_path, as_run(start_a), machine_env(tmp_path, "a"))
        nodes.append(a)
        ticket = ticket_of(a)
        nodes.append(start(b_host, tmp_path, as_run(join_b, ticket), machine_env(tmp_path, "b")))
        c = start(c_host, tmp_path, as_run(join_c, ticket) + ["--spread"],
                  machine_env(tmp_path, "c", HF_ENDPOINT=f"http://127.0.0.1:{HUB_PORT}"))
        nodes.append(c)
        wait_until(lambda: "API ready" in c.text() or c.proc.poll() is not None, LOAD_TIMEOUT_S, "C serves")
        assert c.proc.poll() is None, c.text()
        for node in nodes:
            node.extra_pids = node.child_pids()
        plan = c.status()["serving"]["plan"]
        assert len({n["id"] for n in plan["nodes"]}) == 3, plan  # a split over all three
        # The page's first request, on A, which serves nothing: answered by C's model over the mesh.
        curl = next(argv for argv in commands_under("First request") if "chat/completions" in " ".join(argv))
        answer = subprocess.run(a_host.exec_argv(*curl), capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0 and json.loads(answer.stdout)["choices"][0]["message"]["content"], answer
        # Every member reaches every other on the native path.
        for node in nodes:
            wait_until(lambda node=node: [p["data_path"] for p in node.status()["peers"]] == ["tcp+tls"] * 2, 30,
                       f"{node.home} reaches both others over tcp+tls")
        shown = cli("status", "--home", str(c.home), prefix=c_host.exec_argv(), env={"COLUMNS": "200"}).stdout
        assert model_name in " ".join(shown.split()), shown  # the model shown by its hub name
    finally:
        for node in nodes:
            node.stop_with_children()
        if hub is not None:
            hub.kill()
            hub.wait()
        lab.close()
