"""RPC stream filter: byte-exact pass-through, REGISTER_PEER rewriting, dialect detection."""

from __future__ import annotations

import random
import struct
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_sidecar.errors import FrameTooLargeError, MalformedMessageError, WireError
from mesh_sidecar.wire.rpc_framing import (
    B2B_HELLO_FLAG,
    DIALECTS,
    MAX_HELD_BEFORE_REPLY_BYTES,
    MAX_RPC_FRAME_BYTES,
    REGISTER_PEER_ENDPOINT_BYTES,
    REGISTER_PEER_PAYLOAD_BYTES,
    DialectDetected,
    DialectUnknown,
    EndpointRewritten,
    EndpointTooLong,
    EndpointUnresolved,
    RpcDialect,
    RpcStreamFilter,
    printable_word,
)

RPC_TENSOR_BYTES = 296
HEADER_BYTES = 9

# Command numbers as each dialect spells them (see mesh_sidecar/wire/rpc_framing.py).
ALLOC_BUFFER, GET_ALIGNMENT, BUFFER_GET_BASE, FREE_BUFFER, BUFFER_CLEAR = 0, 1, 3, 4, 5
SET_TENSOR, GET_TENSOR, GRAPH_COMPUTE, INIT_TENSOR, HELLO = 6, 8, 10, 12, 14
DEVICE_COUNT, GRAPH_RECOMPUTE, MEMSET_TENSOR = 15, 16, 17  # upstream 7.x
FORK30_REGISTER_PEER, FORK30_PUSH_TENSOR_TO_PEER = 17, 18
FORK31_SET_TENSOR_GGUF, FORK31_REGISTER_PEER = 17, 18

RESOLVED = {1: "127.0.0.1:41001", 2: "127.0.0.1:41002", 3: "127.0.0.1:41003"}


def frame(cmd: int, payload: bytes) -> bytes:
    return bytes([cmd]) + len(payload).to_bytes(8, "little") + payload


def register_payload(peer_id: int, endpoint: bytes) -> bytes:
    return struct.pack("<I128s", peer_id, endpoint)


def hello_reply(payload: bytes) -> bytes:
    return len(payload).to_bytes(8, "little") + payload


def reply_7x(major: int = 7, minor: int = 0, patch: int = 0, caps: int = 0, flags: int = 0) -> bytes:
    return hello_reply(bytes([major, minor, patch, flags]) + caps.to_bytes(24, "little"))


def reply_fork(minor: int, patch: int = 0, major: int = 3) -> bytes:
    return hello_reply(bytes([major, minor, patch]))


HELLO_7X = frame(HELLO, bytes(24))
HELLO_FORK = frame(HELLO, b"")


@dataclass(frozen=True)
class Register:
    """A REGISTER_PEER frame in a synthetic stream; rewritten in the expected output."""

    cmd: int
    peer_id: int
    endpoint: str


@dataclass(frozen=True)
class Case:
    name: str
    hello: bytes
    reply: bytes
    items: tuple[bytes | Register, ...]  # frames after HELLO
    detected: DialectDetected

    @property
    def client(self) -> bytes:
        return self.hello + b"".join(
            frame(i.cmd, register_payload(i.peer_id, i.endpoint.encode()))
            if isinstance(i, Register)
            else i
            for i in self.items
        )

    @property
    def expected(self) -> bytes:
        return self.hello + b"".join(
            frame(i.cmd, register_payload(i.peer_id, RESOLVED[i.peer_id].encode()))
            if isinstance(i, Register)
            else i
            for i in self.items
        )

    @property
    def events(self) -> list[object]:
        return [self.detected] + [
            EndpointRewritten(i.peer_id, printable_word(i.endpoint.encode()), RESOLVED[i.peer_id])
            for i in self.items
            if isinstance(i, Register)
        ]

    @property
    def commands(self) -> Counter[int]:
        return Counter(
            [HELLO] + [i.cmd if isinstance(i, Register) else i[0] for i in self.items]
        )


def _common_frames(rng: random.Random) -> list[bytes]:
    """Commands every dialect shares, with realistic payload shapes."""

    def tensor() -> bytes:
        return rng.randbytes(RPC_TENSOR_BYTES)

    def u32(v: int) -> bytes:
        return v.to_bytes(4, "little")

    def u64(v: int) -> bytes:
        return v.to_bytes(8, "little")

    n_nodes = 3
    graph = (
        u32(0)
        + u32(n_nodes)
        + b"".join(u64(rng.getrandbits(64)) for _ in range(n_nodes))
        + u32(n_nodes)
        + b"".join(tensor() for _ in range(n_nodes))
    )
    return [
        frame(ALLOC_BUFFER, u32(0) + u64(1 << 30)),
        frame(GET_ALIGNMENT, u32(0)),
        frame(BUFFER_GET_BASE, u64(0x7F00_0000_1000)),
        frame(INIT_TENSOR, tensor()),
        # The big one: a weight upload (rpc_tensor | cache_flag u8 | offset u64 | data).
        frame(SET_TENSOR, tensor() + b"\x00" + u64(0) + rng.randbytes(6000)),
        frame(GRAPH_COMPUTE, graph),
        frame(GET_TENSOR, tensor() + u64(0) + u64(4096)),
        frame(BUFFER_CLEAR, u64(0x7F00_0000_1000) + b"\x00"),
    ]


def upstream_case() -> Case:
    rng = random.Random(7)
    common = _common_frames(rng)
    memset = (  # rpc_tensor | offset u64 | size u64 | value u8
        rng.randbytes(RPC_TENSOR_BYTES)
        + (64).to_bytes(8, "little")
        + (512).to_bytes(8, "little")
        + b"\x00"
    )
    assert len(memset) == 296 + 8 + 8 + 1
    items = (
        frame(DEVICE_COUNT, b""),
        *common[:5],
        frame(MEMSET_TENSOR, memset),
        common[5],
        frame(GRAPH_RECOMPUTE, (0).to_bytes(4, "little")),
        frame(MEMSET_TENSOR, memset),
        *common[6:],
        frame(FREE_BUFFER, (0x7F00_0000_1000).to_bytes(8, "little")),
    )
    return Case("upstream-7", HELLO_7X, reply_7x(), items, DialectDetected("upstream-7", "7.0.0"))


def fork30_case() -> Case:
    rng = random.Random(30)
    common = _common_frames(rng)
    push = (  # peer_id u32 | src rpc_tensor | dst rpc_tensor | offset u64 | size u64
        (2).to_bytes(4, "little")
        + rng.randbytes(2 * RPC_TENSOR_BYTES)
        + bytes(8)
        + (4096).to_bytes(8, "little")
    )
    items = (
        common[0],
        Register(FORK30_REGISTER_PEER, 1, "192.168.1.20:50052"),
        Register(FORK30_REGISTER_PEER, 2, "fd00::2a:50052"),
        *common[1:5],
        frame(FORK30_PUSH_TENSOR_TO_PEER, push),
        common[5],
        # Re-registration with an endpoint as long as the field allows.
        Register(FORK30_REGISTER_PEER, 3, "h" * 120 + ":50052"),
        frame(FORK30_PUSH_TENSOR_TO_PEER, push),
        *common[6:],
    )
    detected = DialectDetected("b2b-fork-3.0", "3.0.2")
    return Case("b2b-fork-3.0", HELLO_FORK, reply_fork(0, 2), items, detected)


def fork31_case() -> Case:
    rng = random.Random(31)
    common = _common_frames(rng)
    # In 3.1, 17 is SET_TENSOR_GGUF: even shaped and sized exactly like a 3.0 REGISTER_PEER it
    # must pass untouched.
    lookalike = register_payload(1, b"192.168.1.20:50052")
    items = (
        common[0],
        Register(FORK31_REGISTER_PEER, 1, "192.168.1.20:50052"),
        frame(FORK31_SET_TENSOR_GGUF, lookalike),
        *common[1:6],
        Register(FORK31_REGISTER_PEER, 2, "10.0.0.9:50052"),
        *common[6:],
    )
    detected = DialectDetected("b2b-fork-3.1", "3.1.0")
    return Case("b2b-fork-3.1", HELLO_FORK, reply_fork(1, 0), items, detected)


CASES = [upstream_case(), fork30_case(), fork31_case()]
CASE_IDS = [c.name for c in CASES]


def test_cases_are_what_they_claim() -> None:
    """Guard the fixtures: 7.x must contain MEMSET_TENSOR 17, and fork expectations must differ."""
    up, f30, f31 = CASES
    assert up.client == up.expected
    assert f30.client != f30.expected and len(f30.client) == len(f30.expected)
    assert f31.client != f31.expected and len(f31.client) == len(f31.expected)
    assert up.commands[MEMSET_TENSOR] == 2
    assert 5000 < len(up.client) < MAX_HELD_BEFORE_REPLY_BYTES


class Recorder:
    """A resolver over RESOLVED that remembers what it was asked."""

    def __init__(self, table: dict[int, str] | None = None) -> None:
        self.table = RESOLVED if table is None else table
        self.calls: list[int] = []

    def __call__(self, peer_id: int) -> str | None:
        self.calls.append(peer_id)
        return self.table.get(peer_id)


def drive(
    steps: list[tuple[str, bytes]], flt: RpcStreamFilter | None = None
) -> tuple[bytes, list[object], RpcStreamFilter]:
    """Apply ("c"|"s", data) steps, draining after each; return output, events and filter."""
    flt = flt if flt is not None else RpcStreamFilter(Recorder())
    out = bytearray()
    for side, data in steps:
        if side == "c":
            flt.receive_from_client(data)
        else:
            flt.receive_from_server(data)
        out += flt.data_to_server()
    events = []
    while (event := flt.next_event()) is not None:
        events.append(event)
    return bytes(out), events, flt


def check(case: Case, steps: list[tuple[str, bytes]]) -> None:
    out, events, flt = drive(steps)
    assert out == case.expected
    assert events == case.events
    assert flt.commands_seen == case.commands
    assert flt.frames_seen == sum(case.commands.values())
    assert flt.dialect is not None and flt.dialect.name == case.name


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_client_split_with_reply_at_the_split(case: Case) -> None:
    client = case.client
    for i in range(len(client) + 1):
        flt = RpcStreamFilter(Recorder())
        flt.receive_from_client(client[:i])
        # Before the reply only the HELLO frame may go out, and all of it once complete.
        released = b"" if i < HEADER_BYTES else client[: min(i, len(case.hello))]
        assert flt.data_to_server() == released, i
        check(case, [("c", client[:i]), ("s", case.reply), ("c", client[i:])])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_client_split_with_reply_first(case: Case) -> None:
    client = case.client
    for i in range(len(client) + 1):
        check(case, [("s", case.reply), ("c", client[:i]), ("c", client[i:])])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_reply_split_around_the_hello(case: Case) -> None:
    client, reply, n = case.client, case.reply, len(case.hello)
    for j in range(len(reply) + 1):
        for cut in (n - 1, n, n + 1, n + 200):
            steps = [("s", reply[:j]), ("c", client[:cut]), ("s", reply[j:]), ("c", client[cut:])]
            check(case, steps)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_one_byte_at_a_time(case: Case) -> None:
    client, reply = case.client, case.reply
    steps = [("c", client[k : k + 1]) for k in range(len(case.hello))]
    steps += [("s", reply[k : k + 1]) for k in range(len(reply))]
    steps += [("c", client[k : k + 1]) for k in range(len(case.hello), len(client))]
    check(case, steps)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [data[a:b] for a, b in pairwise(points)]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_splits_and_interleavings(case: Case, data: st.DataObject) -> None:
    client = _split(case.client, data.draw(st.lists(st.integers(0, 1 << 20), max_size=25)))
    server = _split(case.reply, data.draw(st.lists(st.integers(0, 64), max_size=6)))
    order = data.draw(st.permutations(["c"] * len(client) + ["s"] * len(server)))
    chunks = {"c": iter(client), "s": iter(server)}
    check(case, [(side, next(chunks[side])) for side in order])


def test_client_bytes_wait_for_the_reply() -> None:
    case = CASES[1]
    flt = RpcStreamFilter(Recorder())
    flt.receive_from_client(case.client)
    assert flt.data_to_server() == case.hello
    assert flt.data_to_server() == b""
    assert flt.next_event() is None
    flt.receive_from_server(case.reply[:-1])
    assert flt.data_to_server() == b""
    flt.receive_from_server(case.reply[-1:] + b"later server bytes are ignored")
    assert flt.data_to_server() == case.expected[len(case.hello) :]


def test_large_payload_passes_as_the_same_objects() -> None:
    """Hot path: a payload chunk comes back as the very object fed in (no copy)."""
    flt = RpcStreamFilter(Recorder())
    flt.receive_from_client(HELLO_7X)
    flt.receive_from_server(reply_7x())
    assert flt.data_to_server() == HELLO_7X
    chunk_bytes, n_chunks = 1 << 20, 16
    header = frame(SET_TENSOR, b"")[:1] + (chunk_bytes * n_chunks).to_bytes(8, "little")
    flt.receive_from_client(header)
    assert flt.data_to_server() == header
    for k in range(n_chunks):
        chunk = bytes([k]) * chunk_bytes
        flt.receive_from_client(chunk)
        assert flt.data_to_server() is chunk
    tail = frame(DEVICE_COUNT, b"")
    flt.receive_from_client(tail)
    assert flt.data_to_server() == tail
    assert flt.commands_seen == Counter({HELLO: 1, SET_TENSOR: 1, DEVICE_COUNT: 1})


def _after_handshake(
    hello: bytes, reply: bytes, resolver: Recorder | None = None, **kw: int
) -> RpcStreamFilter:
    flt = RpcStreamFilter(resolver or Recorder(), **kw)
    flt.receive_from_client(hello)
    flt.receive_from_server(reply)
    assert flt.data_to_server() == hello
    assert isinstance(flt.next_event(), DialectDetected)
    return flt


def test_upstream_cmd17_never_rewritten_even_at_register_peer_size() -> None:
    resolver = Recorder()
    flt = _after_handshake(HELLO_7X, reply_7x(), resolver)
    data = frame(MEMSET_TENSOR, register_payload(1, b"192.168.1.20:50052"))
    flt.receive_from_client(data)
    assert flt.data_to_server() == data
    assert resolver.calls == [] and flt.next_event() is None


@pytest.mark.parametrize(
    "size", [0, 4, REGISTER_PEER_PAYLOAD_BYTES - 1, REGISTER_PEER_PAYLOAD_BYTES + 1, 1000]
)
def test_register_peer_with_another_size_passes_untouched(size: int) -> None:
    resolver = Recorder()
    flt = _after_handshake(HELLO_FORK, reply_fork(0), resolver)
    payload = register_payload(1, b"192.168.1.20:50052").ljust(size, b"x")[:size]
    data = frame(FORK30_REGISTER_PEER, payload) + frame(DEVICE_COUNT, b"")
    for k in range(len(data)):
        flt.receive_from_client(data[k : k + 1])
    assert flt.data_to_server() == data
    assert resolver.calls == [] and flt.next_event() is None


def test_unresolved_peer_goes_on_with_no_endpoint_and_an_event() -> None:
    """A member must not make our rpc-server connect wherever it likes: what we cannot map is cleared."""
    flt = _after_handshake(HELLO_FORK, reply_fork(0), Recorder({}))
    data = frame(FORK30_REGISTER_PEER, register_payload(9, b"192.168.1.20:50052"))
    flt.receive_from_client(data)
    assert flt.data_to_server() == frame(FORK30_REGISTER_PEER, register_payload(9, b""))
    assert flt.next_event() == EndpointUnresolved(9)
    assert flt.next_event() is None


def test_endpoint_must_leave_room_for_the_nul() -> None:
    longest = "a" * (REGISTER_PEER_ENDPOINT_BYTES - 1)
    too_long = "b" * REGISTER_PEER_ENDPOINT_BYTES
    flt = _after_handshake(HELLO_FORK, reply_fork(0), Recorder({1: too_long, 2: longest}))
    first = frame(FORK30_REGISTER_PEER, register_payload(1, b"10.0.0.1:50052"))
    second = frame(FORK30_REGISTER_PEER, register_payload(2, b"10.0.0.2:50052"))
    flt.receive_from_client(first + second)
    out = flt.data_to_server()
    assert out[: len(first)] == frame(FORK30_REGISTER_PEER, register_payload(1, b""))
    assert out[len(first) :] == frame(FORK30_REGISTER_PEER, register_payload(2, longest.encode()))
    assert out[-1] == 0  # the terminating NUL
    assert flt.next_event() == EndpointTooLong(1, too_long)
    assert flt.next_event() == EndpointRewritten(2, "10.0.0.2:50052", longest)


def test_rewrite_clears_every_byte_of_the_old_endpoint() -> None:
    flt = _after_handshake(HELLO_FORK, reply_fork(0))
    # A short endpoint followed by leftovers that a sloppy client left behind the NUL.
    field = b"10.9.8.7:50052\x00" + b"\xff" * 113
    flt.receive_from_client(frame(FORK30_REGISTER_PEER, register_payload(1, field)))
    rewritten = frame(FORK30_REGISTER_PEER, register_payload(1, RESOLVED[1].encode()))
    assert flt.data_to_server() == rewritten
    assert flt.next_event() == EndpointRewritten(1, "10.9.8.7:50052", RESOLVED[1])


FORGED_ENDPOINT = b"10.0.0.9:1\nevent 1 rewritten 0 x y\r \\\x1b[31m\xff"


def test_a_members_endpoint_reaches_the_log_as_one_printable_word() -> None:
    """A REGISTER_PEER endpoint can carry a newline and a forged report line: the event escapes it."""
    flt = _after_handshake(HELLO_FORK, reply_fork(0))
    flt.receive_from_client(frame(FORK30_REGISTER_PEER, register_payload(1, FORGED_ENDPOINT)))
    flt.data_to_server()
    event = flt.next_event()
    escaped = r"10.0.0.9:1\x0aevent\x201\x20rewritten\x200\x20x\x20y\x0d\x20\x5c\x1b[31m\xff"
    assert event == EndpointRewritten(1, escaped, RESOLVED[1])
    assert all(0x20 <= ord(c) < 0x7F for c in str(event)) and " " not in event.original


def test_printable_word_is_cut_at_an_escape_and_says_so() -> None:
    assert printable_word(b"") == "-" and printable_word(b"a" * 80) == "a" * 80
    assert printable_word(b"a" * 81) == "a" * 77 + "..."
    assert printable_word(b"a" * 75 + b"\n" * 10) == "a" * 75 + "..."  # \x0a would end past 77


@pytest.mark.parametrize(
    ("minor", "patch", "name", "register_cmd"),
    [
        (0, 0, "b2b-fork-3.0", 17),
        (0, 9, "b2b-fork-3.0", 17),
        (1, 0, "b2b-fork-3.1", 18),
        (4, 2, "b2b-fork-3.1", 18),
    ],
)
def test_fork_minor_picks_the_register_peer_number(
    minor: int, patch: int, name: str, register_cmd: int
) -> None:
    flt = RpcStreamFilter(Recorder())
    flt.receive_from_client(HELLO_FORK)
    flt.receive_from_server(reply_fork(minor, patch))
    assert flt.next_event() == DialectDetected(name, f"3.{minor}.{patch}")
    assert flt.dialect is not None and flt.dialect.register_peer_cmd == register_cmd
    for cmd in (17, 18):
        flt.receive_from_client(frame(cmd, register_payload(1, b"10.0.0.1:50052")))
    flt.data_to_server()
    assert flt.next_event() == EndpointRewritten(1, "10.0.0.1:50052", RESOLVED[1])
    assert flt.next_event() is None


def test_our_b2b_dialect_is_told_apart_by_its_hello_flag() -> None:
    """A b2b rpc-server (7.0.1 with the flag) gets REGISTER_PEER (18) rewritten; a stock one's 18 is left alone."""
    register = frame(18, register_payload(1, b"10.0.0.1:50052"))
    for flags, patch, name, expected in [
        (B2B_HELLO_FLAG, 1, "mesh-b2b-7", frame(18, register_payload(1, RESOLVED[1].encode()))),
        (0, 0, "upstream-7", register),
    ]:
        flt = RpcStreamFilter(Recorder())
        out, events, _ = drive([("c", HELLO_7X + register), ("s", reply_7x(patch=patch, flags=flags))], flt)
        assert out == HELLO_7X + expected
        assert events[0] == DialectDetected(name, f"7.0.{patch}")


def test_a_new_dialect_is_one_more_row() -> None:
    """A hypothetical 7.x with a b2b caps flag: one row above the others in the table."""
    b2b_flag = 1 << 0
    table = (
        RpcDialect(
            "upstream-7-caps-b2b", 7, 0, None, 24, 28, register_peer_cmd=18, required_caps=b2b_flag
        ),
        *DIALECTS,
    )
    register = frame(18, register_payload(1, b"10.0.0.1:50052"))
    for caps, name, expected in [
        (b2b_flag, "upstream-7-caps-b2b", frame(18, register_payload(1, RESOLVED[1].encode()))),
        (0, "upstream-7", register),
    ]:
        flt = RpcStreamFilter(Recorder(), dialects=table)
        out, events, _ = drive([("c", HELLO_7X + register), ("s", reply_7x(caps=caps))], flt)
        assert out == HELLO_7X + expected
        assert events[0] == DialectDetected(name, "7.0.0")


def test_oversized_size_field_raises() -> None:
    flt = _after_handshake(HELLO_7X, reply_7x())
    at_limit = bytes([SET_TENSOR]) + MAX_RPC_FRAME_BYTES.to_bytes(8, "little")
    flt.receive_from_client(at_limit)
    assert flt.data_to_server() == at_limit
    flt = _after_handshake(HELLO_7X, reply_7x())
    with pytest.raises(FrameTooLargeError):
        over = (MAX_RPC_FRAME_BYTES + 1).to_bytes(8, "little")
        flt.receive_from_client(bytes([SET_TENSOR]) + over)


def test_custom_limit_and_held_bytes_checked_when_the_reply_arrives() -> None:
    flt = RpcStreamFilter(Recorder(), max_frame_bytes=100)
    held = frame(ALLOC_BUFFER, bytes(100)) + frame(SET_TENSOR, bytes(101))
    flt.receive_from_client(HELLO_FORK + held)
    with pytest.raises(FrameTooLargeError):
        flt.receive_from_server(reply_fork(0))


def test_too_much_before_the_reply_raises() -> None:
    flt = RpcStreamFilter(Recorder())
    flt.receive_from_client(HELLO_7X + bytes(MAX_HELD_BEFORE_REPLY_BYTES))
    with pytest.raises(MalformedMessageError):
        flt.receive_from_client(b"\x00")


@pytest.mark.parametrize(
    ("client", "reply"),
    [
        (b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n", b"HTTP/1.1 400 Bad Request\r\n\r\n"),
        (frame(DEVICE_COUNT, b"") + frame(FORK30_REGISTER_PEER, register_payload(1, b"x:1")), b""),
        (frame(HELLO, bytes(5)), hello_reply(bytes(5))),  # no dialect has a 5-byte HELLO
        (HELLO_7X, reply_7x(major=9)),  # unknown major
        (HELLO_FORK, reply_7x(major=3)),  # 3.x with a 7.x-shaped reply
        (HELLO_7X, reply_fork(0)),  # 7.x-shaped request, fork reply
        (HELLO_FORK, hello_reply(bytes(40))),  # no dialect has a 40-byte reply
    ],
)
def test_unknown_dialect_passes_everything_untouched(client: bytes, reply: bytes) -> None:
    resolver = Recorder()
    # After the decision nothing is parsed: a REGISTER_PEER lookalike and a wild size field pass.
    lookalike = frame(FORK30_REGISTER_PEER, register_payload(1, b"x:1"))
    rest = lookalike + b"\x06" + b"\xff" * 8 + b"tail"
    schedules = [
        [("c", client[:i]), ("s", reply), ("c", client[i:] + rest)] for i in range(len(client) + 1)
    ]
    schedules.append([("c", client + rest), ("s", reply)])  # bytes held behind HELLO get released
    for steps in schedules:
        out, events, flt = drive(steps, RpcStreamFilter(resolver))
        assert out == client + rest
        assert len(events) == 1 and isinstance(events[0], DialectUnknown), events
        assert flt.dialect is None
    assert resolver.calls == []


_fuzz_frames = st.one_of(
    st.binary(max_size=40),
    st.builds(frame, st.integers(0, 255), st.binary(max_size=300)),
    st.builds(
        lambda cmd, peer, ep: frame(cmd, register_payload(peer, ep)),
        st.sampled_from([17, 18]),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=128),
    ),
)


@settings(max_examples=400, deadline=None)
@given(
    handshake=st.sampled_from(
        [None, (HELLO_7X, reply_7x()), (HELLO_FORK, reply_fork(0)), (HELLO_FORK, reply_fork(1))]
    ),
    body=st.lists(_fuzz_frames, max_size=12),
    server=st.binary(max_size=40),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=8),
    reply_at=st.integers(0, 10),
    max_frame_bytes=st.sampled_from([MAX_RPC_FRAME_BYTES, 200]),
)
def test_fuzz_raises_only_wire_errors(
    handshake: tuple[bytes, bytes] | None,
    body: list[bytes],
    server: bytes,
    cuts: list[int],
    reply_at: int,
    max_frame_bytes: int,
) -> None:
    hello, reply = handshake or (b"", b"")
    client = hello + b"".join(body)
    chunks = _split(client, cuts)
    steps = [("c", c) for c in chunks]
    steps.insert(min(reply_at, len(steps)), ("s", reply + server))

    def resolve(peer_id: int) -> str | None:
        return [None, "127.0.0.1:1", "x" * 200][peer_id % 3]

    flt = RpcStreamFilter(resolve, max_frame_bytes=max_frame_bytes)
    try:
        out, events, _ = drive(steps, flt)
    except WireError:
        return
    assert len(out) <= len(client)
    if not any(isinstance(e, (EndpointRewritten, EndpointUnresolved, EndpointTooLong)) for e in events):
        assert client.startswith(out)  # nothing but REGISTER_PEER endpoints is ever changed


def rpc_tensor(name: bytes) -> bytes:
    """A 296-byte rpc_tensor that only has a name."""
    return bytes(228) + name.ljust(64, b"\0") + bytes(4)


def test_activation_bytes_count_layer_outputs_only() -> None:
    """SET/GET of `l_out-N` (or the scheduler's copy of it) and every PUSH count; weights and inputs do not."""
    moved = frame(6, rpc_tensor(b"RPC0[127.0.0.1:5]#l_out-10#0") + bytes(9) + bytes(2304))
    fetched = frame(8, rpc_tensor(b"l_out-9") + (0).to_bytes(8, "little") + (2304).to_bytes(8, "little"))
    pushed = frame(19, bytes(4) + rpc_tensor(b"l_out-20") * 2 + bytes(16))
    # The asynchronous push: the command to the source, the tensor to the peer, the wait at the peer.
    pushed += frame(20, bytes(12) + rpc_tensor(b"l_out-21") * 2 + bytes(16))
    pushed += frame(21, bytes(8) + rpc_tensor(b"l_out-21") + bytes(9) + bytes(2304))
    pushed += frame(22, bytes(8))
    weights = frame(6, rpc_tensor(b"blk.0.ffn_up.weight") + bytes(9) + bytes(4096))
    inputs = frame(6, rpc_tensor(b"RPC0[127.0.0.1:5]#attn_inp_kq_mask#0") + bytes(9) + bytes(512))
    lookalike = frame(6, rpc_tensor(b"l_out-x") + bytes(9) + bytes(64))
    stream = moved + fetched + pushed + weights + inputs + lookalike
    for flags in (B2B_HELLO_FLAG, 0):
        flt = RpcStreamFilter(Recorder())
        flt.receive_from_client(HELLO_7X)
        flt.receive_from_server(reply_7x(patch=1, flags=flags))
        for i in range(len(stream)):  # byte by byte: names are read across chunk boundaries
            flt.receive_from_client(stream[i:i + 1])
        assert flt.data_to_server() == HELLO_7X + stream  # counting alters nothing
        push_bytes = len(pushed) if flags else 0  # a stock server has no push commands: 19-22 are none
        assert flt.activation_bytes_to_server == len(moved) + len(fetched) + push_bytes
        assert flt.activation_bytes_from_server == 8 + 2304 + (8 + 1 if flags else 0)


def test_buffers_asked_for_are_counted() -> None:
    """ALLOC_BUFFER's size: what the stream holds in rpc-server until it closes."""
    allocs = b"".join(frame(0, (0).to_bytes(4, "little") + n.to_bytes(8, "little")) for n in (1 << 20, 4096))
    flt = RpcStreamFilter(Recorder())
    out, _, _ = drive([("c", HELLO_7X), ("s", reply_7x()), ("c", allocs)], flt)
    assert out == HELLO_7X + allocs
    assert flt.allocated_bytes == (1 << 20) + 4096
