"""The node key: made once, private to its owner, and the source of the node id."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from mesh_sidecar.errors import AuthError, SetupError
from mesh_sidecar.identity import (
    KEY_FILE_NAME,
    load_or_create_identity,
    node_id_of_certificate,
    short_id,
    verify_signature,
)


def test_key_is_created_once_with_owner_only_permissions(tmp_path: Path) -> None:
    first = load_or_create_identity(tmp_path)
    mode = stat.S_IMODE((tmp_path / KEY_FILE_NAME).stat().st_mode)
    assert mode == 0o600
    assert load_or_create_identity(tmp_path).node_id == first.node_id
    assert len(first.node_id) == 32
    assert first.short_id == short_id(first.node_id) == "node_" + first.node_id.hex()[:8]


def test_certificate_speaks_for_the_node_id(tmp_path: Path) -> None:
    identity = load_or_create_identity(tmp_path)
    assert node_id_of_certificate(identity.certificate()) == identity.node_id


def test_signatures_verify_only_for_the_signed_message(tmp_path: Path) -> None:
    identity = load_or_create_identity(tmp_path)
    signature = identity.sign(b"transcript")
    verify_signature(identity.node_id, signature, b"transcript")
    with pytest.raises(AuthError):
        verify_signature(identity.node_id, signature, b"another transcript")


def test_damaged_key_file_is_a_clear_setup_error(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE_NAME).write_text("not a key")
    with pytest.raises(SetupError, match="unreadable"):
        load_or_create_identity(tmp_path)
