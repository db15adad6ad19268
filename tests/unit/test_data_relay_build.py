"""The native relay's cached binary is run only if it is this user's and no one else's to write
(net/data_plane/build.py): the relay is handed the node's key."""

from __future__ import annotations

import os

import pytest

from mesh_sidecar.errors import SetupError
from mesh_sidecar.net.data_plane.build import verify_data_relay


@pytest.fixture
def binary(tmp_path):
    folder = tmp_path / "tools"
    folder.mkdir(mode=0o755)
    path = folder / "mesh-data-relay-0123456789ab"
    path.write_bytes(b"\x7fELF")
    path.chmod(0o755)
    return path


def test_a_binary_of_ours_that_no_one_else_can_write_runs(binary):
    verify_data_relay(binary)


@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_binary_others_can_write_is_refused(binary, mode):
    binary.chmod(mode)
    with pytest.raises(SetupError, match="can be written by other users"):
        verify_data_relay(binary)


def test_a_folder_others_can_write_is_refused(binary):
    binary.parent.chmod(0o777)
    with pytest.raises(SetupError, match="chmod go-w"):
        verify_data_relay(binary)


def test_a_link_is_refused(binary):
    link = binary.with_name("mesh-data-relay-link")
    link.symlink_to(binary)
    with pytest.raises(SetupError, match="symbolic link"):
        verify_data_relay(link)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file away takes root")
def test_another_users_binary_is_refused(binary):
    os.chown(binary, 4321, -1)
    with pytest.raises(SetupError, match="belongs to user id 4321"):
        verify_data_relay(binary)
