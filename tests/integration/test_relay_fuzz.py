"""The relay's libFuzzer harnesses (net/data_plane/native/fuzz_control.c, fuzz_pipe.c) run without libFuzzer.

CI machines need not have clang, so each harness is built with the system compiler, AddressSanitizer
and UBSan, beside ``fuzz/standalone.c``: a driver that feeds it its seed corpus (``fuzz/corpus/``) and
mutations of it. Not coverage guided (that is ``cmake -DMESH_FUZZ=ON`` with clang, README.md), but any
crash, out-of-bounds access, leak or broken invariant (the harnesses trap on one) fails the test.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import mesh_sidecar.net.data_plane.native

NATIVE = Path(mesh_sidecar.net.data_plane.native.__file__).parent
ITERATIONS = 20000


def relay_parts() -> list[str]:
    """The relay's sources but main.c, as CMakeLists.txt names them for its own fuzz builds."""
    match = re.search(r"set\(RELAY_PARTS ([^)]*)\)", (NATIVE / "CMakeLists.txt").read_text())
    assert match, "CMakeLists.txt no longer sets RELAY_PARTS"
    return [str(NATIVE / name) for name in match.group(1).split()]


@pytest.mark.parametrize("harness", ["control", "pipe"])
def test_the_relays_harness_survives_its_corpus_and_mutations_under_sanitizers(harness, tmp_path):
    binary = tmp_path / f"fuzz_{harness}"
    subprocess.run(["cc", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    str(NATIVE / "fuzz" / "standalone.c"), str(NATIVE / f"fuzz_{harness}.c"), *relay_parts(),
                    "-lssl", "-lcrypto", "-lm", "-o", str(binary)], check=True, capture_output=True, timeout=300)
    result = subprocess.run([str(binary), str(NATIVE / "fuzz" / "corpus" / harness), str(ITERATIONS), "5"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("ok "), result.stderr[-3000:]
