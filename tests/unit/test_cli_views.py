"""What people read in a terminal: --help, `status` and `plan`, in 80 columns and wide.

- ``--help`` of the node and of every subcommand fits 80 columns, names what an option takes
  (PORT, FILE...) instead of typer's "<list[Path]>" or "<bool>", and groups the node's options
  into panels so that the help text keeps a readable column.
- ``status`` in 80 columns cuts no cell ("…") and shows each peer's name and state whole;
  ``--wide`` (read at 160 columns) adds ids, addresses, paths and ports, still uncut. Both render
  the models in the mesh and the API line; a node that does not serve, and the older status shape
  (no "api", no "models"), still render.
- ``plan`` shows the members' "why" under the plan when the plan says it, and works without.

Fast: no node runs; the status JSON is a sample in the shape node/lifecycle.py builds.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from mesh_sidecar.cli import main as cli
from mesh_sidecar.cli.views import NAME_CHARS, api_line, plan_view, status_view

NARROW, WIDE = 80, 160
MIN_HELP_COLUMN_CHARS = 30  # the description beside an option, in 80 columns
TYPE_HINT = re.compile(r"<(?:list\[|bool|path|str|int|float|Path)\b")
ALPHA, BRAVO, CHARLIE, DELTA, ECHO = ("a1" * 32, "b2" * 32, "c3" * 32, "d4" * 32, "e5" * 32)
IPV6_ADDRESS = "[fd00:1234:5678::42]:47470"


def a_peer(node_id: str, name: str, address: str, *, health: str = "connected", rtt_ms: float = 0.8,
           offers: int = 2_000_000_000, serving: bool = False, refused: str | None = None) -> dict[str, Any]:
    """One entry of the status' "peers", as mesh/status.py's peer_json writes it."""
    return {"id": node_id, "short_id": node_id[:8], "name": name, "state": "connected", "address": address,
            "path": "direct", "via": None, "addr": address, "health": health, "rtt_ms": rtt_ms,
            "rtt_p50_ms": 0.7, "rtt_p95_ms": 1.9, "quic_rtt_ms": 1.0, "datagram_bytes": 1452,
            "missed_heartbeats": 0, "tunnel_port": 40123, "rpc_server_up": True, "serving": serving,
            "capacity": {"usable_bytes": offers}, "model_sha256": None, "secret_epoch": 0,
            "refused": refused, "refused_detail": "its rpc-server is RPC 6.0.0" if refused else None,
            "learned_via": None, "bytes_to_peer": 123_456_789, "bytes_from_peer": 2_345_678,
            "bytes_from_peer_in": 0, "bytes_to_peer_in": 0, "rpc_commands": 0, "activation_bytes_in": 0}


def a_replica(node_id: str, name: str, members: list[tuple[str, str]], *, local: bool = False,
              state: str = "ready", in_flight: int = 0) -> dict[str, Any]:
    return {"node": {"id": node_id, "name": name}, "local": local, "state": state, "in_flight": in_flight,
            "members": [{"id": member_id, "name": member} for member_id, member in members]}


HOME = "/home/someone/.local/share/mesh-inference"
PLAN = {
    "nodes": [
        {"id": BRAVO, "name": "bravo-worker", "layers": [0, 14], "weights_bytes": 70_000_000, "kv_bytes": 20_000_000,
         "output_bytes": 0, "needed_bytes": 95_000_000, "free_bytes": 2_000_000_000},
        {"id": ALPHA, "name": "alpha-server", "layers": [14, 30], "weights_bytes": 80_000_000,
         "kv_bytes": 22_000_000, "output_bytes": 30_000_000, "needed_bytes": 140_000_000,
         "free_bytes": 3_000_000_000}],
    "left_out": [], "refused": [], "n_layers": 30, "tensor_split": [14, 17],
    "model": "SmolLM2-135M-Instruct-Q8_0.gguf", "tiers": [],
}
ASSIGNMENT = [
    {"id": BRAVO, "name": "bravo-worker", "serves_with": ALPHA,
     "why": "holds layers of SmolLM2-135M-Instruct-Q8_0 for alpha-server"},
    {"id": DELTA, "name": "delta-laptop", "serves_with": CHARLIE, "why": "holds layers of tier-model for charlie-gpu1"},
    {"id": ECHO, "name": "echo-old", "serves_with": None, "why": "left out: its llama.cpp build differs"},
]
STATUS: dict[str, Any] = {
    "node": {"id": ALPHA, "short_id": ALPHA[:8], "name": "alpha-server", "version": "0.1.0",
             "llama_build": "b6123 (pinned, stock) RPC 3.0.0", "home": HOME, "uptime_s": 12.5,
             "capacity": {"usable_bytes": 3_000_000_000}},
    "model": {"path": "/home/someone/models/SmolLM2-135M-Instruct-Q8_0.gguf", "bytes": 1, "ctx_size": 4096},
    "processes": [{"name": "ggml-rpc-server", "pid": 12345, "running": True, "port": 50052,
                   "log": f"{HOME}/logs/rpc-server.log"},
                  {"name": "llama-server", "pid": 12346, "running": True, "port": 41234,
                   "log": f"{HOME}/logs/llama-server.log"}],
    "api": {"enabled": True, "port": 8081, "url": "http://localhost:8081/v1", "requires_key": False,
            "fallback_from": 8080},
    "models": [
        {"id": "SmolLM2-135M-Instruct-Q8_0", "state": "ready", "default": True,
         "replicas": [a_replica(ALPHA, "alpha-server", [(BRAVO, "bravo-worker"), (ALPHA, "alpha-server")],
                                local=True, in_flight=1)]},
        {"id": "tier-model", "state": "loading", "default": False,
         "replicas": [a_replica(CHARLIE, "charlie-gpu1", [(CHARLIE, "charlie-gpu1"), (DELTA, "delta-laptop")],
                                state="loading")]},
    ],
    "serving": {
        "api": {"port": 8081, "url": "http://localhost:8081/v1", "requires_key": False},
        "model": "/home/someone/models/SmolLM2-135M-Instruct-Q8_0.gguf", "step_up": None,
        "plan": {**PLAN, "assignment": ASSIGNMENT},
        "refusal": None, "speculation": {"reason": "n-gram lookup: the links are slow"},
        "llama_server_restarts": 0, "live": {"tokens_per_second_now": 21.5, "last_request_tokens_per_second": 19.0},
        "counters": {"requests": 3, "failovers": 0, "retries": 0, "restarts": 0},
    },
    "mesh": {"quic_port": 47470, "secret_epoch": 0, "removed": [], "lan": None},
    "peers": [a_peer(BRAVO, "bravo-worker", "192.168.100.201:47470"),
              a_peer(CHARLIE, "charlie-gpu1", IPV6_ADDRESS, rtt_ms=23.4, offers=24_000_000_000, serving=True),
              a_peer(DELTA, "delta-laptop", "10.0.0.7:47471", health="degraded", rtt_ms=145.2),
              a_peer(ECHO, "echo-old", "10.0.0.9:47470", refused="llama_build_mismatch")],
    "events": [],
}


def rendered(renderable: Any, width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def assert_fits(text: str, width: int) -> None:
    lines = text.splitlines()
    assert max(map(len, lines)) <= width, "\n".join(line for line in lines if len(line) > width)
    assert "…" not in text, text


def line_with(text: str, *parts: str) -> str:
    """The one line that has every part; fails when none has."""
    found = [line for line in text.splitlines() if all(part in line for part in parts)]
    assert found, f"no line with {parts} in:\n{text}"
    return found[0]


# --- --help --------------------------------------------------------------------------------


def help_text(*args: str) -> str:
    result = CliRunner().invoke(cli.app, [*args, "--help"], env={"COLUMNS": str(NARROW), "TERMINAL_WIDTH": ""},
                                terminal_width=NARROW)
    assert result.exit_code == 0, result.output
    return result.output


def panels(text: str) -> list[str]:
    return re.findall(r"^╭─ (.+?) ─", text, re.MULTILINE)


def root_options() -> list[Any]:
    root = typer.main.get_command(cli.app)
    return [p for p in root.params if p.param_type_name == "option" and not p.hidden]


def test_the_node_help_fits_80_columns_in_panels_with_names_not_types():
    text = help_text()
    assert_fits(text, NARROW)
    assert not TYPE_HINT.search(text), TYPE_HINT.search(text)
    option_panels = [name for name in panels(text) if name != "Commands"]
    assert option_panels == list(cli.PANEL_ORDER), option_panels
    for option, metavar in (("--serve", "PORT"), ("--model", re.escape("FILE|hf:NAME")), ("--join", "TICKET"),
                            ("--home", "DIR"), ("--max-memory", "SIZE"), ("--api-key", "KEY"),
                            ("--cors-origin", "ORIGIN")):
        assert re.search(rf"│ {re.escape(option)} +{metavar} ", text), option


def test_every_node_option_is_in_one_of_the_panels():
    """A new option must join a panel: alone in typer's "Options" it would stand above all the others."""
    unplaced = [p.opts[0] for p in root_options() if getattr(p, "rich_help_panel", None) not in cli.PANEL_ORDER]
    assert not unplaced, f"give these a rich_help_panel from cli.PANEL_ORDER: {unplaced}"


def test_the_node_help_leaves_the_description_a_readable_column():
    text = help_text()
    lines = text.splitlines()
    measured = 0
    for option in root_options():
        first_words = " ".join(option.help.split()[:2])
        row = next(line for line in lines if re.match(rf"│ {re.escape(option.opts[0])}\b", line))
        start = row.find(first_words)
        assert start > 0, (option.opts[0], row)
        # The panel's right border is the last character, with one space before it.
        width = len(row) - 2 - start
        assert width >= MIN_HELP_COLUMN_CHARS, (option.opts[0], width, row)
        measured += 1
    assert measured >= 20


@pytest.mark.parametrize("command", ["setup", "status", "ticket", "leave", "kick", "verify", "logs", "plan"])
def test_every_subcommand_help_fits_80_columns_without_type_hints(command):
    text = help_text(command)
    assert_fits(text, NARROW)
    assert not TYPE_HINT.search(text), (command, TYPE_HINT.search(text))


# --- status --------------------------------------------------------------------------------


def test_status_in_80_columns_cuts_nothing_and_shows_each_peer_whole():
    text = rendered(status_view(STATUS), NARROW)
    assert_fits(text, NARROW)
    for peer in STATUS["peers"]:
        assert len(peer["name"]) <= NAME_CHARS
    line_with(text, "bravo-worker", "connected", "0.8 ms", "1.9 GiB", "layers 0-14 for alpha-server")
    line_with(text, "charlie-gpu1", "connected", "23.4 ms", "22.4 GiB", "serves tier-model")
    line_with(text, "delta-laptop", "degraded", "145.2 ms")
    line_with(text, "echo-old", "refused")
    assert "echo-old: llama_build_mismatch: its rpc-server is RPC 6.0.0." in text
    # The long values wait for --wide.
    for long_value in (IPV6_ADDRESS, BRAVO[:8], f"{HOME}/logs/rpc-server.log"):
        assert long_value not in text, long_value
    line_with(text, "ggml-rpc-server", "running", "50052", "rpc-server.log")
    assert "Mesh: 4 peer(s) connected" in text and "failovers 0" in text
    assert "reached over QUIC only" not in text


def test_status_says_the_tcp_port_and_warns_when_a_peer_with_a_relay_is_reached_over_quic():
    # Issue 52: a user who opened only UDP in the firewall got the QUIC path silently.
    peers = [{**peer, "data_port": 47470, "data_path": "tcp+tls" if peer["name"] == "bravo-worker" else "quic"}
             for peer in STATUS["peers"]]
    status = {**STATUS, "mesh": {**STATUS["mesh"], "data_port": 47470}, "peers": peers}
    text = " ".join(rendered(status_view(status), NARROW).split())
    assert "UDP port 47470, TCP port 47470 (data path)" in text
    # delta is degraded but connected; echo is refused but connected: both reached directly over QUIC.
    assert "charlie-gpu1, delta-laptop, echo-old: reached over QUIC only" in text
    assert "bravo-worker, charlie-gpu1" not in text  # its layers take the native path
    without_relay = " ".join(rendered(status_view({**status, "mesh": STATUS["mesh"]}), NARROW).split())
    assert "TCP port" not in without_relay and "reached over QUIC only" not in without_relay


def test_status_shows_the_models_in_the_mesh_and_where_the_api_is():
    text = rendered(status_view(STATUS), NARROW)
    assert "Models in the mesh" in text
    line_with(text, "SmolLM2-135M-Instruct-Q8_0", "ready", "alpha-server", "bravo-worker", "1")
    assert "(here)" in text
    line_with(text, "tier-model", "loading", "charlie-gpu1")
    assert "Requests naming no model go to SmolLM2-135M-Instruct-Q8_0." in text
    assert "API: http://localhost:8081/v1 (port 8080 was taken)" in text
    # The plan's members, and why each is where it is.
    line_with(text, "delta-laptop", "holds layers of tier-model for charlie-gpu1")
    line_with(text, "echo-old", "left out: its llama.cpp build differs")


def test_status_wide_at_160_columns_shows_ids_addresses_and_paths_uncut():
    text = rendered(status_view(STATUS, wide=True), WIDE)
    assert_fits(text, WIDE)
    line_with(text, "charlie-gpu1", CHARLIE[:8], IPV6_ADDRESS, "direct", "40123", "117.7/2.2")
    line_with(text, "bravo-worker", "192.168.100.201:47470", "0.8 (0.7/1.9)")
    assert f"{HOME}/logs/llama-server.log" in text and f"id: {ALPHA}" in text
    line_with(text, "alpha-server (here)", ALPHA[:8])
    line_with(text, "delta-laptop", DELTA[:8], "c3c3c3c3")  # serves with a node outside this plan: its id


def test_status_of_a_node_that_does_not_serve_and_of_an_older_node():
    worker = copy.deepcopy(STATUS)
    worker["serving"] = None
    worker["api"] = {"enabled": False, "port": None, "url": None, "requires_key": False, "fallback_from": None}
    text = rendered(status_view(worker), NARROW)
    assert_fits(text, NARROW)
    assert "API off" in text and "Current plan" not in text and "Models in the mesh" in text

    older = copy.deepcopy(STATUS)
    del older["api"], older["models"]
    older["serving"]["api"]["requires_key"] = True
    text = rendered(status_view(older), NARROW)
    assert "API: http://localhost:8081/v1 (needs the API key)  requests 3, failovers 0" in text
    assert "Models in the mesh" not in text and "Current plan" in text

    nothing = copy.deepcopy(worker)
    nothing["models"] = []
    assert "none served now" in rendered(status_view(nothing), NARROW)

    no_file = copy.deepcopy(worker)  # started without --model: it holds no model file
    no_file["model"] = {"path": None, "bytes": 0, "ctx_size": 4096}
    text = rendered(status_view(no_file), NARROW)
    assert_fits(text, NARROW)
    assert "model: none held (a worker" in text


def test_status_marks_a_model_that_takes_images():
    vision = copy.deepcopy(STATUS)
    vision["models"][0]["vision"] = True
    assert f"{vision['models'][0]['id']} (images)" in rendered(status_view(vision), WIDE)


def test_api_line_says_off_fallback_and_key():
    assert api_line(None, None) == "API off"
    assert api_line({"enabled": False}, None).startswith("API off")
    api = {"enabled": True, "port": 9000, "url": "http://localhost:9000/v1", "requires_key": True,
           "fallback_from": 8080}
    assert api_line(api, None) == "API: http://localhost:9000/v1 (port 8080 was taken; needs the API key)"


def test_names_from_other_machines_are_shown_as_written_not_as_markup():
    status = copy.deepcopy(STATUS)
    status["peers"][0]["name"] = "[red]x[/red]"
    for wide, width in ((False, NARROW), (True, WIDE)):
        assert "[red]x[/red]" in rendered(status_view(status, wide=wide), width)
    assert IPV6_ADDRESS in rendered(status_view(status, wide=True), WIDE)  # brackets and all


def test_the_status_command_prints_the_view_and_the_json(monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "read_status", lambda home: STATUS)
    runner = CliRunner()
    narrow = runner.invoke(cli.app, ["status", "--home", str(tmp_path)], env={"COLUMNS": str(NARROW)})
    assert narrow.exit_code == 0, narrow.output
    assert_fits(narrow.output, NARROW)
    assert "Models in the mesh" in narrow.output and IPV6_ADDRESS not in narrow.output
    wide = runner.invoke(cli.app, ["status", "--wide", "--home", str(tmp_path)], env={"COLUMNS": str(WIDE)})
    assert wide.exit_code == 0 and IPV6_ADDRESS in wide.output, wide.output
    as_json = runner.invoke(cli.app, ["status", "--json", "--home", str(tmp_path)])
    assert json.loads(as_json.output) == STATUS


# --- plan --------------------------------------------------------------------------------


def test_plan_shows_the_members_why_when_the_plan_has_it_and_works_without():
    text = rendered(plan_view({**PLAN, "assignment": ASSIGNMENT}), NARROW)
    assert_fits(text, NARROW)
    assert text.startswith("Plan: SmolLM2-135M-Instruct-Q8_0.gguf, 30 layers")
    line_with(text, "bravo-worker", "[0, 14)", "0.07")
    line_with(text, "alpha-server", "[14, 30) + output")
    assert "Members" in text
    line_with(text, "bravo-worker", "holds layers of SmolLM2-135M-Instruct-Q8_0 for alpha-server")

    plain = rendered(plan_view(PLAN), NARROW)
    assert_fits(plain, NARROW)
    assert "Members" not in plain and "bravo-worker" in plain and BRAVO[:8] not in plain
    wide = rendered(plan_view({**PLAN, "assignment": ASSIGNMENT}, wide=True), WIDE)
    line_with(wide, "bravo-worker", BRAVO[:8], "alpha-server", "holds layers")
    line_with(wide, "echo-old", ECHO[:8], "-", "left out")


def test_the_plan_command_prints_the_plan_and_its_members(monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "read_plan", lambda home, model, ctx_size: {**PLAN, "assignment": ASSIGNMENT})
    result = CliRunner().invoke(cli.app, ["plan", "--home", str(tmp_path)], env={"COLUMNS": str(NARROW)})
    assert result.exit_code == 0, result.output
    assert_fits(result.output, NARROW)
    assert "Members" in result.output and "holds layers of tier-model" in result.output


def test_plan_says_where_an_image_projector_sits_and_its_size():
    assert "Image projector" not in rendered(plan_view(PLAN), WIDE)
    small = " ".join(rendered(plan_view({**PLAN, "projector_bytes": 5 * 1024 * 1024}), WIDE).split())  # unwrapped
    assert "Image projector (--mmproj): 5.0 MiB on the serving node's CPU, beside its layers." in small
    large = " ".join(rendered(plan_view({**PLAN, "projector_bytes": 3 * 1024**3}), WIDE).split())
    assert "Image projector (--mmproj): 3.0 GiB on the serving node's CPU" in large
