"""The pinned llama.cpp source from a member, for a node that has no build and cannot reach PyPI.

Before such a node can run (its rpc-server needs the build), it dials the member its ticket names
with a transport of its own, asks for the sdist by its pinned sha256 on a MODEL_FILE stream (as a
worker fetches a model: net/model_transfer.py, resumable, checked), keeps it in the cache
(llama/build.py) and closes the connection; the build then runs from it as from a download. The
member offers it only when it keeps the archive (`mesh-inference setup` keeps it).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MeshError, SourceUnavailableError
from ..identity import NodeIdentity, short_id
from ..llama.build import LLAMA_CPP_PYTHON_PIN, SDIST_SHA256, source_archive_path
from ..net.connection import PeerConnection
from ..net.model_transfer import fetch_model_file, file_streams
from ..net.transport import MeshTransport
from ..progress import ProgressCallback
from ..wire.ticket import Ticket
from .runtime import LISTEN_HOST


async def _hold(connection: PeerConnection) -> None:
    """The member's side asks nothing of this short connection: keep it until it closes."""
    await connection.wait_closed()


async def fetch_source_archive(ticket: Ticket, identity: NodeIdentity, progress: ProgressCallback) -> Path:
    """The pinned sdist, fetched from the member ``ticket`` names and kept (SourceUnavailableError if not)."""
    name = short_id(ticket.node_id)
    transport = MeshTransport(identity, ticket.mesh_secret, _hold)
    await transport.start(LISTEN_HOST, 0)
    try:
        connection = await transport.connect([(a.host, a.port) for a in ticket.addresses], ticket.node_id)
        # Checked against SDIST_SHA256 before it takes the kept archive's name: no second pass over it here.
        return await fetch_model_file(file_streams(connection, name), SDIST_SHA256, source_archive_path(), name,
                                      progress, what=f"Fetching the llama.cpp source from {name}")
    except MeshError as exc:
        raise SourceUnavailableError(
            f"Could not take the llama.cpp source (llama-cpp-python=={LLAMA_CPP_PYTHON_PIN}) from {name} either: "
            f"{exc}. Run `mesh-inference setup` on a member with package access (it keeps the source to share), "
            "or give this machine PyPI access, or pass --llama-bin with your own llama.cpp build.") from exc
    finally:
        await transport.close()
