"""The docs keep up with the code.

- docs/cli.md has a section per command (``## `mesh-inference```, ``## `mesh-inference status```...)
  naming every long option, argument and environment variable of that command. The commands
  and options come from the CLI's own command objects (what ``--help`` prints), not from
  parsing help text, so a new option fails here until it is documented.
- Every environment variable the package reads (a quoted ``"MESH_..."`` string) is in docs/cli.md.
- Every relative link in README.md and docs/*.md points to an existing file, and an anchor
  into a Markdown file names one of its headings.

Fast: no node and no llama.cpp are started.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from mesh_sidecar.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
CLI_DOC = DOCS / "cli.md"
PACKAGE = REPO / "mesh_sidecar"
PROGRAM = "mesh-inference"
LINKED_DOCS = sorted([REPO / "README.md", *DOCS.glob("*.md")])

_SECTION = re.compile(rf"^## `({re.escape(PROGRAM)}(?: [a-z][a-z0-9-]*)?)`", re.MULTILINE)
_ENV_STRING = re.compile(r"""["'](MESH_[A-Z][A-Z0-9_]*)["']""")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


# --- what the CLI has ------------------------------------------------------------


def _commands() -> list[tuple[str, object]]:
    """(section title, command object): the node command itself, then every visible subcommand."""
    root = typer.main.get_command(cli.app)
    found = [(PROGRAM, root)]
    for name, command in sorted(getattr(root, "commands", {}).items()):
        if not command.hidden:
            found.append((f"{PROGRAM} {name}", command))
    return found


def _names(command) -> list[str]:
    """What a reader must find documented: long options (both sides of --x/--no-x), arguments, env vars."""
    names: list[str] = []
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        if param.param_type_name == "option":
            names += [opt for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")]
        elif param.param_type_name == "argument":
            names.append(param.metavar or param.name.upper())
        envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
        names += envvars
    return names


def _mentions(text: str, name: str) -> bool:
    """``name`` as a whole word: ``--model`` is not found inside ``--draft-model``."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def undocumented(command, section: str) -> list[str]:
    """The command's options, arguments and env vars that its doc section never names."""
    return [name for name in _names(command) if not _mentions(section, name)]


def doc_sections(text: str) -> dict[str, str]:
    """cli.md's ``## `mesh-inference ...``` sections: title -> its text, up to the next ``## `` heading."""
    sections = {}
    for chunk in re.split(r"^(?=## )", text, flags=re.MULTILINE):
        if match := _SECTION.match(chunk):
            sections[match.group(1)] = chunk
    return sections


# --- the CLI against docs/cli.md -------------------------------------------------------


def test_every_command_has_a_section_in_cli_md():
    sections = doc_sections(CLI_DOC.read_text())
    missing = [title for title, _ in _commands() if title not in sections]
    assert not missing, f"docs/cli.md has no '## `...`' section for: {missing}"


@pytest.mark.parametrize("title, command", _commands(), ids=[title for title, _ in _commands()])
def test_every_option_and_argument_is_in_its_section(title, command):
    section = doc_sections(CLI_DOC.read_text()).get(title, "")
    missing = undocumented(command, section)
    assert not missing, f"docs/cli.md, section `{title}`, does not document: {missing}"


def test_every_environment_variable_the_package_reads_is_documented():
    text = CLI_DOC.read_text()
    used = {name for path in PACKAGE.rglob("*.py") for name in _ENV_STRING.findall(path.read_text())}
    assert used, "found no MESH_* variables in the package: the pattern is stale"
    missing = sorted(name for name in used if not _mentions(text, name))
    assert not missing, f"docs/cli.md does not mention these environment variables: {missing}"


def test_the_check_catches_an_undocumented_option():
    """The checks above can fail: an option missing from a section is reported, by its own name."""
    probe = typer.Typer(add_completion=False)

    @probe.command()
    def run(  # pragma: no cover - never invoked, only inspected
        model: str = typer.Option("x", "--model"),
        draft: str = typer.Option("y", "--draft-model"),
        cache: bool = typer.Option(True, "--cache/--no-cache"),
        home: str = typer.Option("z", "--home", envvar="MESH_PROBE_HOME"),
    ) -> None:
        pass

    command = typer.main.get_command(probe)
    section = "## `mesh-inference`\n| `--draft-model PATH` | ... |\n| `--cache` | ... |\n"
    assert undocumented(command, section) == ["--model", "--no-cache", "--home", "MESH_PROBE_HOME"]
    full = section + "`--model PATH`, `--no-cache`, `--home DIR` / `MESH_PROBE_HOME`"
    assert undocumented(command, full) == []


# --- links ---------------------------------------------------------------------------


def _without_code(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        anchors.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return anchors


def _relative_links(path: Path) -> list[str]:
    text = _without_code(path.read_text())
    targets = _INLINE_LINK.findall(text) + _REFERENCE_LINK.findall(text)
    return [t for t in targets if not _SCHEME.match(t) and not t.startswith("//")]


def broken_links(path: Path) -> list[str]:
    """Relative links in ``path`` whose file does not exist, or whose #anchor names no heading there."""
    broken = []
    for target in _relative_links(path):
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target} (no file {destination})")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target} (no heading #{anchor} in {destination.name})")
    return broken


@pytest.mark.parametrize("path", LINKED_DOCS, ids=[str(p.relative_to(REPO)) for p in LINKED_DOCS])
def test_relative_links_point_to_existing_files(path):
    assert not broken_links(path), f"{path.relative_to(REPO)} has broken links: {broken_links(path)}"


def test_the_link_check_catches_a_missing_file(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading) [web](https://example.org/x.md) "
                    "`[code](nowhere.md)` [gone](nowhere.md) [bad anchor](there.md#no-such)\n")
    assert [b.split(" ")[0] for b in broken_links(page)] == ["nowhere.md", "there.md#no-such"]


def test_readme_links_every_doc():
    readme = _relative_links(REPO / "README.md")
    linked = {(REPO / t.partition("#")[0]).resolve() for t in readme}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md's Documentation list does not link: {unlinked}"
