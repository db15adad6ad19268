"""Fuzz the decoders that read what peers send and what people paste.

The ticket decoder, the gossip codec and the RPC stream filter get random, truncated,
bit-flipped and split input and are held to one contract: only MeshError subclasses
escape (any other exception fails the test), and what a decoder holds stays within its
documented limit whatever a length field claims. test_ticket, test_gossip and
test_rpc_framing cover well-formed input and the first layer of junk; these go past the
outer checks: tickets with valid checksums, frames whose JSON is valid but hostile, each
dialect's handshake followed by hostile frames. benchmarks/fuzz_*.py hold the decoders to
the same contract under atheris for longer; the last test keeps those targets honest.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from benchmarks import fuzz_gossip, fuzz_rpc_framing, fuzz_ticket
from benchmarks.fuzz_rpc_framing import dialect_handshake, rpc_frame
from benchmarks.fuzzing import guarded
from mesh_sidecar.errors import FrameTooLargeError, TicketError, TicketMalformedError, WireError
from mesh_sidecar.wire.auth import MESH_SECRET_BYTES
from mesh_sidecar.wire.frames import FRAME_HEADER, MAX_CONTROL_MESSAGE_BYTES, FrameDecoder, encode_frame
from mesh_sidecar.wire.gossip import (
    GOSSIP_WIRE_VERSION,
    MAX_EPOCH,
    MESSAGE_TYPES,
    GossipMessage,
    Ping,
    Rekey,
    decode_message,
    encode_message,
)
from mesh_sidecar.wire.rpc_framing import (
    DIALECTS,
    HELLO_CMD,
    HELLO_REPLY_SIZE_BYTES,
    MAX_HELD_BEFORE_REPLY_BYTES,
    MAX_RPC_FRAME_BYTES,
    REGISTER_PEER_ENDPOINT_BYTES,
    REGISTER_PEER_FRAME_BYTES,
    RPC_HEADER_BYTES,
    DialectDetected,
    DialectUnknown,
    EndpointRewritten,
    EndpointTooLong,
    EndpointUnresolved,
    RpcDialect,
    RpcEvent,
    RpcStreamFilter,
)
from mesh_sidecar.wire.ticket import (
    MAX_TICKET_ADDRESSES,
    TICKET_PREFIX,
    TICKET_VERSION,
    Ticket,
    decode_ticket,
    encode_ticket,
)
from tests.unit.test_gossip import chunked, node_ids
from tests.unit.test_gossip import messages as gossip_messages
from tests.unit.test_ticket import _b32, _raw_body, _with_checksum, tickets

KIB = 1024
MIB = 1024 * KIB
# The most a refusal may allocate: a header, an exception and its message. Far below the
# sizes the attacks claim and below the 1 MiB fed after their headers, so a decoder that
# reserved the claim, or copied the input, fails.
REFUSAL_BYTES = 64 * KIB
TICKET_CHECKSUM_BYTES = 4
SET_TENSOR_CMD = 6  # the command that carries the biggest real frames


@contextmanager
def allocation_peak() -> Iterator[list[int]]:
    """Trace allocations in the block; ``peak[0]`` is the most held at once, after it."""
    peak = [0]
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def flip_bit(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def interleave(
    data: st.DataObject, client: list[bytes], server: list[bytes]
) -> list[tuple[str, bytes]]:
    """Client and server reads in a random order that keeps each side's own order."""
    order = data.draw(st.permutations(["c"] * len(client) + ["s"] * len(server)), label="order")
    reads = {"c": iter(client), "s": iter(server)}
    return [(side, next(reads[side])) for side in order]


cuts = st.lists(st.integers(0, 1 << 12), max_size=8)


# --- ticket ---------------------------------------------------------------------------------


def decode_or_refuse(text: str) -> Ticket | None:
    """The ticket, or None when refused with a TicketError; anything else fails the test."""
    try:
        return decode_ticket(text)
    except TicketError:
        return None


@st.composite
def ticket_payloads(draw: st.DrawFn) -> bytes:
    """Ticket bytes before the checksum: mostly well-shaped, every field sometimes wrong."""
    version = draw(st.just(TICKET_VERSION) | st.integers(0, 255))
    keys = draw(st.binary(min_size=64, max_size=64))  # node id + mesh secret
    entries = b""
    n_entries = draw(st.integers(0, MAX_TICKET_ADDRESSES + 1))
    for _ in range(n_entries):
        family = draw(st.sampled_from([4, 6]) | st.integers(0, 255))
        ip_bytes = 16 if family == 6 else 4
        entries += bytes([family]) + draw(st.binary(min_size=ip_bytes, max_size=ip_bytes))
        entries += draw(st.integers(0, 65535)).to_bytes(2, "big")
    n_addr = max(0, n_entries + draw(st.sampled_from([0, 0, 0, -1, 1])))
    tail = draw(st.just(b"") | st.binary(max_size=3))
    return bytes([version]) + keys + bytes([n_addr]) + entries + tail


@settings(max_examples=300, deadline=None)
@given(ticket_payloads() | st.binary(max_size=400), st.booleans())
def test_raw_ticket_bytes_with_or_without_a_valid_checksum(
    payload: bytes, checksummed: bool
) -> None:
    text = _with_checksum(payload) if checksummed else TICKET_PREFIX + _b32(payload)
    ticket = decode_or_refuse(text)
    if ticket is not None:
        assert encode_ticket(ticket) == text  # one spelling per ticket: no other text decodes


@settings(max_examples=150, deadline=None)
@given(tickets, st.data())
def test_cut_or_bit_flipped_tickets_are_refused(ticket: Ticket, data: st.DataObject) -> None:
    text = encode_ticket(ticket)
    raw = _raw_body(text)
    with pytest.raises(TicketError):
        decode_ticket(text[: data.draw(st.integers(0, len(text) - 1), label="cut")])

    bit = data.draw(st.integers(0, 8 * len(raw) - 1), label="bit")
    with pytest.raises(TicketError):  # the checksum, or a length the flip broke, catches it
        decode_ticket(TICKET_PREFIX + _b32(flip_bit(raw, bit)))

    i = data.draw(st.integers(0, len(text) - 1), label="char")
    typo = chr(ord(text[i]) ^ (1 << data.draw(st.integers(0, 6), label="char bit")))
    with pytest.raises(TicketError):
        decode_ticket(text[:i] + typo + text[i + 1 :])

    # With the checksum made to match again, the flip reaches the field checks.
    payload = raw[:-TICKET_CHECKSUM_BYTES]
    if bit < 8 * len(payload):
        payload = flip_bit(payload, bit)
    resealed = _with_checksum(payload)
    decoded = decode_or_refuse(resealed)
    if decoded is not None:
        assert encode_ticket(decoded) == resealed


def test_a_huge_paste_is_refused_before_it_is_copied() -> None:
    text = TICKET_PREFIX + "a" * (16 * MIB)
    with allocation_peak() as peak, pytest.raises(TicketMalformedError):
        decode_ticket(text)
    assert peak[0] < REFUSAL_BYTES


# --- gossip ---------------------------------------------------------------------------------

rekeys = st.builds(
    Rekey,
    epoch=st.integers(0, MAX_EPOCH),
    secret=st.binary(min_size=MESH_SECRET_BYTES, max_size=MESH_SECRET_BYTES),
    removed=st.lists(node_ids, max_size=4, unique=True).map(tuple),
    by=node_ids,
)
every_message = st.one_of(gossip_messages, rekeys)

# JSON values at the edges: numbers past every limit (a float's range, u64, i64), the
# tokens NaN and Infinity (json.dumps writes them), lone surrogates (escaped, or raw and
# so invalid UTF-8), a node id's shape, and long text.
EDGE_VALUES = (
    10**400,
    -(10**400),
    2**64,
    2**63,
    -1,
    1e308,
    float("inf"),
    float("nan"),
    -0.0,
    True,
    None,
    "",
    "\ud800",
    "aa" * 32,
    "x" * 10_000,
    [],
    {},
)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(st.characters() | st.characters(categories=["Cs"]), max_size=300)
)
json_values = st.sampled_from(EDGE_VALUES) | st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


def json_places(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path (keys and indexes) to every part of a JSON value, itself first."""
    yield path
    if isinstance(value, dict | list):
        for key, child in value.items() if isinstance(value, dict) else enumerate(value):
            yield from json_places(child, (*path, key))


def changed_at(value: Any, path: tuple[Any, ...], change: Callable[[Any], Any]) -> Any:
    """A copy of ``value`` with the part at ``path`` replaced by ``change(part)``."""
    if not path:
        return change(value)
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = changed_at(value[path[0]], path[1:], change)
    return copy


def one_edit(body: Any, data: st.DataObject) -> Any:
    """``body`` with one part replaced, dropped, or given a sibling."""
    path = data.draw(st.sampled_from(list(json_places(body))), label="path")
    new = data.draw(json_values, label="new")
    match data.draw(st.sampled_from(["replace", "drop", "add"]), label="edit"):
        case "drop" if path:
            return changed_at(body, path[:-1], lambda parent: drop(parent, path[-1]))
        case "add":
            key = data.draw(st.text(max_size=12), label="key")
            return changed_at(body, path, lambda part: grow(part, key, new))
    return changed_at(body, path, lambda _part: new)


def drop(container: Any, key: Any) -> Any:
    if isinstance(container, dict):
        return {k: v for k, v in container.items() if k != key}
    return container[:key] + container[key + 1 :]


def grow(part: Any, key: str, new: Any) -> Any:
    if isinstance(part, dict):
        return {**part, key: new}
    return [*part, new] if isinstance(part, list) else new


def decode_stream(reads: list[bytes]) -> list[GossipMessage]:
    """A control stream, as the mesh reads one: the messages before a WireError (which ends the connection)."""
    decoder, got = FrameDecoder(MAX_CONTROL_MESSAGE_BYTES), []
    try:
        for read in reads:
            decoder.feed(read)
            while (payload := decoder.next_frame()) is not None:
                got.append(decode_message(payload))
    except WireError:
        pass
    return got


def test_the_message_strategy_covers_every_message_type() -> None:
    once = settings(database=None, max_examples=500, phases=[Phase.generate])  # no shrinking
    for cls in MESSAGE_TYPES.values():
        find(every_message, lambda msg, cls=cls: isinstance(msg, cls), settings=once)


def assert_decodes_to_relayable_or_refused(
    type_byte: int, body: Any, ascii_only: bool = True
) -> None:
    text = json.dumps(body, ensure_ascii=ascii_only)
    payload = bytes((GOSSIP_WIRE_VERSION, type_byte)) + text.encode("utf-8", "surrogatepass")
    got = decode_stream([encode_frame(payload)])
    for decoded in got:
        # What we accept from one peer we may relay to the others: it must encode again.
        assert decode_message(encode_message(decoded)) == decoded


@pytest.mark.parametrize("msg", fuzz_gossip.SAMPLES, ids=lambda msg: type(msg).__name__)
def test_every_field_of_every_message_given_every_edge_value(msg: GossipMessage) -> None:
    body = msg.to_body()
    for path in json_places(body):
        for value in EDGE_VALUES:
            assert_decodes_to_relayable_or_refused(
                msg.TYPE, changed_at(body, path, lambda _, v=value: v)
            )


def test_the_samples_cover_every_message_type() -> None:
    assert {type(msg) for msg in fuzz_gossip.SAMPLES} == set(MESSAGE_TYPES.values())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(every_message, st.booleans(), st.data())
def test_valid_bodies_with_one_field_changed_raise_only_wire_errors(
    msg: GossipMessage, ascii_only: bool, data: st.DataObject
) -> None:
    assert_decodes_to_relayable_or_refused(msg.TYPE, one_edit(msg.to_body(), data), ascii_only)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(every_message, min_size=1, max_size=4), cuts, st.data())
def test_cut_flipped_or_trailed_streams_deliver_every_frame_before_the_damage(
    msgs: list[GossipMessage], read_cuts: list[int], data: st.DataObject
) -> None:
    frames = [encode_frame(encode_message(m)) for m in msgs]
    stream = b"".join(frames)
    match data.draw(st.sampled_from(["flip", "cut", "trail"]), label="damage"):
        case "flip":
            bit = data.draw(st.integers(0, 8 * len(stream) - 1), label="bit")
            damaged, first_bad = flip_bit(stream, bit), bit // 8
        case "cut":
            first_bad = data.draw(st.integers(0, len(stream) - 1), label="cut")
            damaged = stream[:first_bad]
        case _:
            damaged, first_bad = stream + data.draw(st.binary(min_size=1, max_size=64)), len(stream)
    ends = [sum(map(len, frames[: i + 1])) for i in range(len(frames))]
    intact = sum(end <= first_bad for end in ends)
    got = decode_stream(chunked(damaged, read_cuts))
    assert got[:intact] == msgs[:intact]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.binary(max_size=2048), cuts)
def test_any_length_prefix_holds_at_most_one_frame(
    length: int, rest: bytes, read_cuts: list[int]
) -> None:
    decode_stream(chunked(FRAME_HEADER.pack(length) + rest, read_cuts))


@pytest.mark.parametrize("claimed", [MAX_CONTROL_MESSAGE_BYTES + 1, 2**31, 2**32 - 1])
def test_a_huge_length_prefix_is_refused_as_soon_as_it_arrives(claimed: int) -> None:
    decoder = FrameDecoder(MAX_CONTROL_MESSAGE_BYTES)
    with allocation_peak() as peak:
        decoder.feed(FRAME_HEADER.pack(claimed) + bytes((GOSSIP_WIRE_VERSION, Ping.TYPE)))
        with pytest.raises(FrameTooLargeError):
            decoder.next_frame()  # not waiting for (or reserving) the bytes it claims
    assert peak[0] < REFUSAL_BYTES


def test_a_frame_is_held_as_it_arrives_not_as_its_length_claims() -> None:
    head = FRAME_HEADER.pack(MAX_CONTROL_MESSAGE_BYTES) + bytes((GOSSIP_WIRE_VERSION, Ping.TYPE))
    decoder = FrameDecoder(MAX_CONTROL_MESSAGE_BYTES)
    with allocation_peak() as peak:
        decoder.feed(head)
        for _ in range(16):
            decoder.feed(bytes(KIB))
            assert decoder.next_frame() is None
    assert peak[0] < REFUSAL_BYTES


# --- RPC framing ----------------------------------------------------------------------------

HEADER = struct.Struct("<BQ")
FORK_DIALECTS = [d for d in DIALECTS if d.register_peer_cmd is not None]
REGISTER_PEER_CMDS = sorted({d.register_peer_cmd for d in FORK_DIALECTS})
LONGEST_REPLY_BYTES = HELLO_REPLY_SIZE_BYTES + max(d.hello_reply_bytes for d in DIALECTS)


def dialect_id(dialect: RpcDialect) -> str:
    return dialect.name


def register_frame(cmd: int, peer_id: int, endpoint: bytes) -> bytes:
    return rpc_frame(cmd, struct.pack(f"<I{REGISTER_PEER_ENDPOINT_BYTES}s", peer_id, endpoint))


@dataclass(frozen=True)
class Resolver:
    """Endpoints by peer id modulo 8; None where the table has none."""

    table: dict[int, str]

    def __call__(self, peer_id: int) -> str | None:
        return self.table.get(peer_id % 8)


endpoints = st.text(max_size=200) | st.sampled_from(
    ["127.0.0.1:41001", "x" * 127, "x" * 128, "\u00fc" * 64, "x" * 10_000]
)
resolvers = st.builds(Resolver, st.dictionaries(st.integers(0, 7), endpoints))
size_fields = st.integers(0, 2**64 - 1) | st.sampled_from(
    [MAX_RPC_FRAME_BYTES, MAX_RPC_FRAME_BYTES + 1, 2**60, 2**64 - 1]
)
hostile_frames = st.one_of(
    st.binary(max_size=40),
    st.builds(rpc_frame, st.integers(0, 255), st.binary(max_size=200)),
    st.builds(
        lambda cmd, size, tail: HEADER.pack(cmd, size) + tail,
        st.integers(0, 255),
        size_fields,
        st.binary(max_size=32),
    ),
    st.builds(
        register_frame,
        st.sampled_from(REGISTER_PEER_CMDS),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=128),
    ),
)


def assert_within_limits(flt: RpcStreamFilter) -> None:
    """What the rpc_framing docstring says a filter holds, and no more (reads private fields)."""
    assert len(flt._header) <= RPC_HEADER_BYTES
    assert flt._register is None or len(flt._register) <= REGISTER_PEER_FRAME_BYTES
    assert len(flt._reply_buf) <= LONGEST_REPLY_BYTES
    assert flt._held_bytes <= MAX_HELD_BEFORE_REPLY_BYTES


def run_filter(
    flt: RpcStreamFilter, steps: list[tuple[str, bytes]]
) -> tuple[bytes, list[RpcEvent], WireError | None]:
    """Apply ("c" | "s", bytes) steps: what reached the server, the events, the WireError."""
    out, events = bytearray(), []
    try:
        for side, chunk in steps:
            if side == "c":
                flt.receive_from_client(chunk)
            else:
                flt.receive_from_server(chunk)
            out += flt.data_to_server()
            events.extend(iter(flt.next_event, None))
            assert_within_limits(flt)
    except WireError as exc:
        return bytes(out), events, exc
    return bytes(out), events, None


def detected(dialect: RpcDialect) -> DialectDetected:
    """The event the handshake from ``dialect_handshake`` gives."""
    reply = dialect_handshake(dialect)[1]
    version = ".".join(str(b) for b in reply[HELLO_REPLY_SIZE_BYTES : HELLO_REPLY_SIZE_BYTES + 3])
    return DialectDetected(dialect.name, version)


@pytest.mark.parametrize("dialect", DIALECTS, ids=dialect_id)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(hostile_frames, max_size=10),
    server_tail=st.binary(max_size=40),
    max_frame_bytes=st.sampled_from([MAX_RPC_FRAME_BYTES, 256]),
    resolver=resolvers,
    client_cuts=cuts,
    server_cuts=cuts,
    data=st.data(),
)
def test_hostile_frames_after_each_dialect_handshake(
    dialect: RpcDialect,
    frames: list[bytes],
    server_tail: bytes,
    max_frame_bytes: int,
    resolver: Resolver,
    client_cuts: list[int],
    server_cuts: list[int],
    data: st.DataObject,
) -> None:
    request, reply = dialect_handshake(dialect)
    client = request + b"".join(frames)
    steps = interleave(
        data, chunked(client, client_cuts), chunked(reply + server_tail, server_cuts)
    )
    out, events, _ = run_filter(RpcStreamFilter(resolver, max_frame_bytes=max_frame_bytes), steps)
    assert len(out) <= len(client)  # a rewrite keeps the frame's size
    assert events[:1] in ([], [detected(dialect)])


@pytest.mark.parametrize("dialect", FORK_DIALECTS, ids=dialect_id)
@settings(max_examples=100, deadline=None)
@given(
    registrations=st.lists(
        st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=128)), min_size=1, max_size=6
    ),
    resolver=resolvers,
    client_cuts=cuts,
)
def test_register_peer_with_any_endpoint_is_rewritten_in_place_or_cleared(
    dialect: RpcDialect,
    registrations: list[tuple[int, bytes]],
    resolver: Resolver,
    client_cuts: list[int],
) -> None:
    assert dialect.register_peer_cmd is not None
    request, reply = dialect_handshake(dialect)
    frames = [register_frame(dialect.register_peer_cmd, p, e) for p, e in registrations]
    client = request + b"".join(frames)
    steps = [("s", reply), *(("c", read) for read in chunked(client, client_cuts))]
    out, events, error = run_filter(RpcStreamFilter(resolver), steps)
    assert error is None
    assert events[0] == detected(dialect)
    assert len(out) == len(client) and out.startswith(request)
    offset = len(request)
    for (peer_id, _), sent, event in zip(registrations, frames, events[1:], strict=True):
        arrived = out[offset : offset + len(sent)]
        offset += len(sent)
        endpoint = resolver(peer_id)
        cleared = register_frame(dialect.register_peer_cmd, peer_id, b"")
        if endpoint is None:
            assert (event, arrived) == (EndpointUnresolved(peer_id), cleared)
        elif len(endpoint.encode()) >= REGISTER_PEER_ENDPOINT_BYTES:  # no room for the NUL
            assert (event, arrived) == (EndpointTooLong(peer_id, endpoint), cleared)
        else:
            assert isinstance(event, EndpointRewritten) and event.rewritten == endpoint
            assert arrived == register_frame(dialect.register_peer_cmd, peer_id, endpoint.encode())


@pytest.mark.parametrize("dialect", DIALECTS, ids=dialect_id)
@settings(max_examples=100, deadline=None)
@given(
    in_reply=st.booleans(),
    frames=st.lists(hostile_frames, max_size=6),
    resolver=resolvers,
    client_cuts=cuts,
    data=st.data(),
)
def test_bit_flipped_handshakes_are_detected_or_passed_untouched(
    dialect: RpcDialect,
    in_reply: bool,
    frames: list[bytes],
    resolver: Resolver,
    client_cuts: list[int],
    data: st.DataObject,
) -> None:
    request, reply = dialect_handshake(dialect)
    damaged = reply if in_reply else request
    damaged = flip_bit(damaged, data.draw(st.integers(0, 8 * len(damaged) - 1), label="bit"))
    request, reply = (request, damaged) if in_reply else (damaged, reply)
    client = request + b"".join(frames)
    steps = interleave(data, chunked(client, client_cuts), [reply])
    out, events, _ = run_filter(RpcStreamFilter(resolver), steps)
    assert len(out) <= len(client)
    if events and isinstance(events[0], DialectUnknown):
        assert out == client  # a stream the filter does not understand passes untouched


def after_handshake(dialect: RpcDialect) -> RpcStreamFilter:
    request, reply = dialect_handshake(dialect)
    flt = RpcStreamFilter(Resolver({}))
    _, events, error = run_filter(flt, [("c", request), ("s", reply)])
    assert error is None and events == [detected(dialect)]
    return flt


@pytest.mark.parametrize("size", [MAX_RPC_FRAME_BYTES + 1, 2**60, 2**64 - 1])
@pytest.mark.parametrize("dialect", DIALECTS, ids=dialect_id)
def test_a_huge_size_field_is_refused_without_allocating(dialect: RpcDialect, size: int) -> None:
    flt = after_handshake(dialect)
    attack = HEADER.pack(SET_TENSOR_CMD, size) + bytes(MIB)
    with allocation_peak() as peak, pytest.raises(FrameTooLargeError):
        flt.receive_from_client(attack)
    assert peak[0] < REFUSAL_BYTES


def test_a_frame_at_the_limit_streams_through_without_being_held() -> None:
    flt = after_handshake(DIALECTS[0])
    flt.receive_from_client(HEADER.pack(SET_TENSOR_CMD, MAX_RPC_FRAME_BYTES))
    flt.data_to_server()
    reads = [bytes(256 * KIB) for _ in range(8)]
    with allocation_peak() as peak:
        for read in reads:
            flt.receive_from_client(read)
            flt.data_to_server()
    assert peak[0] < REFUSAL_BYTES


@pytest.mark.parametrize("side", ["client", "server"])
def test_a_huge_size_before_the_handshake_makes_the_stream_opaque_not_an_allocation(
    side: str,
) -> None:
    huge = 2**60
    flt = RpcStreamFilter(Resolver({}))
    if side == "client":
        client, server = HEADER.pack(HELLO_CMD, huge) + bytes(MIB), b""
    else:
        client = dialect_handshake(DIALECTS[0])[0]
        server = huge.to_bytes(HELLO_REPLY_SIZE_BYTES, "little") + bytes(MIB)
    with allocation_peak() as peak:
        flt.receive_from_client(client)
        flt.receive_from_server(server)
    assert peak[0] < REFUSAL_BYTES
    assert isinstance(flt.next_event(), DialectUnknown)
    assert_within_limits(flt)


# --- the atheris targets --------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [fuzz_ticket, fuzz_gossip, fuzz_rpc_framing],
    ids=lambda m: m.__name__.rsplit(".", 1)[1],
)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_atheris_targets_take_their_seeds_and_damaged_seeds(
    target: ModuleType, data: st.DataObject
) -> None:
    """Seeds decode cleanly; a damaged seed is refused with a MeshError at most."""
    seed = data.draw(st.sampled_from(target.seeds()), label="seed")
    target.fuzz_one(seed)
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        seed = flip_bit(seed, data.draw(st.integers(0, 8 * len(seed) - 1), label="bit"))
    guarded(target.fuzz_one)(seed[: data.draw(st.integers(0, len(seed)), label="cut")])
