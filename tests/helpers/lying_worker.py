"""A lying worker: a stand-in ggml-rpc-server in front of the real one, that lies in a way chosen at run time.

    python -m tests.helpers.lying_worker --real PATH --lie-file FILE [--b2b-hello] RPC_SERVER_ARGS...

A --llama-bin wrapper runs it as a node's rpc-server (:func:`lying_rpc_build`). It starts the real
rpc-server on a free port, listens on -p PORT itself (the node's readiness check: its own pid
listens) and relays each client to the real one, one at a time, command by command (RPC 7.x
framing, read with mesh_sidecar/wire's constants). Before each reply it reads FILE: absent or empty,
it tells the truth; otherwise FILE names the lie, told from that reply on::

    nan          every float GET_TENSOR reply's values NaN (the baseline: what the output check first caught)
    scaled       every float GET_TENSOR reply's values times 1e30, still finite (F32 clipped to its
                 largest finite value, F16 saturated at 65504)
    early-reply  right behind the next reply (the HELLO reply, when FILE says so from the start) one
                 more reply nobody asked for; the replies after it NaNs, as ``nan``
    wrong-size   every float GET_TENSOR reply one value short, its size field saying so

``--b2b-hello`` is no lie: the HELLO reply carries the b2b build's flag (rpc_framing.B2B_HELLO_FLAG),
so the relay in front of it reads REGISTER_PEER as the b2b build's does, without that build; and it answers
each REGISTER_PEER itself, 0 (not registered: this stand-in reaches no peer), where the stock rpc-server
would close the connection on a command it does not know.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
from pathlib import Path

import numpy as np

from mesh_sidecar.llama.build import LlamaBinaries
from mesh_sidecar.wire.rpc_framing import (
    B2B_HELLO_FLAG,
    GET_TENSOR_CMD,
    GET_TENSOR_SIZE_OFFSET,
    HELLO_CMD,
    HELLO_REPLY_FLAGS_OFFSET,
    MESH_B2B_7,
    REPLY_SIZE,
    REPLY_SIZE_BYTES,
    RPC_HEADER,
)
from mesh_sidecar.wire.rpc_outputs import GGML_TYPE_F16, GGML_TYPE_F32, NO_REPLY_CMDS_7, RPC_TENSOR_TYPE_OFFSET
from tests.helpers.fault_proxy import read_exactly, serve_in_front
from tests.helpers.llama import wrapped_rpc_build

NAN, SCALED, EARLY_REPLY, WRONG_SIZE = "nan", "scaled", "early-reply", "wrong-size"
LIES = (NAN, SCALED, EARLY_REPLY, WRONG_SIZE)
SCALE = 1e30
GGML_TYPE = struct.Struct("<I")  # rpc_tensor's type field
FLOAT_DTYPES = {GGML_TYPE_F32: np.dtype("<f4"), GGML_TYPE_F16: np.dtype("<f2")}
# Upstream 7.x's commands without a reply, and the b2b build's pushes (a stock client sends none of those).
NO_REPLY = NO_REPLY_CMDS_7 | MESH_B2B_7.async_push_cmds
UNSOLICITED = REPLY_SIZE.pack(1) + b"\x01"  # the form of a u8 answer (REGISTER_PEER's, a push's)
NOT_REGISTERED = REPLY_SIZE.pack(1) + b"\x00"  # REGISTER_PEER's answer: the peer was not registered
REPO_ROOT = Path(__file__).resolve().parents[2]


def lie_told(lie_file: Path) -> str:
    """The lie ``lie_file`` names now ("" for the truth); SystemExit on one this stand-in cannot tell."""
    try:
        lie = lie_file.read_text().strip()
    except FileNotFoundError:
        return ""
    if lie and lie not in LIES:
        raise SystemExit(f"lying worker: unknown lie {lie!r} in {lie_file} (known: {', '.join(LIES)})")
    return lie


def spoil(lie: str, values: np.ndarray) -> np.ndarray:
    """``values`` as ``lie`` returns them (a new array of the same dtype)."""
    if lie in (NAN, EARLY_REPLY):
        return np.full_like(values, np.nan)
    if lie == SCALED:
        largest = float(np.finfo(values.dtype).max)
        return np.clip(values.astype(np.float64) * SCALE, -largest, largest).astype(values.dtype)
    return values[:-1]  # WRONG_SIZE


def relay(client: socket.socket, server: socket.socket, lie_file: Path, b2b_hello: bool) -> None:
    """One client, until either side closes."""
    told_early = False  # early-reply: the unsolicited reply went out, NaNs from now on
    said: set[str] = set()
    while (header := read_exactly(client, RPC_HEADER.size)) is not None:
        cmd, size = RPC_HEADER.unpack(header)
        payload = read_exactly(client, size)
        if payload is None:
            return
        if b2b_hello and cmd == MESH_B2B_7.register_peer_cmd:
            client.sendall(NOT_REGISTERED)
            continue
        server.sendall(header + payload)
        if cmd in NO_REPLY:
            continue
        reply_header = read_exactly(server, REPLY_SIZE_BYTES)
        if reply_header is None:
            return
        (reply_size,) = REPLY_SIZE.unpack(reply_header)
        reply = read_exactly(server, reply_size)
        if reply is None:
            return
        if cmd == HELLO_CMD and b2b_hello and reply_size > HELLO_REPLY_FLAGS_OFFSET:
            reply = bytearray(reply)
            reply[HELLO_REPLY_FLAGS_OFFSET] |= B2B_HELLO_FLAG
            reply = bytes(reply)
        lie = lie_told(lie_file)
        extra = b""
        if lie == EARLY_REPLY and not told_early:
            extra, told_early = UNSOLICITED, True  # this reply stays true: the extra one is the lie
        elif lie and cmd == GET_TENSOR_CMD and size >= GET_TENSOR_SIZE_OFFSET + 8:
            (ggml_type,) = GGML_TYPE.unpack_from(payload, RPC_TENSOR_TYPE_OFFSET)
            (asked,) = REPLY_SIZE.unpack_from(payload, GET_TENSOR_SIZE_OFFSET)
            dtype = FLOAT_DTYPES.get(ggml_type)
            if dtype is not None and asked == reply_size and reply_size % dtype.itemsize == 0:
                reply = spoil(lie, np.frombuffer(reply, dtype)).tobytes()
                reply_header = REPLY_SIZE.pack(len(reply))
        if lie and lie not in said:
            said.add(lie)
            print(f"lying worker: {lie} from now on (command {cmd})", flush=True)
        client.sendall(reply_header + reply + extra)


def lying_rpc_build(binaries: LlamaBinaries, directory: Path, lie_file: Path, *, b2b_hello: bool = False) -> None:
    """Make ``directory`` a --llama-bin directory whose rpc-server is this lying worker, telling the lie
    ``lie_file`` names (the truth while it is absent)."""
    wrapped_rpc_build(binaries, directory,
                      f'PYTHONPATH="{REPO_ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"; export PYTHONPATH\n'
                      f'exec "{sys.executable}" -m tests.helpers.lying_worker --real "{binaries.rpc_server}" '
                      f'--lie-file "{lie_file}"{" --b2b-hello" if b2b_hello else ""} "$@"')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=50052)
    parser.add_argument("--real", type=Path, required=True)
    parser.add_argument("--lie-file", type=Path, required=True)
    parser.add_argument("--b2b-hello", action="store_true")
    args, rest = parser.parse_known_args()
    serve_in_front(args.real, args.host, args.port, rest, "lying worker",
                   lambda client, server: relay(client, server, args.lie_file, args.b2b_hello))


if __name__ == "__main__":
    main()
