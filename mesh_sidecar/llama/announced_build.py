"""Which llama.cpp build this node runs: its rpc-server's HELLO answer, and a label for people.

The node asks its own rpc-server once, right after starting it and before the
mesh starts: rpc-server serves one client at a time, and this is the only
moment nobody else is connected. The answer stands for the whole build
directory: llama-server has no way to tell its RPC version (``--version``
prints a build number, ``0.5.0-dev (build 0, commit unknown)`` for our pin),
and both programs compile the version from the same ggml-rpc.h, so the
directory's rpc-server answers with the version its llama-server speaks as a
client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess

from ..errors import WireError
from ..ports import LOOPBACK
from ..wire.gossip import MAX_BUILD_LABEL_CHARS, LlamaBuild
from ..wire.rpc_framing import REPLY_SIZE_BYTES
from ..wire.rpc_hello import HELLO_REQUEST, OLD_HELLO_REQUEST, HelloReply, decode_hello_reply, hello_reply_size
from .build import BUILD_STAMP_NAME, LlamaBinaries

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # per attempt; a local rpc-server answers at once
VERSION_TIMEOUT_S = 30.0  # `llama-server --version` loads its backends first (about 1 s)
_VERSION_LINE = re.compile(r"^version: (.+)$", re.MULTILINE)
UNKNOWN_LABEL = "llama.cpp of unknown version"


async def ask_hello(port: int) -> HelloReply | None:
    """The HELLO reply of the rpc-server on 127.0.0.1:``port``; None if it gave none we read.

    The 7.x request first; a server that closes on it may be older and take the empty one.
    """
    for request in (HELLO_REQUEST, OLD_HELLO_REQUEST):
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
                try:
                    writer.write(request)
                    size = hello_reply_size(await reader.readexactly(REPLY_SIZE_BYTES))
                    return decode_hello_reply(await reader.readexactly(size))
                finally:
                    writer.close()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, WireError) as exc:
            log.info("rpc-server on port %d gave no HELLO reply to a %d-byte request: %r",
                     port, len(request), exc)
    return None


def build_label(binaries: LlamaBinaries) -> str:
    """Which llama.cpp: our build stamp's pin and variant, else llama-server's own version line."""
    stamp = binaries.directory / BUILD_STAMP_NAME
    try:
        info = json.loads(stamp.read_text())
        return f"llama-cpp-python {info['llama_cpp_python']} {info['variant']}"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not our build: ask the build itself
    try:
        result = subprocess.run([str(binaries.llama_server), "--version"], capture_output=True, text=True,
                                errors="replace", timeout=VERSION_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN_LABEL
    match = _VERSION_LINE.search(result.stdout + result.stderr)
    if match is None:
        return UNKNOWN_LABEL
    # Gossip carries printable ASCII only.
    label = "llama.cpp " + "".join(c for c in match.group(1).strip() if " " <= c <= "~")
    return label[:MAX_BUILD_LABEL_CHARS]


async def local_build(binaries: LlamaBinaries, rpc_port: int) -> LlamaBuild:
    """This node's build, as it announces it: ask the rpc-server on ``rpc_port`` (started, no client yet)."""
    reply = await ask_hello(rpc_port)
    label = await asyncio.to_thread(build_label, binaries)
    return LlamaBuild(None if reply is None else reply.version, reply is not None and reply.b2b, label)
