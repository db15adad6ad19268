"""What the atheris fuzzers in ``benchmarks/fuzz_*.py`` share: the harness and an input reader.

Run one (atheris comes with the ``fuzz`` extra: ``.venv/bin/pip install -e '.[fuzz]'``)::

    .venv/bin/python -m benchmarks.fuzz_gossip [libFuzzer flags] [CORPUS_DIR ...]

A target takes one ``bytes`` input. A MeshError is a decoder refusing junk, the outcome
junk should get; any other exception (an ``assert`` in the target included) is a crash:
libFuzzer prints it, writes the input to ``benchmarks/results/fuzz-<name>-crash-<sha1>``
and stops. A flag on the command line replaces the default of the same name in
DEFAULT_FLAGS, so every run is bounded in time and in memory unless asked otherwise.

Without a corpus directory on the command line, the corpus is
``benchmarks/results/fuzz-corpus/<name>``: the target's seeds (valid tickets, frames and
handshakes, so mutations start deep inside each format) are written there, and what a run
finds stays there for the next run to start from.

The targets import nothing from atheris, so the tests run them too (tests/unit/test_fuzz.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from mesh_sidecar.errors import MeshError

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_FLAGS = (
    "-max_total_time=60",  # seconds for the whole run
    "-rss_limit_mb=512",  # ~8x what a run uses (~60 MB): buffering a claimed size trips it
    "-timeout=10",  # seconds for one input: a decoder that spins is a finding too
    "-max_len=8192",  # bytes: several frames and a REGISTER_PEER, far past every header
    "-print_final_stats=1",
)

Target = Callable[[bytes], None]


class Input:
    """A fuzzer's bytes read front to back as choices; reads past the end give zeros."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def byte(self) -> int:
        """The next byte as a number 0..255."""
        chunk = self.take(1)
        return chunk[0] if chunk else 0

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes, or fewer at the end."""
        out = self._data[self._pos : self._pos + n]
        self._pos += n
        return out

    def rest(self) -> bytes:
        """Every byte not read yet."""
        return self.take(len(self._data))


def chunks(data: bytes, size: int) -> list[bytes]:
    """``data`` cut every ``size`` bytes, as a stream arrives in reads."""
    return [data[i : i + size] for i in range(0, len(data), size)]


def guarded(target: Target) -> Target:
    """``target`` with MeshError, the typed refusal, swallowed; anything else still raises."""

    def one_input(data: bytes) -> None:
        try:
            target(data)
        except MeshError:
            pass

    return one_input


def run(name: str, target: Target, seeds: Iterable[bytes], argv: list[str] | None = None) -> None:
    """Fuzz ``target`` under libFuzzer with DEFAULT_FLAGS; never returns (libFuzzer exits)."""
    import atheris  # the `fuzz` extra; imported here so the targets work without it

    args = list(sys.argv if argv is None else argv)
    flags = [a for a in args[1:] if a.startswith("-")]
    corpus = [a for a in args[1:] if not a.startswith("-")]
    given = {flag.split("=", 1)[0] for flag in flags}
    defaults = [flag for flag in DEFAULT_FLAGS if flag.split("=", 1)[0] not in given]
    if "-artifact_prefix" not in given:
        RESULTS_DIR.mkdir(exist_ok=True)
        defaults.append(f"-artifact_prefix={RESULTS_DIR}/fuzz-{name}-")
    if not corpus:
        seed_dir = RESULTS_DIR / "fuzz-corpus" / name
        seed_dir.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seeds):
            (seed_dir / f"seed-{i:03d}").write_bytes(seed)
        corpus = [str(seed_dir)]
    # After the imports, so the decoders (and json, ipaddress under them) report coverage.
    atheris.instrument_all()
    atheris.Setup([args[0], *defaults, *flags, *corpus], guarded(target))
    atheris.Fuzz()
