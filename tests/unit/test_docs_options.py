"""docs/cli.md's option tables say what the CLI has: names, defaults and environment variables.

test_docs.py checks the other way round (every option the CLI has is named in its section). Here each
row of an option table in a ``## `mesh-inference ...``` section is read, and

- every option it names (``--x``, ``-x``) is an option of that command;
- a default it states as a value (``Default 4096``, ``Default `f16```, ``Default: on``, ```speed` (the
  default)``) is the option's default in the typer app, or, for an option whose default is computed when
  the node starts (``None`` in the app, e.g. ``--port``), a value its own help text gives as the default;
- an environment variable it names (``Env: `MESH_HOME```) is the option's ``envvar`` or named in its help.

The CLI comes from the app's click objects (``typer.main.get_command``), never from scraping ``--help``'s
output. Each failure names the option and the line of docs/cli.md. Fast: nothing is started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import click
import typer

from mesh_sidecar.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
CLI_DOC = REPO / "docs" / "cli.md"
PROGRAM = "mesh-inference"

_SECTION = re.compile(rf"^## `({re.escape(PROGRAM)}(?: [a-z][a-z0-9-]*)?)`")
_OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][a-zA-Z0-9-]*)")
_ENV = re.compile(r"Env: `([A-Z][A-Z0-9_]*)`")
# A default stated as a value: a number, a code span, or on/off. Prose ("Default: the host name") is not one.
_VALUE = r"(`[^`]+`|-?\d+(?:\.\d+)?(?!\w|\.\d)|on\b|off\b)"
_DEFAULT_AFTER = re.compile(rf"\bDefault:?\s+{_VALUE}")
_DEFAULT_BEFORE = re.compile(r"`([^`]+)`\s+\((?:the\s+)?default\)")
# In an option's help text: "(default 8080, else a free one)", "default: $MESH_HOME, else ~/.local/...".
_HELP_DEFAULT = re.compile(r"default:?\s+([^)\]]+)", re.IGNORECASE)


@dataclass(frozen=True)
class Row:
    """One row of an option table: the command's section, the line number, its option cell and its text."""

    section: str
    line: int
    names: tuple[str, ...]
    text: str

    def where(self) -> str:
        return f"docs/cli.md:{self.line} (section `{self.section}`)"


def option_rows(text: str) -> list[Row]:
    """Every table row of a command's section whose first cell names an option (``| `--x ARG` | ... |``)."""
    rows: list[Row] = []
    section = None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("## "):
            match = _SECTION.match(line)
            section = match.group(1) if match else None
            continue
        if section is None or not line.startswith("|"):
            continue
        # Cells split at unescaped pipes (`speed\|memory` is one cell); only the first cell's options count.
        first = re.split(r"(?<!\\)\|", line.strip().strip("|"))[0].strip()
        names = tuple(_OPTION.findall(" ".join(re.findall(r"`([^`]+)`", first))))
        if names and first.startswith("`-"):
            rows.append(Row(section, number, names, line))
    return rows


def commands(app: typer.Typer) -> dict[str, click.Command]:
    """Section title -> the command object: the node command itself and every subcommand."""
    root = typer.main.get_command(app)
    found: dict[str, click.Command] = {PROGRAM: root}
    for name, command in getattr(root, "commands", {}).items():
        found[f"{PROGRAM} {name}"] = command
    return found


def _param(command: click.Command, name: str) -> click.Parameter | None:
    for param in command.params:
        if name in (*param.opts, *getattr(param, "secondary_opts", ())):
            return param
    return None


def stated_default(text: str) -> str | None:
    """The default a row states as a value, without its backticks; None when it states none."""
    match = _DEFAULT_AFTER.search(text) or _DEFAULT_BEFORE.search(text)
    return None if match is None else match.group(1).strip("`")


def _same(stated: str, actual: object) -> bool:
    if isinstance(actual, bool):
        return stated.lower() in (("on", "true") if actual else ("off", "false"))
    if isinstance(actual, (int, float)):
        try:
            return float(stated) == float(actual)
        except ValueError:
            return False
    return stated == str(actual)


def default_problem(row: Row, param: click.Parameter, stated: str) -> str | None:
    """Why ``stated`` is not ``param``'s default, or None when it is."""
    actual = param.default
    if actual is not None:
        if _same(stated, actual):
            return None
        return f"{row.where()}: {row.names[0]} documented with default {stated!r}, the CLI's default is {actual!r}"
    help_text = getattr(param, "help", None) or ""
    clause = _HELP_DEFAULT.search(help_text)
    if clause and re.search(rf"(?<![\w/~.-]){re.escape(stated)}(?![\w/-])", clause.group(1)):
        return None
    return (f"{row.where()}: {row.names[0]} documented with default {stated!r}; the CLI computes it at start, "
            f"and its help says {clause.group(0) if clause else 'no default'!r}")


def problems(rows: list[Row], found: dict[str, click.Command]) -> tuple[list[str], int]:
    """(what the doc says wrongly, how many stated defaults were compared)."""
    wrong: list[str] = []
    compared = 0
    for row in rows:
        command = found.get(row.section)
        if command is None:
            wrong.append(f"{row.where()}: no command `{row.section}`")
            continue
        params = []
        for name in row.names:
            param = _param(command, name)
            if param is None:
                wrong.append(f"{row.where()}: {name} is not an option of `{row.section}`")
            elif param not in params:
                params.append(param)
        if len(params) != 1:
            continue  # an unknown name (said above), or one row for several options: no single default
        param = params[0]
        if (stated := stated_default(row.text)) is not None:
            compared += 1
            if problem := default_problem(row, param, stated):
                wrong.append(problem)
        for env in _ENV.findall(row.text):
            envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
            if env not in envvars and env not in (getattr(param, "help", None) or ""):
                wrong.append(f"{row.where()}: {row.names[0]} documented with Env: {env}, which the CLI "
                             f"neither reads for it (envvar {param.envvar!r}) nor names in its help")
    return wrong, compared


def test_cli_md_option_names_defaults_and_env_match_the_cli():
    rows = option_rows(CLI_DOC.read_text())
    found = commands(cli.app)
    assert len({row.section for row in rows}) >= len(found) - 2, "few option tables found: the row pattern is stale"
    wrong, compared = problems(rows, found)
    assert compared >= 10, f"only {compared} documented defaults compared: the default pattern is stale"
    assert not wrong, "docs/cli.md disagrees with the CLI:\n" + "\n".join(wrong)


def test_the_check_catches_a_wrong_name_default_or_variable():
    """The check above can fail: a renamed option, a changed default, a wrong variable are each named."""
    probe = typer.Typer(add_completion=False)

    @probe.command()
    def run(  # pragma: no cover - never invoked, only inspected
        ctx_size: int = typer.Option(4096, "--ctx-size"),
        kind: str = typer.Option("speed", "--plan-by"),
        cache: bool = typer.Option(True, "--cache/--no-cache"),
        port: int = typer.Option(None, "--port", help="The port (default 47470, else a free one)."),
        home: str = typer.Option(None, "--home", help="State (default: $MESH_HOME, else ~/.local/x)."),
        key: str = typer.Option(None, "--api-key", envvar="MESH_PROBE_KEY"),
    ) -> None:
        pass

    good = "\n".join([
        "## `mesh-inference`",
        "| `--ctx-size N` | Context. Default 4096. |",
        "| `--plan-by speed\\|memory` | `speed` (the default) or memory. |",
        "| `--cache` / `--no-cache` | Cache. Default: on. |",
        "| `--port N` | The port. Default 47470; else a free one. |",
        "| `--home DIR` | State. Default `~/.local/x`. Env: `MESH_HOME`. |",
        "| `--api-key KEY` | Key. Env: `MESH_PROBE_KEY`. |",
        "| `--max-memory SIZE` | Default: what is free now. |",  # prose: no value stated
    ])
    found = {PROGRAM: typer.main.get_command(probe)}
    wrong, compared = problems(option_rows(good), found)
    assert [line for line in wrong if "--max-memory" not in line] == [] and compared == 5
    assert any("--max-memory is not an option" in line for line in wrong)

    bad = (good.replace("Default 4096", "Default 2048").replace("`speed` (the default)", "`memory` (the default)")
           .replace("Default: on", "Default: off").replace("Default 47470", "Default 47471")
           .replace("Env: `MESH_PROBE_KEY`", "Env: `MESH_OTHER`").replace("`--ctx-size N`", "`--context N`"))
    wrong, _ = problems(option_rows(bad), found)
    text = "\n".join(wrong)
    for expected in ("docs/cli.md:2 (section `mesh-inference`): --context is not an option",
                     "--plan-by documented with default 'memory'", "--cache documented with default 'off'",
                     "--port documented with default '47471'", "Env: MESH_OTHER"):
        assert expected in text, f"{expected!r} not reported in:\n{text}"


# --- the systemd unit docs/platforms.md installs --------------------------------------

UNIT = REPO / "scripts" / "mesh-inference.service"
_UNIT_ENV = re.compile(r"\b(MESH_[A-Z][A-Z0-9_]*)=")


def _unit_settings(text: str) -> dict[str, str]:
    settings = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def test_the_systemd_unit_runs_the_program_with_what_the_node_reads():
    """ExecStart runs the venv's console script; every MESH_ variable it offers (MESH_ARGS aside, which
    the unit itself expands) is one the package reads; the node is signalled alone, and given time for
    its graceful leave and its drain before systemd kills it."""
    import tomllib

    from mesh_sidecar.mesh.peers import LEAVE_GRACE_S
    from mesh_sidecar.serve.supervisor import DRAIN_TIMEOUT_S

    text = UNIT.read_text()
    settings = _unit_settings(text)
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    program, *arguments = settings["ExecStart"].split()
    assert program.endswith("/.venv/bin/" + next(iter(scripts))) and arguments == ["$MESH_ARGS"], program
    read = {name for path in (REPO / "mesh_sidecar").rglob("*.py")
            for name in re.findall(r"""["'](MESH_[A-Z][A-Z0-9_]*)["']""", path.read_text())}
    offered = set(_UNIT_ENV.findall(text)) - {"MESH_ARGS"}
    assert offered and offered <= read, f"the unit offers variables the package never reads: {offered - read}"
    assert settings["KillMode"] == "mixed", "SIGTERM must reach the node alone: it stops its own children"
    assert float(settings["TimeoutStopSec"]) > LEAVE_GRACE_S + DRAIN_TIMEOUT_S
    assert "platforms.md" in settings["Documentation"] and (REPO / "docs" / "platforms.md").is_file()
