"""Filter one llama.cpp RPC tunnel stream: pass every byte, rewrite REGISTER_PEER endpoints.

Where it sits (worker side, one filter per inbound tunnel stream)::

    serving node's llama-server ==QUIC stream==> RpcStreamFilter --TCP--> local ggml-rpc-server
                                <============== replies: the caller forwards them itself and
                                                shows them to receive_from_server()

Client -> server, every command (packed, little-endian)::

    0        1                   9
    +--------+-------------------+------------------------------+
    | cmd u8 | size u64 LE       | payload[size]                |
    +--------+-------------------+------------------------------+

HELLO (cmd 14) is always the first command. Its reply, server -> client::

    +-------------+----------+----------+----------+--------+----------+
    | size u64 LE | major u8 | minor u8 | patch u8 | pad u8 | caps[24] |  upstream 7.x, size 28
    +-------------+----------+----------+----------+--------+----------+
    | size u64 LE | major u8 | minor u8 | patch u8 |                       b2b fork 3.x, size 3
    +-------------+----------+----------+----------+

Our b2b build (``--b2b``, llama/patches/llama.cpp-b2b.patch) answers 7.0.2 with B2B_HELLO_FLAG
(and 0x02, its asynchronous pushes) in the pad byte and adds, after upstream's commands,
REGISTER_PEER = 18 and PUSH_TENSOR_TO_PEER = 19 (both answer) and PUSH_TENSOR_ASYNC = 20,
STAGE_TENSOR = 21 (server to server) and AWAIT_TENSOR = 22 (none answers).

REGISTER_PEER payload (the b2b fork and our b2b build; 132 bytes)::

    0                4                                                132
    +----------------+------------------------------------------------+
    | peer_id u32 LE | endpoint char[128], NUL-terminated "host:port" |
    +----------------+------------------------------------------------+

Why rewrite: the serving node registers a peer under the endpoint *it* uses for that peer,
but this worker reaches the peer through its own sidecar on a local port. The endpoint field
is replaced in place (NUL-padded), so the frame size and every later byte stay where they are.

Command numbers depend on the dialect (17 is MEMSET_TENSOR upstream and REGISTER_PEER in fork
3.0), so the filter first reads the HELLO exchange and picks a row of :data:`DIALECTS`. When
no row matches it stops parsing and passes bytes through untouched: a filter that does not
understand a stream must not alter it.

Activation bytes (``activation_bytes_*``): frames that move a layer's output between servers,
the traffic backend-to-backend transfer takes off the serving node's links. They are SET_TENSOR
and GET_TENSOR of a tensor llama.cpp names ``l_out-N`` (its name for every layer's output; the
scheduler's copy on another device is ``<device>#l_out-N#<k>``), and every b2b push command.
The filter reads the tensor's name from the first bytes of the payload as they pass; it holds
nothing back for it. A GET_TENSOR's reply is counted from the size it asked for.

Sans-I/O: bytes in, bytes and events out; no sockets, no clock. Payload bytes pass as
memoryview slices of the caller's ``bytes`` (no copy until :meth:`data_to_server` joins them,
and none at all when one whole input chunk is released alone). Only a 9-byte header, one
141-byte REGISTER_PEER frame, the HELLO reply (36 bytes at most) and client bytes sent before
the HELLO reply (none from a conforming client; bounded) are ever held.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import struct
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import FrameTooLargeError, MalformedMessageError

RPC_HEADER_BYTES = 1 + 8  # cmd u8 | size u64
HELLO_CMD = 14  # upstream static_asserts it never moves; the fork keeps it
REPLY_SIZE_BYTES = 8  # every reply starts with its payload's size, u64
HELLO_REPLY_SIZE_BYTES = REPLY_SIZE_BYTES
HELLO_REPLY_CAPS_OFFSET = 4  # major, minor, patch, pad; then caps[24] in 7.x
# Upstream's pad byte; our b2b patch (llama/patches/llama.cpp-b2b.patch) sets a flag in it rather
# than in caps, which RDMA transports read. Stock clients ignore it, so they still talk to b2b servers.
HELLO_REPLY_FLAGS_OFFSET = 3
B2B_HELLO_FLAG = 0x01
RPC_CONN_CAPS_BYTES = 24  # upstream 7.x connection capabilities (RDMA data or zeros)
FORK_HELLO_REPLY_BYTES = 3  # the fork's reply: major, minor, patch
REGISTER_PEER_ENDPOINT_BYTES = 128  # char endpoint[128], NUL included
REGISTER_PEER_PAYLOAD_BYTES = 4 + REGISTER_PEER_ENDPOINT_BYTES  # peer_id u32 | endpoint
REGISTER_PEER_FRAME_BYTES = RPC_HEADER_BYTES + REGISTER_PEER_PAYLOAD_BYTES
# A SET_TENSOR carries a whole weight tensor in one frame, so the limit is generous (64 GiB);
# it exists to turn a corrupt size field into a clean close instead of a multi-TiB wait.
MAX_RPC_FRAME_BYTES = 1 << 36
# A conforming client blocks on the HELLO reply and sends nothing after HELLO until it
# arrives; this bounds what a misbehaving one can make us hold.
MAX_HELD_BEFORE_REPLY_BYTES = 64 * 1024

ALLOC_BUFFER_CMD = 0  # upstream 7.x, and our b2b build
ALLOC_BUFFER_PAYLOAD_BYTES = 12  # device u32 | size u64
SET_TENSOR_CMD = 6
GET_TENSOR_CMD = 8
RPC_TENSOR_BYTES = 296
RPC_TENSOR_NAME_OFFSET = 228  # char name[64] inside rpc_tensor
RPC_TENSOR_NAME_BYTES = 64
GET_TENSOR_SIZE_OFFSET = RPC_TENSOR_BYTES + 8  # rpc_tensor | offset u64 | size u64
PUSH_PEER_ID_BYTES = 4  # PUSH_TENSOR_TO_PEER: peer_id u32 | src rpc_tensor | ...
PUSH_REPLY_BYTES = 1  # u8: pushed or not
_LAYER_OUTPUT = re.compile(rb"(?:^|#)l_out-\d+(?:#|$)")

RPC_HEADER = struct.Struct("<BQ")  # cmd u8 | size u64
REPLY_SIZE = struct.Struct("<Q")  # a reply's payload size
_REGISTER_PEER = struct.Struct(f"<I{REGISTER_PEER_ENDPOINT_BYTES}s")


@dataclass(frozen=True, slots=True)
class RpcDialect:
    """One RPC dialect: how its HELLO exchange looks and which command is REGISTER_PEER."""

    name: str
    """Label for logs and metrics."""
    major: int
    """Protocol major version in the HELLO reply."""
    min_minor: int
    """Lowest minor version this row covers."""
    max_minor: int | None
    """Highest minor version this row covers; None: every later minor too."""
    hello_request_bytes: int
    """Payload size of the client's HELLO request."""
    hello_reply_bytes: int
    """Payload size of the server's HELLO reply."""
    register_peer_cmd: int | None
    """REGISTER_PEER's command number; None: the dialect has no REGISTER_PEER."""
    push_tensor_cmd: int | None = None
    """PUSH_TENSOR_TO_PEER's command number, for the activation counters; None: not counted."""
    async_push_cmds: frozenset[int] = frozenset()
    """Commands that only move layer outputs and send no reply (b2b's asynchronous pushes)."""
    required_caps: int = 0
    """Bits that must be set in the reply's caps (read as a little-endian integer)."""
    required_flags: int = 0
    """Bits that must be set in the reply's fourth byte (upstream's padding, our b2b patch's flags)."""

    def matches(self, hello_request_bytes: int, reply: bytes) -> bool:
        """Whether a HELLO request of that size and this reply payload are this dialect."""
        major, minor = reply[0], reply[1]
        caps = int.from_bytes(reply[HELLO_REPLY_CAPS_OFFSET:], "little")
        return (
            major == self.major
            and minor >= self.min_minor
            and (self.max_minor is None or minor <= self.max_minor)
            and hello_request_bytes == self.hello_request_bytes
            and len(reply) == self.hello_reply_bytes
            and caps & self.required_caps == self.required_caps
            and ((len(reply) > HELLO_REPLY_FLAGS_OFFSET and reply[HELLO_REPLY_FLAGS_OFFSET]) or 0)
            & self.required_flags == self.required_flags
        )


# The first matching row wins, so a row that needs a caps flag goes above the plain row of
# the same major (e.g. a future 7.x with a b2b capability bit: one more row above upstream-7).
# Every 7.x minor frames commands alike and has no REGISTER_PEER, so one row covers them all.
# Assumption (no published version table for the fork): REGISTER_PEER is 17 in 3.0.x and
# moved to 18 (when SET_TENSOR_GGUF took 17) in 3.1 and later.
UPSTREAM_7 = RpcDialect(
    "upstream-7",
    major=7,
    min_minor=0,
    max_minor=None,
    hello_request_bytes=RPC_CONN_CAPS_BYTES,
    hello_reply_bytes=HELLO_REPLY_CAPS_OFFSET + RPC_CONN_CAPS_BYTES,
    register_peer_cmd=None,
)
# Our b2b build is upstream 7.x plus a HELLO flag and two commands after upstream's last (17).
MESH_B2B_7 = dataclasses.replace(UPSTREAM_7, name="mesh-b2b-7", register_peer_cmd=18, push_tensor_cmd=19,
                                 async_push_cmds=frozenset({20, 21, 22}), required_flags=B2B_HELLO_FLAG)
DIALECTS: tuple[RpcDialect, ...] = (
    MESH_B2B_7,
    UPSTREAM_7,
    RpcDialect(
        "b2b-fork-3.0",
        major=3,
        min_minor=0,
        max_minor=0,
        hello_request_bytes=0,
        hello_reply_bytes=FORK_HELLO_REPLY_BYTES,
        register_peer_cmd=17,
    ),
    RpcDialect(
        "b2b-fork-3.1",
        major=3,
        min_minor=1,
        max_minor=None,
        hello_request_bytes=0,
        hello_reply_bytes=FORK_HELLO_REPLY_BYTES,
        register_peer_cmd=18,
    ),
)


@dataclass(frozen=True, slots=True)
class DialectDetected:
    """The HELLO exchange matched a row of the dialect table."""

    name: str
    """The matching row's name."""
    version: str
    """The server's protocol version, "major.minor.patch"."""


@dataclass(frozen=True, slots=True)
class DialectUnknown:
    """The stream is not one we can parse; from now on every byte passes untouched."""

    reason: str
    """What did not match, for the log."""


PRINTED_WORD_MAX_CHARS = 80  # a word of peer bytes in a log line or report: a real endpoint is far shorter


def printable_word(data: bytes) -> str:
    """Bytes from the wire as one word of printable ASCII, for a log line or report (rpc_watch.c's twin).

    0x21-0x7e pass, but for the backslash; every other byte is written ``\\xNN``; empty is ``-``;
    over PRINTED_WORD_MAX_CHARS, the whole escapes that fit in 3 fewer, then ``...``.
    """
    pieces = [chr(b) if 0x20 < b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in data]
    if not pieces:
        return "-"
    if sum(map(len, pieces)) <= PRINTED_WORD_MAX_CHARS:
        return "".join(pieces)
    kept, chars = [], 0
    for piece in pieces:
        if chars + len(piece) > PRINTED_WORD_MAX_CHARS - 3:
            break
        kept.append(piece)
        chars += len(piece)
    return "".join(kept) + "..."


@dataclass(frozen=True, slots=True)
class EndpointRewritten:
    """A REGISTER_PEER endpoint was replaced."""

    peer_id: int
    """The peer id in the frame."""
    original: str
    """The endpoint the client sent, as :func:`printable_word` writes it (a member's bytes reach no log raw)."""
    rewritten: str
    """The endpoint the server now sees."""


@dataclass(frozen=True, slots=True)
class EndpointUnresolved:
    """The resolver knew no endpoint for a peer; its REGISTER_PEER went on with the endpoint cleared."""

    peer_id: int
    """The peer id in the frame."""


@dataclass(frozen=True, slots=True)
class EndpointTooLong:
    """The resolved endpoint does not fit the 128-byte field with its NUL; the field went on cleared."""

    peer_id: int
    """The peer id in the frame."""
    endpoint: str
    """What the resolver returned."""


RpcEvent = (
    DialectDetected | DialectUnknown | EndpointRewritten | EndpointUnresolved | EndpointTooLong
)


class _Phase(enum.Enum):
    AWAIT_HELLO = enum.auto()  # collecting the first header, which must be HELLO
    AWAIT_REPLY = enum.auto()  # HELLO seen; holding later client bytes until the dialect is known
    FRAMES = enum.auto()  # dialect known; parsing every frame
    OPAQUE = enum.auto()  # dialect unknown; passing bytes without looking


class RpcStreamFilter:
    """Sans-I/O filter for the client -> server direction of one RPC stream.

    Feed client bytes with :meth:`receive_from_client`, show the server's bytes with
    :meth:`receive_from_server` (the caller forwards those unchanged itself), send what
    :meth:`data_to_server` returns, and drain :meth:`next_event`. Input must be ``bytes``:
    slices of it are kept until the next :meth:`data_to_server`. After a :class:`WireError`
    the filter is unusable; close the stream.
    """

    def __init__(
        self,
        resolve_endpoint: Callable[[int], str | None],
        max_frame_bytes: int = MAX_RPC_FRAME_BYTES,
        dialects: Iterable[RpcDialect] = DIALECTS,
    ) -> None:
        self._resolve_endpoint = resolve_endpoint
        self._max_frame_bytes = max_frame_bytes
        self._dialects = tuple(dialects)
        self._hello_request_sizes = {d.hello_request_bytes for d in self._dialects}
        self._hello_reply_sizes = {d.hello_reply_bytes for d in self._dialects}
        self.dialect: RpcDialect | None = None
        """The detected dialect; None before detection or when unknown."""
        self.commands_seen: Counter[int] = Counter()
        """Frames seen per command number (HELLO included; nothing counted when opaque)."""
        self.frames_seen = 0
        """Frames seen in all."""
        self.activation_bytes_to_server = 0
        """Bytes of frames that moved a layer's output into (or, PUSH, out of) the server."""
        self.activation_bytes_from_server = 0
        """Bytes of the replies to them (GET_TENSOR data, PUSH results), headers included."""
        self.allocated_bytes = 0
        """Buffer bytes the client asked the server for (ALLOC_BUFFER); rpc-server frees a client's
        buffers when its connection closes, so this is what the stream holds while it is open."""
        self._tap: bytearray | None = None  # the first payload bytes of a tensor command, as they pass
        self._tap_need = 0
        self._tap_cmd = 0
        self._tap_frame_bytes = 0
        self._phase = _Phase.AWAIT_HELLO
        self._header = bytearray()
        self._remaining = 0  # payload bytes of the current frame still to pass through
        self._register: bytearray | None = None  # a REGISTER_PEER frame being collected
        self._hello_request_bytes: int | None = None
        self._reply_buf = bytearray()
        self._reply: bytes | None = None
        self._held: list[memoryview] = []
        self._held_bytes = 0
        self._out: list[bytes | memoryview] = []
        self._events: deque[RpcEvent] = deque()

    def receive_from_client(self, data: bytes) -> None:
        """Take bytes the client sent; raises FrameTooLargeError or MalformedMessageError."""
        self._feed(memoryview(data))

    def receive_from_server(self, data: bytes) -> None:
        """Observe bytes the server sent; only the HELLO reply is read, none are forwarded.

        Parsing the reply releases the client bytes held behind it, so this can raise what
        :meth:`receive_from_client` raises.
        """
        if self._reply is not None or self._phase in (_Phase.FRAMES, _Phase.OPAQUE):
            return
        buf = self._reply_buf
        view = memoryview(data)
        if len(buf) < HELLO_REPLY_SIZE_BYTES:
            take = HELLO_REPLY_SIZE_BYTES - len(buf)
            buf += view[:take]
            view = view[take:]
            if len(buf) < HELLO_REPLY_SIZE_BYTES:
                return
            (size,) = REPLY_SIZE.unpack(buf)
            if size not in self._hello_reply_sizes:
                self._go_opaque(
                    f"the server's first reply has {size} bytes, not a known HELLO reply"
                )
                return
        (size,) = REPLY_SIZE.unpack_from(buf)
        buf += view[: HELLO_REPLY_SIZE_BYTES + size - len(buf)]
        if len(buf) == HELLO_REPLY_SIZE_BYTES + size:
            self._reply = bytes(buf[HELLO_REPLY_SIZE_BYTES:])
            self._reply_buf = bytearray()
            self._resolve_dialect()

    def data_to_server(self) -> bytes:
        """Everything releasable so far, in order; b"" when nothing is."""
        out, self._out = self._out, []
        if len(out) == 1:
            # The hot path: one whole input chunk of payload goes back as the same object.
            (chunk,) = out
            if isinstance(chunk, bytes):
                return chunk
            if isinstance(chunk.obj, bytes) and chunk.nbytes == len(chunk.obj):
                return chunk.obj
        return b"".join(out)

    def next_event(self) -> RpcEvent | None:
        """The oldest event not yet taken, or None."""
        return self._events.popleft() if self._events else None

    def _feed(self, view: memoryview) -> None:
        pos, end = 0, len(view)
        while pos < end:
            if self._phase is _Phase.OPAQUE:
                self._out.append(view[pos:])
                return
            if self._remaining:
                take = min(self._remaining, end - pos)
                self._out.append(view[pos : pos + take])
                if self._tap is not None:
                    self._tap += view[pos : pos + min(take, self._tap_need - len(self._tap))]
                    if len(self._tap) == self._tap_need:
                        self._count_activation(bytes(self._tap))
                        self._tap = None
                self._remaining -= take
                pos += take
            elif self._phase is _Phase.AWAIT_REPLY:
                self._hold(view[pos:])
                return
            elif self._register is not None:
                chunk = view[pos : pos + REGISTER_PEER_FRAME_BYTES - len(self._register)]
                self._register += chunk
                pos += len(chunk)
                if len(self._register) == REGISTER_PEER_FRAME_BYTES:
                    self._out.append(self._rewrite(self._register))
                    self._register = None
            else:
                chunk = view[pos : pos + RPC_HEADER_BYTES - len(self._header)]
                self._header += chunk
                pos += len(chunk)
                if len(self._header) == RPC_HEADER_BYTES:
                    self._on_header()

    def _on_header(self) -> None:
        cmd, size = RPC_HEADER.unpack(self._header)
        if self._phase is _Phase.AWAIT_HELLO:
            if cmd != HELLO_CMD:
                self._go_opaque(f"the first command is {cmd}, not HELLO ({HELLO_CMD})")
                return
            if size not in self._hello_request_sizes:
                self._go_opaque(f"the HELLO request has {size} bytes, no known dialect's size")
                return
            self._hello_request_bytes = size
            self._phase = _Phase.AWAIT_REPLY
        elif size > self._max_frame_bytes:
            raise FrameTooLargeError(
                f"RPC command {cmd} declares a {size}-byte payload, over the "
                f"{self._max_frame_bytes}-byte limit; closing this stream"
            )
        self.commands_seen[cmd] += 1
        self.frames_seen += 1
        if (
            self.dialect is not None
            and cmd == self.dialect.register_peer_cmd
            and size == REGISTER_PEER_PAYLOAD_BYTES
        ):
            self._register, self._header = self._header, bytearray()
            return
        self._out.append(bytes(self._header))
        self._header.clear()
        self._remaining = size
        self._tap_tensor_command(cmd, size)
        if self._phase is _Phase.AWAIT_REPLY:
            self._resolve_dialect()  # the reply may have come first

    def _tap_tensor_command(self, cmd: int, size: int) -> None:
        """Start reading the payload of a command that may move a layer's output."""
        if self.dialect is None:
            return
        if cmd in self.dialect.async_push_cmds:
            self.activation_bytes_to_server += RPC_HEADER_BYTES + size
            return
        if cmd == ALLOC_BUFFER_CMD and self.dialect.major == 7:
            need = ALLOC_BUFFER_PAYLOAD_BYTES
        elif cmd == SET_TENSOR_CMD:
            need = RPC_TENSOR_NAME_OFFSET + RPC_TENSOR_NAME_BYTES
        elif cmd == GET_TENSOR_CMD:
            need = GET_TENSOR_SIZE_OFFSET + 8
        elif cmd == self.dialect.push_tensor_cmd:
            need = PUSH_PEER_ID_BYTES + RPC_TENSOR_NAME_OFFSET + RPC_TENSOR_NAME_BYTES
        else:
            return
        if size < need:
            return  # malformed; rpc-server will close the connection
        self._tap, self._tap_need, self._tap_cmd = bytearray(), need, cmd
        self._tap_frame_bytes = RPC_HEADER_BYTES + size

    def _count_activation(self, payload_start: bytes) -> None:
        if self._tap_cmd == ALLOC_BUFFER_CMD:
            (asked,) = struct.unpack_from("<Q", payload_start, 4)
            self.allocated_bytes += asked
            return
        if self.dialect is not None and self._tap_cmd == self.dialect.push_tensor_cmd:
            self.activation_bytes_to_server += self._tap_frame_bytes
            self.activation_bytes_from_server += REPLY_SIZE_BYTES + PUSH_REPLY_BYTES
            return
        name = payload_start[RPC_TENSOR_NAME_OFFSET:RPC_TENSOR_NAME_OFFSET + RPC_TENSOR_NAME_BYTES]
        if not _LAYER_OUTPUT.search(name.split(b"\0", 1)[0]):
            return
        self.activation_bytes_to_server += self._tap_frame_bytes
        if self._tap_cmd == GET_TENSOR_CMD:
            (asked,) = struct.unpack_from("<Q", payload_start, GET_TENSOR_SIZE_OFFSET)
            self.activation_bytes_from_server += REPLY_SIZE_BYTES + asked

    def _hold(self, chunk: memoryview) -> None:
        self._held_bytes += len(chunk)
        if self._held_bytes > MAX_HELD_BEFORE_REPLY_BYTES:
            raise MalformedMessageError(
                f"the RPC client sent over {MAX_HELD_BEFORE_REPLY_BYTES} bytes before the "
                "server's HELLO reply; a conforming client waits for it"
            )
        self._held.append(chunk)

    def _resolve_dialect(self) -> None:
        reply = self._reply
        if self._hello_request_bytes is None or reply is None:
            return
        version = f"{reply[0]}.{reply[1]}.{reply[2]}"
        for dialect in self._dialects:
            if dialect.matches(self._hello_request_bytes, reply):
                self.dialect = dialect
                self._events.append(DialectDetected(dialect.name, version))
                self._phase = _Phase.FRAMES
                held, self._held = self._held, []
                for chunk in held:
                    self._feed(chunk)
                return
        self._go_opaque(
            f"protocol {version} with a {self._hello_request_bytes}-byte HELLO request and a "
            f"{len(reply)}-byte reply matches no known dialect"
        )

    def _go_opaque(self, reason: str) -> None:
        self._events.append(DialectUnknown(reason))
        self._phase = _Phase.OPAQUE
        if self._header:
            self._out.append(bytes(self._header))
            self._header.clear()
        self._out.extend(self._held)
        self._held = []

    def _rewrite(self, frame: bytearray) -> bytes:
        peer_id, field = _REGISTER_PEER.unpack_from(frame, RPC_HEADER_BYTES)
        original = printable_word(field.split(b"\0", 1)[0])
        endpoint = self._resolve_endpoint(peer_id)
        # An endpoint we cannot map is cleared, never passed on: it means nothing on this machine,
        # and a b2b rpc-server would connect to whatever a member wrote there. The server answers
        # an empty endpoint with 0, and the client copies through the serving node instead.
        if endpoint is None:
            self._events.append(EndpointUnresolved(peer_id))
            return self._cleared(frame, peer_id)
        encoded = endpoint.encode()
        if len(encoded) >= REGISTER_PEER_ENDPOINT_BYTES:  # the server needs room for the NUL
            self._events.append(EndpointTooLong(peer_id, endpoint))
            return self._cleared(frame, peer_id)
        # struct pads the field with NULs, so no byte of the old endpoint survives.
        _REGISTER_PEER.pack_into(frame, RPC_HEADER_BYTES, peer_id, encoded)
        self._events.append(EndpointRewritten(peer_id, original, endpoint))
        return bytes(frame)

    @staticmethod
    def _cleared(frame: bytearray, peer_id: int) -> bytes:
        _REGISTER_PEER.pack_into(frame, RPC_HEADER_BYTES, peer_id, b"")
        return bytes(frame)
