"""Speculative decoding with real processes: the CLI's rule for --draft-model and greedy output unchanged by a draft."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.llama import complete
from tests.helpers.nodes import cli


@pytest.mark.slow
def test_greedy_output_is_the_same_with_a_draft(start_node, model_path, reference_text):
    # The default model drafting for itself: a functional check (every draft token is accepted).
    node = start_node("spec", "--draft-model", str(model_path), serve=True)
    assert complete(node.serve_port) == reference_text
    speculation = node.status()["serving"]["speculation"]
    assert speculation["kind"] == "draft" and speculation["draft_model"] == str(model_path)
    argv = Path(f"/proc/{next(p for p in node.status()['processes'] if p['name'] == 'llama-server')['pid']}"
                "/cmdline").read_bytes().split(b"\0")
    assert b"--spec-draft-model" in argv


def test_draft_model_needs_serve(tmp_path, model_path):
    result = cli("--home", str(tmp_path / "h"), "--draft-model", str(model_path), timeout=120)
    assert result.returncode != 0 and "--serve" in result.stderr
