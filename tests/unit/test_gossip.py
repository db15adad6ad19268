"""Gossip: the wire codec, its refusals, and membership across several in-memory nodes."""

from __future__ import annotations

import hashlib
import json
import sys
from collections import defaultdict, deque
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh_sidecar.errors import (
    FrameTooLargeError,
    MalformedMessageError,
    ProtocolVersionError,
    WireError,
)
from mesh_sidecar.identity import short_id
from mesh_sidecar.mesh.events import (
    LayersReported,
    LayersShared,
    LoopStalled,
    MemberJoined,
    MemberLeft,
    MemberLost,
    MemberRemoved,
    MemberUpdated,
    PeerDegraded,
    PeerLost,
    PeerRecovered,
    SecretRotated,
    UsedBy,
)
from mesh_sidecar.mesh.health import CONFIRM_FLOOR_S, DEGRADED_AFTER_S, LOOP_STALL_S, LOST_AFTER_S, Sign
from mesh_sidecar.mesh.membership import Dial, Disconnect, Membership, MemberState, Send
from mesh_sidecar.wire.frames import FRAME_HEADER, MAX_CONTROL_MESSAGE_BYTES, FrameDecoder, encode_frame
from mesh_sidecar.wire.gossip import (
    GOSSIP_WIRE_VERSION,
    MAX_ADDRESS_CHARS,
    MAX_ADDRESSES,
    MAX_BUILD_LABEL_CHARS,
    MAX_BYTES_PER_S,
    MAX_CAPACITY_ENTRIES,
    MAX_CAPACITY_KEY_CHARS,
    MAX_CAPACITY_VALUE,
    MAX_DEVICE_NAME_CHARS,
    MAX_DEVICES_PER_MEMBER,
    MAX_EPOCH,
    MAX_IN_FLIGHT,
    MAX_JUDGED_MEMBERS,
    MAX_JUDGED_MS,
    MAX_MEMBERS_PER_LIST,
    MAX_MODEL_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_NONCE,
    MAX_REASON_CHARS,
    MAX_RUN_ID,
    MAX_SERVED_MEMBERS,
    MAX_VERSION_CHARS,
    Leave,
    LlamaBuild,
    MemberInfo,
    MemberList,
    Observed,
    OfferedDevice,
    Ping,
    Pong,
    Rekey,
    RpcOrder,
    ServedModel,
    SlowWorker,
    decode_message,
    encode_message,
)
from mesh_sidecar.wire.gossip_fields import MAX_PORT
from mesh_sidecar.wire.layer_share import MAX_ERROR_CHARS, LayersFetched, LayerShare, SharedTensor
from mesh_sidecar.wire.rpc_hello import RpcVersion
from tests.helpers.meshes import PINNED_BUILD

FRAME_CAP = FRAME_HEADER.size + MAX_CONTROL_MESSAGE_BYTES  # one control frame, length included

# --- strategies ---------------------------------------------------------------------------

# What str.isprintable() accepts: everything but these categories (space is added back).
printable_chars = st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"))
node_ids = st.binary(min_size=32, max_size=32)
hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
    st.from_regex(r"[a-z0-9-]{1,20}(\.[a-z0-9-]{1,20}){0,3}", fullmatch=True),
)
addresses = st.builds(lambda h, p: f"{h}:{p}", hosts, st.integers(1, 65535))
capacities = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True),
    st.integers(0, MAX_CAPACITY_VALUE),
    max_size=MAX_CAPACITY_ENTRIES,
).map(lambda d: tuple(d.items()))
member_infos = st.builds(
    MemberInfo,
    node_id=node_ids,
    name=st.text(printable_chars | st.just(" "), min_size=1, max_size=MAX_NAME_CHARS),
    addresses=st.lists(addresses, max_size=MAX_ADDRESSES).map(tuple),
    version=st.from_regex(r"[!-~]{1,32}", fullmatch=True),
    capacity=capacities,
    serving=st.booleans(),
    rpc_ready=st.booleans(),
    llama_build=st.builds(
        LlamaBuild,
        rpc=st.none() | st.builds(RpcVersion, st.integers(0, 255), st.integers(0, 255), st.integers(0, 255)),
        b2b=st.booleans(),
        llama_cpp=st.from_regex(f"[ -~]{{1,{MAX_BUILD_LABEL_CHARS}}}", fullmatch=True),
    ),
    model_sha256=st.one_of(st.just(""), st.binary(min_size=32, max_size=32).map(bytes.hex)),
    secret_epoch=st.integers(0, MAX_EPOCH),
    serves=st.none() | st.builds(
        ServedModel, st.text(printable_chars, min_size=1, max_size=MAX_MODEL_ID_CHARS),
        st.sampled_from(("loading", "ready", "unavailable")), st.floats(allow_nan=False, allow_infinity=False),
        st.integers(0, MAX_IN_FLIGHT), st.integers(0, MAX_CAPACITY_VALUE), st.integers(0, MAX_CAPACITY_VALUE),
        st.integers(0, MAX_CAPACITY_VALUE), st.booleans(),
        st.lists(node_ids, max_size=MAX_SERVED_MEMBERS, unique=True).map(tuple)),
    data_port=st.just(0) | st.integers(1, MAX_PORT),
)
times = st.floats(allow_nan=False, allow_infinity=False)
sha256s = st.binary(min_size=32, max_size=32).map(bytes.hex)
messages = st.one_of(
    st.lists(member_infos, max_size=4, unique_by=lambda m: m.node_id).map(
        lambda ms: MemberList(tuple(ms))
    ),
    st.builds(Leave, node_ids, st.text(printable_chars, max_size=MAX_REASON_CHARS)),
    st.lists(node_ids, max_size=8, unique=True).map(lambda ids: RpcOrder(tuple(ids))),
    st.builds(Ping, st.integers(0, MAX_NONCE), times),
    st.builds(Pong, st.integers(0, MAX_NONCE), times),
    st.builds(Rekey, st.integers(0, MAX_EPOCH), st.binary(min_size=32, max_size=32),
              st.lists(node_ids, max_size=4, unique=True).map(tuple), node_ids),
    st.builds(Observed, addresses),
    st.builds(LayerShare, sha256s, st.just("bartowski/Qwen3-8B-GGUF"),
              st.binary(min_size=20, max_size=20).map(bytes.hex), st.just(("Qwen3-8B-Q4_K_M.gguf",)),
              st.lists(st.builds(SharedTensor, st.just(0), st.integers(0, 2**40), st.integers(0, 2**31),
                                 st.binary(min_size=8, max_size=8).map(bytes.hex), sha256s), max_size=4).map(tuple)),
    st.builds(LayersFetched, sha256s, st.integers(0, 100), st.integers(0, 2**40),
              st.text(printable_chars, max_size=MAX_ERROR_CHARS)),
)


def info(node_id: bytes, name: str = "node", **changes: object) -> MemberInfo:
    base = MemberInfo(
        node_id=node_id,
        name=name,
        addresses=("192.0.2.7:7447", "[2001:db8::1]:7447"),
        version="0.1.0",
        capacity=(("free_ram_bytes", 8 << 30),),
        serving=False,
        rpc_ready=True,
        llama_build=PINNED_BUILD,
    )
    return replace(base, **changes)


A_ID, B_ID = b"\xaa" * 32, b"\xbb" * 32


def body_frame(type_byte: int, body: str, version: int = GOSSIP_WIRE_VERSION) -> bytes:
    """One control frame's payload: version, type, body."""
    return bytes((version, type_byte)) + body.encode("utf-8")


def decode_stream(parts: list[bytes]) -> list[object]:
    """Control frames split into ``parts`` -> their messages, through the frame decoder as a connection does."""
    decoder = FrameDecoder(MAX_CONTROL_MESSAGE_BYTES)
    got = []
    for part in parts:
        decoder.feed(part)
        while (payload := decoder.next_frame()) is not None:
            got.append(decode_message(payload))
    return got


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in pairwise(points)]


# --- codec --------------------------------------------------------------------------------


@given(messages)
def test_every_message_round_trips(msg: object) -> None:
    data = encode_message(msg)
    assert data[0] == GOSSIP_WIRE_VERSION
    assert decode_message(data) == msg


def test_known_frame_bytes() -> None:
    # Pins the layout, so a change to it fails here and not only between two releases.
    data = encode_message(Ping(nonce=7, sent_at=1.5))
    assert data == b"\x0a\x04" + b'{"nonce":7,"sent_at":1.5}'
    assert encode_frame(data)[:6] == b"\x00\x00\x00\x1b\x0a\x04"  # the transport's length, then ours
    assert encode_message(Leave(A_ID, "bye"))[:2] == b"\x0a\x02"
    assert encode_message(Observed("203.0.113.5:47470")) == b"\x0a\x07" + b'{"address":"203.0.113.5:47470"}'


def test_node_ids_travel_as_lowercase_hex() -> None:
    body = json.loads(encode_message(RpcOrder((A_ID, B_ID)))[2:])
    assert body == {"node_ids": ["aa" * 32, "bb" * 32]}


SAMPLE_STREAM = [
    MemberList((info(A_ID, "a"), info(B_ID, "b"))),
    Ping(1, 2.0),
    RpcOrder((A_ID, B_ID)),
    Leave(A_ID, "done"),
]


def control_stream(msgs: list[object]) -> bytes:
    return b"".join(encode_frame(encode_message(m)) for m in msgs)


def test_frames_give_the_same_messages_at_every_split_point() -> None:
    data = control_stream(SAMPLE_STREAM)
    for split in range(len(data) + 1):
        assert decode_stream([data[:split], data[split:]]) == SAMPLE_STREAM, f"split at {split}"


def test_frames_give_the_same_messages_at_every_pair_of_split_points() -> None:
    data = control_stream(SAMPLE_STREAM[1:])
    for first in range(len(data) + 1):
        for second in range(first, len(data) + 1, 7):
            parts = [data[:first], data[first:second], data[second:]]
            assert decode_stream(parts) == SAMPLE_STREAM[1:], f"split at {first}, {second}"


@given(st.lists(messages, min_size=1, max_size=3), st.lists(st.integers(0, 1 << 16), max_size=6))
def test_frames_give_the_same_messages_however_the_stream_is_cut(
    msgs: list[object], cuts: list[int]
) -> None:
    assert decode_stream(chunked(control_stream(msgs), cuts)) == msgs


def test_frames_fed_one_byte_at_a_time() -> None:
    data = control_stream(SAMPLE_STREAM)
    assert decode_stream([bytes([byte]) for byte in data]) == SAMPLE_STREAM


def test_a_cut_frame_waits_for_the_rest() -> None:
    data = control_stream([Leave(A_ID, "bye")])
    decoder = FrameDecoder(MAX_CONTROL_MESSAGE_BYTES)
    decoder.feed(data[:-1])
    assert decoder.next_frame() is None
    decoder.feed(data[-1:])
    assert decode_message(decoder.next_frame()) == Leave(A_ID, "bye")
    assert decoder.next_frame() is None


def test_oversized_length_is_refused_before_its_payload_arrives() -> None:
    decoder = FrameDecoder(MAX_CONTROL_MESSAGE_BYTES)
    decoder.feed(FRAME_HEADER.pack(MAX_CONTROL_MESSAGE_BYTES + 1) + b"\x03\x01{")
    with pytest.raises(FrameTooLargeError):
        decoder.next_frame()
    with pytest.raises(FrameTooLargeError):  # and a payload that long is refused by the codec too
        decode_message(body_frame(4, " " * MAX_CONTROL_MESSAGE_BYTES))


def test_a_frame_of_exactly_the_limit_is_accepted() -> None:
    body = '{"nonce":1,"sent_at":2}'
    padded = body[:-1] + " " * (MAX_CONTROL_MESSAGE_BYTES - 2 - len(body)) + "}"
    data = encode_frame(body_frame(4, padded))
    assert len(data) == FRAME_CAP
    assert decode_stream([data[:-1], data[-1:]]) == [Ping(1, 2.0)]


def test_each_frame_decodes_on_its_own() -> None:
    frames = [encode_message(Ping(1, 1.0)), body_frame(4, "not json"), encode_message(Ping(2, 2.0))]
    assert decode_message(frames[0]) == Ping(1, 1.0)
    with pytest.raises(MalformedMessageError):
        decode_message(frames[1])
    assert decode_message(frames[2]) == Ping(2, 2.0)


def test_other_wire_versions_are_refused() -> None:
    # 3 too: a version-3 node would close on our frames anyway (gossip.py says why).
    for version in (v for v in (0, 1, 2, 3, 4, 5, 6, 7, 8, 255) if v != GOSSIP_WIRE_VERSION):
        with pytest.raises(ProtocolVersionError, match="wire version"):
            decode_message(body_frame(4, '{"nonce":1,"sent_at":2}', version=version))


GOOD_MEMBER = info(A_ID).to_body()


def member_list_with(**changes: object) -> str:
    return json.dumps({"members": [{**GOOD_MEMBER, **changes}]})


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "no header at all"),
        (b"\x01", "no type byte"),
        (body_frame(0, "{}"), "type 0"),
        (body_frame(99, "{}"), "unknown type"),
        (bytes([GOSSIP_WIRE_VERSION]) + b"\x04\xff\xfe", "not UTF-8"),
        (body_frame(4, "{"), "truncated JSON"),
        (body_frame(4, ""), "empty body"),
        (body_frame(4, "[1, 2]"), "not an object"),
        (body_frame(4, "[" * 100_000), "nested too deep"),
        (body_frame(4, '{"nonce":1}'), "missing key"),
        (body_frame(4, '{"nonce":1,"sent_at":2,"x":3}'), "extra key"),
        (body_frame(4, '{"nonce":1,"nonce":2,"sent_at":2}'), "duplicate key"),
        (body_frame(4, '{"nonce":"1","sent_at":2}'), "nonce as text"),
        (body_frame(4, '{"nonce":true,"sent_at":2}'), "nonce as bool"),
        (body_frame(4, '{"nonce":-1,"sent_at":2}'), "negative nonce"),
        (body_frame(4, f'{{"nonce":{MAX_NONCE + 1},"sent_at":2}}'), "nonce over u64"),
        (body_frame(4, '{"nonce":' + "9" * 5000 + ',"sent_at":2}'), "huge integer"),
        (body_frame(4, '{"nonce":1,"sent_at":NaN}'), "NaN"),
        (body_frame(4, '{"nonce":1,"sent_at":1e400}'), "infinite time"),
        (body_frame(5, '{"nonce":1,"sent_at":null}'), "null time"),
        (body_frame(2, json.dumps({"node_id": "AA" * 32, "reason": ""})), "uppercase id"),
        (body_frame(2, json.dumps({"node_id": "aa" * 31, "reason": ""})), "short id"),
        (body_frame(2, json.dumps({"node_id": "aa" * 32, "reason": "a\nb"})), "control char"),
        (body_frame(2, json.dumps({"node_id": "aa" * 32, "reason": "\ud800"})), "lone surrogate"),
        (
            body_frame(
                2, json.dumps({"node_id": "aa" * 32, "reason": "x" * (MAX_REASON_CHARS + 1)})
            ),
            "reason too long",
        ),
        (body_frame(3, json.dumps({"node_ids": ["aa" * 32, "aa" * 32]})), "rpc order twice"),
        (body_frame(3, json.dumps({"node_ids": "aa" * 32})), "rpc order not a list"),
        (body_frame(1, json.dumps({"members": [GOOD_MEMBER, GOOD_MEMBER]})), "member twice"),
        (
            body_frame(1, json.dumps({"members": [GOOD_MEMBER] * (MAX_MEMBERS_PER_LIST + 1)})),
            "too many members",
        ),
        (body_frame(1, member_list_with(name="")), "empty name"),
        (body_frame(1, member_list_with(name="x" * (MAX_NAME_CHARS + 1))), "long name"),
        (body_frame(1, member_list_with(version="0.1 beta")), "space in version"),
        (body_frame(1, member_list_with(version="x" * (MAX_VERSION_CHARS + 1))), "long version"),
        (body_frame(1, member_list_with(addresses=["192.0.2.7"])), "address without port"),
        (body_frame(1, member_list_with(addresses=["192.0.2.7:0"])), "port 0"),
        (body_frame(1, member_list_with(addresses=["192.0.2.7:65536"])), "port over 65535"),
        (body_frame(1, member_list_with(addresses=["h:7447"] * (MAX_ADDRESSES + 1))), "many addrs"),
        (
            body_frame(1, member_list_with(addresses=["a" * MAX_ADDRESS_CHARS + ":1"])),
            "address too long",
        ),
        (body_frame(1, member_list_with(capacity={"RAM": 1})), "capacity key case"),
        (body_frame(1, member_list_with(capacity={"ram": True})), "capacity bool"),
        (body_frame(1, member_list_with(capacity={"ram": 1.5})), "capacity float"),
        (body_frame(1, member_list_with(capacity=[["ram", 1]])), "capacity as list"),
        (
            body_frame(
                1, member_list_with(capacity={f"k{i}": 1 for i in range(MAX_CAPACITY_ENTRIES + 1)})
            ),
            "too many capacity entries",
        ),
        (body_frame(1, member_list_with(serving=1)), "serving as int"),
    ],
)
def test_bad_frames_are_malformed(data: bytes, why: str) -> None:
    with pytest.raises(MalformedMessageError):
        decode_message(data)


def test_the_good_member_used_above_does_decode() -> None:
    # Keeps the table honest: each row fails for its own reason, not a broken base.
    assert decode_message(body_frame(1, member_list_with())) == MemberList((info(A_ID),))


def assert_only_wire_errors(data: bytes, cuts: list[int]) -> None:
    """``data`` as a control stream cut at ``cuts``: frames and messages fail only with WireError."""
    try:
        decode_stream(chunked(data, cuts))
    except WireError:
        pass
    try:
        decode_message(data)  # and the same bytes as one frame's payload
    except WireError:
        pass


@given(st.binary(max_size=4096), st.lists(st.integers(0, 4096), max_size=8))
def test_arbitrary_bytes_raise_only_wire_errors(data: bytes, cuts: list[int]) -> None:
    assert_only_wire_errors(data, cuts)


@given(
    st.integers(0, 7),
    st.integers(0, 7),
    st.binary(max_size=512),
    st.lists(st.integers(0, 600), max_size=8),
)
def test_plausible_frames_with_random_bodies_raise_only_wire_errors(
    version: int, type_byte: int, body: bytes, cuts: list[int]
) -> None:
    assert_only_wire_errors(encode_frame(bytes((version, type_byte)) + body), cuts)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(messages, st.data())
def test_damaged_valid_frames_raise_only_wire_errors(msg: object, data: st.DataObject) -> None:
    raw = bytearray(encode_frame(encode_message(msg)))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    assert_only_wire_errors(bytes(raw), data.draw(st.lists(st.integers(0, len(raw)), max_size=4)))


def test_encoder_refuses_messages_that_break_the_schema() -> None:
    for bad in (
        Leave(b"\x01" * 31, "short id"),
        Ping(-1, 0.0),
        Ping(1, float("nan")),
        MemberList((info(A_ID, name=""),)),
        MemberList((info(A_ID), info(A_ID))),
    ):
        with pytest.raises(ValueError):
            encode_message(bad)


def test_the_largest_member_list_fits_in_one_frame() -> None:
    # Every field at its limit, in the characters that cost the most bytes.
    widest = MemberInfo(
        node_id=b"\x00" * 32,
        name="\U0001f600" * MAX_NAME_CHARS,
        addresses=("a" * (MAX_ADDRESS_CHARS - 6) + ":65535",) * MAX_ADDRESSES,
        version="\\" * MAX_VERSION_CHARS,
        capacity=tuple(
            (f"k{i:0{MAX_CAPACITY_KEY_CHARS - 1}d}", MAX_CAPACITY_VALUE)
            for i in range(MAX_CAPACITY_ENTRIES)
        ),
        serving=False,
        rpc_ready=False,
        llama_build=LlamaBuild(RpcVersion(255, 255, 255), True, '"' * MAX_BUILD_LABEL_CHARS),  # JSON escapes it
        model_sha256="f" * 64,
        secret_epoch=MAX_EPOCH,
        run_id=MAX_RUN_ID,
        # The longer kind of verdict, as many as both lists may hold together.
        slow_workers=(SlowWorker(b"\x00" * 32, MAX_RUN_ID, MAX_JUDGED_MS, MAX_JUDGED_MS, MAX_JUDGED_MS),)
        * MAX_JUDGED_MEMBERS,
        serves=ServedModel("\U0001f600" * MAX_MODEL_ID_CHARS, "unavailable", -sys.float_info.max, MAX_IN_FLIGHT,
                           MAX_CAPACITY_VALUE, MAX_CAPACITY_VALUE, MAX_CAPACITY_VALUE, True,
                           tuple(i.to_bytes(32, "big") for i in range(MAX_SERVED_MEMBERS)), projector_sha256="e" * 64),
        devices=(OfferedDevice("W" * MAX_DEVICE_NAME_CHARS, MAX_CAPACITY_VALUE, MAX_CAPACITY_VALUE,
                               MAX_BYTES_PER_S, MAX_BYTES_PER_S, settled=False),)
        * MAX_DEVICES_PER_MEMBER,
        data_port=MAX_PORT,
    )
    members = tuple(
        replace(widest, node_id=i.to_bytes(32, "big")) for i in range(MAX_MEMBERS_PER_LIST)
    )
    data = encode_message(MemberList(members))
    assert len(data) <= MAX_CONTROL_MESSAGE_BYTES
    assert decode_message(data) == MemberList(members)


def test_capacity_order_does_not_matter_and_keys_are_unique() -> None:
    one = info(A_ID, capacity=(("b", 2), ("a", 1)))
    assert one == info(A_ID, capacity=(("a", 1), ("b", 2)))
    assert dict(one.capacity) == {"a": 1, "b": 2}
    with pytest.raises(ValueError):
        info(A_ID, capacity=(("a", 1), ("a", 2)))


# --- membership ---------------------------------------------------------------------------


class Harness:
    """Several Membership instances wired together in memory, through the real codec.

    Send actions become encoded messages, decoded on delivery; a Dial becomes
    ``peer_connected`` on both sides (unless the pair is already linked: that
    de-duplication is the transport's job); Disconnect drops the link.
    """

    def __init__(self) -> None:
        self.nodes: dict[bytes, Membership] = {}
        self.names: dict[bytes, str] = {}
        self.links: set[frozenset[bytes]] = set()
        self.wire: deque[tuple[bytes, bytes, bytes]] = deque()
        self.events: dict[bytes, list[object]] = defaultdict(list)
        self.dials: dict[bytes, list[Dial]] = defaultdict(list)
        self.disconnects: dict[bytes, list[Disconnect]] = defaultdict(list)
        self.unreachable: set[frozenset[bytes]] = set()  # pairs whose dials fail
        self.now = 0.0

    def add(self, name: str) -> bytes:
        node_id = hashlib.sha256(name.encode()).digest()
        self.nodes[node_id] = Membership(info(node_id, name))
        self.names[node_id] = name
        return node_id

    def connect(self, a: bytes, b: bytes) -> None:
        if frozenset((a, b)) in self.links:
            return
        self.links.add(frozenset((a, b)))
        self.nodes[a].peer_connected(b, self.now)
        self.nodes[b].peer_connected(a, self.now)

    def disconnect(self, a: bytes, b: bytes, reason: str) -> None:
        if frozenset((a, b)) not in self.links:
            return
        self.links.discard(frozenset((a, b)))
        for x, y in ((a, b), (b, a)):
            if x in self.nodes:
                self.nodes[x].peer_disconnected(y, self.now, reason)

    def crash(self, a: bytes) -> None:
        del self.nodes[a]
        for link in [link for link in self.links if a in link]:
            (other,) = link - {a}
            self.disconnect(a, other, "connection timed out")

    def run(self) -> None:
        for _ in range(1000):
            progressed = False
            for node_id, node in list(self.nodes.items()):
                while (action := node.next_action()) is not None:
                    progressed = True
                    match action:
                        case Send(to=to, msg=msg):
                            self.wire.append((node_id, to, encode_message(msg)))
                        case Dial(member=member):
                            self.dials[node_id].append(action)
                            if frozenset((node_id, member.node_id)) in self.unreachable:
                                node.peer_disconnected(member.node_id, self.now, "no answer within 3 s")
                            elif member.node_id in self.nodes:
                                self.connect(node_id, member.node_id)
                        case Disconnect(node_id=other, reason=reason):
                            self.disconnects[node_id].append(action)
                            self.disconnect(node_id, other, reason)
                while (event := node.next_event()) is not None:
                    self.events[node_id].append(event)
            while self.wire:
                progressed = True
                a, b, data = self.wire.popleft()
                if frozenset((a, b)) in self.links and b in self.nodes:
                    self.nodes[b].receive(a, decode_message(data), self.now)
            if not progressed:
                return
        raise AssertionError("gossip never went quiet")

    def heartbeats_until(self, end: float) -> None:
        """Every node's heartbeat once a second up to ``end``, the messages delivered each time."""
        while self.now + 1.0 <= end:
            self.now += 1.0
            for node in self.nodes.values():
                node.heartbeat(self.now)
            self.run()

    def states(self, node_id: bytes) -> dict[bytes, MemberState]:
        return {m.info.node_id: m.state for m in self.nodes[node_id].members()}

    def assert_full_mesh(self) -> None:
        for node_id in self.nodes:
            others = set(self.nodes) - {node_id}
            assert self.states(node_id) == dict.fromkeys(others, MemberState.CONNECTED), (
                f"{self.names[node_id]} sees {self.states(node_id)}"
            )
        assert len(self.links) == len(self.nodes) * (len(self.nodes) - 1) // 2

    def joined(self, at: bytes, who: bytes) -> list[MemberJoined]:
        return [e for e in self.events[at] if isinstance(e, MemberJoined) and e.info.node_id == who]


def chain_of_three() -> tuple[Harness, bytes, bytes, bytes]:
    """A <- B <- C: B is given A's ticket, C is given only B's."""
    mesh = Harness()
    a, b, c = mesh.add("a"), mesh.add("b"), mesh.add("c")
    mesh.connect(b, a)
    mesh.run()
    mesh.now = 1.0
    mesh.connect(c, b)
    mesh.run()
    return mesh, a, b, c


def test_a_chain_of_introductions_becomes_a_full_mesh() -> None:
    mesh, a, b, c = chain_of_three()
    mesh.assert_full_mesh()
    # C heard of A from B, and said so.
    assert [e.learned_via for e in mesh.joined(c, a)] == [b]
    assert [e.learned_via for e in mesh.joined(a, c)] == [b]
    # B met C first-hand: nobody introduced it.
    assert [e.learned_via for e in mesh.joined(b, c)] == [None]
    assert {d.member.node_id for d in mesh.dials[c]} == {a}
    assert all(d.learned_via == b for d in mesh.dials[c])
    (a_row,) = [m for m in mesh.nodes[c].members() if m.info.node_id == a]
    assert a_row.learned_via == b
    assert a_row.info == info(a, "a")
    assert a_row.last_change == 1.0


def test_nobody_dials_itself_or_a_peer_it_is_connected_to() -> None:
    mesh, a, b, c = chain_of_three()
    for node_id, dials in mesh.dials.items():
        assert node_id not in {d.member.node_id for d in dials}
    assert not mesh.dials[b]  # B was connected to both before hearing of either


@settings(max_examples=40, deadline=None)
@given(st.data(), st.integers(2, 7), st.booleans())
def test_any_tree_of_introductions_becomes_a_full_mesh(
    data: st.DataObject, size: int, settle_between: bool
) -> None:
    mesh = Harness()
    ids = [mesh.add(f"n{i}") for i in range(size)]
    for i in range(1, size):
        mesh.connect(ids[i], ids[data.draw(st.integers(0, i - 1))])
        if settle_between:
            mesh.run()
    mesh.run()
    mesh.assert_full_mesh()


def test_a_lost_connection_is_member_lost_and_the_info_is_kept() -> None:
    mesh, a, b, c = chain_of_three()
    mesh.now = 5.0
    mesh.crash(a)
    mesh.run()
    for node_id in (b, c):
        assert [e for e in mesh.events[node_id] if isinstance(e, MemberLost)] == [
            MemberLost(a, "connection timed out")
        ]
        assert not [e for e in mesh.events[node_id] if isinstance(e, MemberLeft)]
        (row,) = [m for m in mesh.nodes[node_id].members() if m.info.node_id == a]
        assert (row.state, row.info, row.last_change) == (MemberState.LOST, info(a, "a"), 5.0)
    assert mesh.states(b)[c] == MemberState.CONNECTED


def test_a_lost_member_is_redialed_when_a_peer_lists_it() -> None:
    mesh, a, b, c = chain_of_three()
    mesh.disconnect(a, c, "path broke")
    mesh.run()
    assert mesh.states(c)[a] == MemberState.LOST
    dials_before = len(mesh.dials[c]) + len(mesh.dials[a])
    # B's view changes, so B re-sends its list, which names A and C as connected to it.
    mesh.nodes[b].update_self(info(b, "b", serving=True))
    mesh.run()
    assert len(mesh.dials[c]) + len(mesh.dials[a]) > dials_before
    mesh.assert_full_mesh()


def test_a_member_a_peer_still_lists_is_dialed_again_on_heartbeats_backing_off() -> None:
    # B and C each hear of the other through A, but their dials fail (a busy machine, a path
    # that is down for a while). A's view does not change, so A never lists them again.
    mesh = Harness()
    a, b, c = mesh.add("a"), mesh.add("b"), mesh.add("c")
    mesh.unreachable.add(frozenset((b, c)))
    mesh.connect(b, a)
    mesh.run()
    mesh.connect(c, a)
    mesh.run()
    assert mesh.states(c)[b] == mesh.states(b)[c] == MemberState.LOST
    dial_times = []
    for _ in range(40):
        dials_before = len(mesh.dials[c])
        mesh.heartbeats_until(mesh.now + 1.0)
        dial_times += [mesh.now] * (len(mesh.dials[c]) - dials_before)
    # Each side redials 2, 4, 8, 16 s after its last failure: at most a dial per failure, fewer and fewer.
    assert dial_times == [2.0, 6.0, 14.0, 30.0]
    assert all(d.learned_via == a for d in mesh.dials[c])
    mesh.unreachable.clear()
    mesh.heartbeats_until(mesh.now + 32.0)
    mesh.assert_full_mesh()


def test_a_member_no_peer_lists_is_not_redialed() -> None:
    mesh, a, b, c = chain_of_three()
    dials_before = {n: len(d) for n, d in mesh.dials.items()}
    mesh.crash(a)
    mesh.run()
    mesh.heartbeats_until(mesh.now + 120.0)
    assert mesh.states(b)[a] == mesh.states(c)[a] == MemberState.LOST
    assert {n: len(d) for n, d in mesh.dials.items()} == dials_before


def test_a_member_remapped_by_its_router_is_dialed_at_its_new_address_once_lost() -> None:
    mesh, a, b, c = chain_of_three()
    c_view = mesh.nodes[c]
    while c_view.next_action() is not None:
        pass
    # A's router remapped it: C's packets no longer reach it and A's own word no longer reaches C,
    # but B lists A at its new address. C keeps its connection's view, and goes there once A is lost.
    moved = info(a, "a", addresses=("203.0.113.9:50961",))
    c_view.receive(b, MemberList((info(b, "b"), moved)), 1.0)
    assert next(m for m in c_view.members() if m.info.node_id == a).info == info(a, "a")
    assert not [x for x in iter(c_view.next_action, None) if isinstance(x, Dial)]
    c_view.peer_disconnected(a, 6.0, "no heartbeat answer for 5.0 s")
    dials = [x for x in iter(c_view.next_action, None) if isinstance(x, Dial)]
    assert [(d.member.addresses, d.learned_via) for d in dials] == [(moved.addresses, b)]


def test_a_graceful_leave_is_member_left_and_never_redialed() -> None:
    mesh, a, b, c = chain_of_three()
    dials_before = {n: list(d) for n, d in mesh.dials.items()}
    mesh.now = 7.0
    mesh.nodes[a].leave("shutting down")
    mesh.run()
    for node_id in (b, c):
        events = mesh.events[node_id]
        assert [e for e in events if isinstance(e, MemberLeft)] == [MemberLeft(a, "shutting down")]
        assert not [e for e in events if isinstance(e, MemberLost)]
        assert mesh.states(node_id)[a] == MemberState.LEFT
        assert [d.node_id for d in mesh.disconnects[node_id]] == [a]
    assert frozenset((a, b)) not in mesh.links and frozenset((a, c)) not in mesh.links
    assert {n: list(d) for n, d in mesh.dials.items()} == dials_before
    # A list that still names A (sent before B saw the Leave) must not bring it back.
    mesh.nodes[c].receive(b, MemberList((info(b, "b"), info(a, "a"))), mesh.now)
    assert mesh.nodes[c].next_action() is None
    assert mesh.states(c)[a] == MemberState.LEFT


def test_two_members_leaving_at_once_close_without_waiting_for_each_other() -> None:
    mesh, a, b, c = chain_of_three()
    mesh.nodes[a].leave("stopping")
    mesh.nodes[b].leave("stopping")
    mesh.run()
    # Each closes its connection to the other, so neither waits out a leave grace.
    assert [d.node_id for d in mesh.disconnects[a]] == [b]
    assert [d.node_id for d in mesh.disconnects[b]] == [a]
    assert frozenset((a, b)) not in mesh.links


def test_a_member_that_left_comes_back_by_connecting_itself() -> None:
    mesh, a, b, c = chain_of_three()
    mesh.nodes[a].leave("restart")
    mesh.run()
    del mesh.nodes[a]
    a = mesh.add("a")  # same key, fresh process
    mesh.connect(a, b)
    mesh.run()
    mesh.assert_full_mesh()


def test_a_node_that_left_ignores_everything() -> None:
    mesh, a, b, c = chain_of_three()
    node = mesh.nodes[a]
    node.leave("bye")
    sent = []
    while (action := node.next_action()) is not None:
        sent.append(action)
    assert sent == [Send(b, Leave(a, "bye")), Send(c, Leave(a, "bye"))]
    node.receive(b, Ping(1, 0.0), 1.0)
    node.peer_disconnected(b, 1.0, "closed")
    node.heartbeat(1.0)
    assert node.next_action() is None and node.next_event() is None


def test_self_updates_reach_every_member() -> None:
    mesh, a, b, c = chain_of_three()
    serving = info(b, "b", serving=True, capacity=(("free_ram_bytes", 1),))
    mesh.nodes[b].update_self(serving)
    mesh.run()
    for node_id in (a, c):
        assert [e for e in mesh.events[node_id] if isinstance(e, MemberUpdated)] == [
            MemberUpdated(serving)
        ]
        (row,) = [m for m in mesh.nodes[node_id].members() if m.info.node_id == b]
        assert row.info == serving


def test_only_a_member_speaks_for_itself() -> None:
    mesh, a, b, c = chain_of_three()
    mesh.nodes[c].receive(b, MemberList((info(b, "b"), info(a, "impostor"))), 9.0)
    assert mesh.nodes[c].next_event() is None
    assert next(m for m in mesh.nodes[c].members() if m.info.node_id == a).info.name == "a"


def test_a_list_without_its_sender_or_a_leave_for_someone_else_is_cut_off() -> None:
    mesh, a, b, c = chain_of_three()
    node = mesh.nodes[c]
    node.receive(b, MemberList((info(a, "a"),)), 1.0)
    node.receive(b, Leave(a, "forged"), 1.0)
    assert [node.next_action(), node.next_action()] == [
        Disconnect(b, f"{short_id(b)} sent a member list without itself"),
        Disconnect(b, f"{short_id(b)} sent a Leave for {short_id(a)}"),
    ]
    assert mesh.states(c)[a] == MemberState.CONNECTED


def test_messages_from_a_node_we_are_not_connected_to_are_ignored() -> None:
    mesh, a, b, c = chain_of_three()
    stranger = b"\x01" * 32
    node = mesh.nodes[a]
    node.receive(stranger, MemberList((info(stranger, "s"), info(b"\x02" * 32, "t"))), 1.0)
    node.receive(stranger, Ping(1, 1.0), 1.0)
    assert node.next_action() is None and node.next_event() is None


def test_connecting_to_itself_is_a_caller_bug() -> None:
    node = Membership(info(A_ID))
    with pytest.raises(ValueError):
        node.peer_connected(A_ID, 0.0)


def rtts(node: Membership) -> dict[bytes, float | None]:
    return {m.info.node_id: node.health(m.info.node_id).rtt_last_s for m in node.members()}


def test_heartbeats_measure_rtt_and_unasked_pongs_are_ignored() -> None:
    mesh, a, b, c = chain_of_three()
    node = mesh.nodes[a]
    node.receive(b, Pong(12345, -100.0), 0.0)  # never asked
    assert rtts(node) == {b: None, c: None}
    mesh.now = 10.0
    node.heartbeat(10.0)
    mesh.run()  # delivered at once: RTT 0
    mesh.now = 11.0
    node.heartbeat(11.0)
    pings = [node.next_action(), node.next_action()]
    assert {p.to for p in pings} == {b, c}
    assert all(isinstance(p.msg, Ping) and p.msg.sent_at == 11.0 for p in pings)
    for p in pings:
        mesh.wire.append((a, p.to, encode_message(p.msg)))
    mesh.now = 11.25
    mesh.run()
    assert rtts(node) == {b: 0.25, c: 0.25}
    assert node.health(b).rtt_samples == (0.0, 0.25)


def heartbeat_events(node: Membership, now: float) -> list[object]:
    node.heartbeat(now)
    while node.next_action() is not None:
        pass
    events = []
    while (event := node.next_event()) is not None:
        events.append(event)
    return events


def test_a_silent_member_is_degraded_then_lost_and_an_answer_recovers_it() -> None:
    mesh, a, b, c = chain_of_three()
    node = mesh.nodes[a]
    assert heartbeat_events(node, 10.0) == []  # Pings to b and c, never delivered
    assert heartbeat_events(node, 11.0) == []
    degraded = heartbeat_events(node, 10.0 + DEGRADED_AFTER_S)
    assert {(type(e), e.node_id) for e in degraded} == {(PeerDegraded, b), (PeerDegraded, c)}
    assert all(e.silent_s == DEGRADED_AFTER_S and e.missed == 2 for e in degraded)
    # c answers the latest Ping (so every earlier one); b stays silent.
    node.receive(c, Pong(6, 12.5), 12.75)
    later = heartbeat_events(node, 10.0 + LOST_AFTER_S - 0.5)  # within LOOP_STALL_S of the last
    assert [type(e) for e in later] == [PeerRecovered] and later[0].node_id == c
    lost = heartbeat_events(node, 10.0 + LOST_AFTER_S)
    assert lost == [PeerLost(b, LOST_AFTER_S, 4)]  # Pings at 10, 11, 12.5, 14.5 and 15: four after the first


def test_a_suspected_member_is_probed_and_lost_only_when_a_sign_comes_again() -> None:
    mesh, a, b, c = chain_of_three()
    node = mesh.nodes[a]
    mesh.now = 10.0
    node.heartbeat(10.0)
    mesh.run()  # both answer: quick links
    deadlines = {peer: node.suspect(peer, Sign.UNREACHABLE, 10.1) for peer in (b, c)}
    assert deadlines == {b: 10.1 + CONFIRM_FLOOR_S, c: 10.1 + CONFIRM_FLOOR_S}
    probes = {action.to: action.msg for action in (node.next_action(), node.next_action())}
    assert all(isinstance(msg, Ping) for msg in probes.values()) and set(probes) == {b, c}
    node.receive(c, Pong(probes[c].nonce, probes[c].sent_at), 10.101)  # c lives: a stray ICMP message
    assert node.suspect(b, Sign.UNREACHABLE, 10.101) is None  # b's dead port answered its probe
    events = []
    while (event := node.next_event()) is not None:
        events.append(event)
    assert [(type(e), e.node_id, e.sign) for e in events] == [
        (PeerLost, b, "its port is unreachable, and again after a probe 1 ms later")]
    node.judge(10.1 + CONFIRM_FLOOR_S)
    assert node.next_event() is None  # c answered its probe: never lost


def test_no_member_is_judged_on_a_heartbeat_after_a_stall_of_our_own() -> None:
    mesh, a, b, c = chain_of_three()
    node = mesh.nodes[a]
    assert heartbeat_events(node, 10.0) == []
    gap_s = LOST_AFTER_S + 1.0
    assert gap_s > LOOP_STALL_S
    assert heartbeat_events(node, 10.0 + gap_s) == [LoopStalled(gap_s)]


def test_rpc_order_reaches_peers_now_and_later() -> None:
    mesh, a, b, c = chain_of_three()
    assert mesh.nodes[a].rpc_order_of(b) == ()
    mesh.nodes[b].announce_rpc_order((a, c))
    mesh.run()
    assert mesh.nodes[a].rpc_order_of(b) == (a, c)
    assert mesh.nodes[c].rpc_order_of(b) == (a, c)
    d = mesh.add("d")
    mesh.connect(d, a)
    mesh.run()
    mesh.assert_full_mesh()
    assert mesh.nodes[d].rpc_order_of(b) == (a, c)


def test_each_member_keeps_its_own_rpc_order_and_no_other_can_remap_it() -> None:
    """Two serving nodes (b and c) share worker a: each one's REGISTER_PEER indices mean its own order. The
    last order a sender sent wins for that sender only; any other member's order leaves it as it was."""
    mesh, a, b, c = chain_of_three()
    mesh.nodes[b].announce_rpc_order((b, a))
    mesh.nodes[c].announce_rpc_order((c, a))
    mesh.run()
    worker = mesh.nodes[a]
    assert dict(worker.rpc_orders) == {b: (b, a), c: (c, a)}
    mesh.nodes[c].announce_rpc_order((a, b))  # a later order of c's: c's alone changes
    mesh.run()
    assert worker.rpc_order_of(b) == (b, a) and worker.rpc_order_of(c) == (a, b)
    mesh.disconnect(a, c, "connection closed")  # a member gone takes its order with it
    assert worker.rpc_order_of(c) == () and dict(worker.rpc_orders) == {b: (b, a)}
    mesh.connect(a, c)  # and its next connection brings it again
    mesh.run()
    assert worker.rpc_order_of(c) == (a, b)
    mesh.nodes[b].leave("stopped")  # so does a member that leaves
    mesh.run()
    assert dict(worker.rpc_orders) == {c: (a, b)}


def test_an_rpc_order_naming_a_worker_tells_it_who_uses_it_and_layer_messages_pass_between_the_two() -> None:
    mesh, a, b, c = chain_of_three()
    mesh.nodes[b].announce_rpc_order((a, b))
    mesh.run()
    assert [e for e in mesh.events[a] if isinstance(e, UsedBy)] == [UsedBy(b)]
    assert not [e for e in mesh.events[c] if isinstance(e, UsedBy)]  # c is not in b's order
    share = LayerShare("5" * 64, "u/r", "c" * 40, ("m.gguf",), ())
    mesh.nodes[b].send_layers(a, share)
    mesh.nodes[a].send_layers(b, LayersFetched("5" * 64, 0, 0, ""))
    mesh.run()
    assert LayersShared(b, share) in mesh.events[a]
    assert LayersReported(a, LayersFetched("5" * 64, 0, 0, "")) in mesh.events[b]


# --- secret rotation ----------------------------------------------------------------------


def rotated_secrets(h: Harness, node_id: bytes) -> list[bytes]:
    return [e.rekey.secret for e in h.events[node_id] if isinstance(e, SecretRotated)]


def test_rekey_never_shows_its_secret():
    rekey = Rekey(3, b"\x5a" * 32, (B_ID,), A_ID)
    assert "5a5a" not in repr(rekey) and "Z" * 4 not in repr(rekey)
    assert decode_message(encode_message(rekey)) == rekey


def test_rotation_reaches_every_member_once_and_shuts_out_the_removed_one():
    h = Harness()
    a, b, c, d = (h.add(n) for n in "abcd")
    for other in (b, c, d):
        h.connect(a, other)
    h.run()
    h.assert_full_mesh()
    new = b"\x01" * 32
    rekey = h.nodes[b].rotate_secret(new, (d,), h.now)
    assert rekey.epoch == 1 and rekey.by == b
    h.run()
    for node_id in (a, b, c):
        assert rotated_secrets(h, node_id) == [new], h.names[node_id]
        assert h.states(node_id)[d] is MemberState.REMOVED
        assert sum(isinstance(e, MemberRemoved) for e in h.events[node_id]) == 1
    assert rotated_secrets(h, d) == []
    assert not any(d in link for link in h.links)
    # Later gossip about the removed member does not bring it back.
    dials_before = {n: len(dials) for n, dials in h.dials.items()}
    h.nodes[a].update_self(info(a, "a2"))
    h.run()
    assert not any(d in link for link in h.links)
    assert {n: len(dials) for n, dials in h.dials.items()} == dials_before


def test_concurrent_rotations_settle_on_one_secret():
    h = Harness()
    a, b, c = (h.add(n) for n in "abc")
    h.connect(a, b)
    h.connect(b, c)
    h.run()
    h.assert_full_mesh()
    low, high = b"\x01" * 32, b"\x02" * 32
    h.nodes[a].rotate_secret(low, (), h.now)
    h.nodes[c].rotate_secret(high, (), h.now)  # same epoch: the higher secret wins everywhere
    h.run()
    for node_id in (a, b, c):
        assert rotated_secrets(h, node_id)[-1] == high
    # A later rotation counts from the highest epoch any member reports.
    assert h.nodes[b].rotate_secret(b"\x03" * 32, (), h.now).epoch == 2


def test_a_rekey_that_removes_the_receiver_is_ignored():
    node = Membership(info(A_ID, "a"))
    node.peer_connected(B_ID, 0.0)
    node.receive(B_ID, MemberList((info(B_ID, "b"),)), 0.0)
    node.receive(B_ID, Rekey(5, b"\x09" * 32, (A_ID,), B_ID), 0.0)
    assert not any(isinstance(e, SecretRotated) for e in iter(node.next_event, None))


def test_devices_round_trip_and_bad_ones_are_refused() -> None:
    gpus = (OfferedDevice("Vulkan0", 2048 * 2**20, 2000 * 2**20, 200 * 10**9, 900 * 10**9, settled=True),
            OfferedDevice("CPU", 24 * 2**30, 20 * 2**30))  # not measured: 0 and 0
    member = info(A_ID, devices=gpus)
    assert decode_message(encode_message(MemberList((member,)))) == MemberList((member,))
    assert gpus[0].to_body() == ["Vulkan0", 2048 * 2**20, 2000 * 2**20, 200 * 10**9, 900 * 10**9, True]
    assert gpus[1].to_body() == ["CPU", 24 * 2**30, 20 * 2**30, 0, 0, False]
    # One calibration is not settled unless said: the default.
    one_sample = info(A_ID, devices=(OfferedDevice("CPU", 1, 1, 2 * 10**9, 9 * 10**9),))
    assert not one_sample.devices[0].settled
    assert decode_message(encode_message(MemberList((one_sample,)))) == MemberList((one_sample,))
    assert "devices" not in info(A_ID).to_body()  # none listed yet: left out
    body = info(A_ID).to_body()
    for bad in (["Vulkan 0", 1, 1, 0, 0, True], ["GPU", -1, 1, 0, 0, True], ["GPU", 1, 1], ["GPU", 1], "GPU",
                ["x" * (MAX_DEVICE_NAME_CHARS + 1), 1, 1, 0, 0, True], ["GPU", 1, 1, -1, 0, True],
                ["GPU", 1, 1, 0, 1.5, True], ["GPU", 1, 1, MAX_BYTES_PER_S + 1, 0, True], ["GPU", 1, 1, 0, True, True],
                ["GPU", 1, 1, 0, 0], ["GPU", 1, 1, 0, 0, 1], ["GPU", 1, 1, 0, 0, True, 0]):
        with pytest.raises(MalformedMessageError):
            MemberInfo.from_body({**body, "devices": [bad]})
    with pytest.raises(MalformedMessageError):
        MemberInfo.from_body({**body, "devices": [["GPU", 1, 1, 0, 0, True]] * (MAX_DEVICES_PER_MEMBER + 1)})
    with pytest.raises(ValueError):  # the encoder checks its own output
        encode_message(MemberList((info(A_ID, devices=(OfferedDevice("GPU", 1, 1, MAX_BYTES_PER_S + 1),)),)))


def test_data_port_round_trips_and_bad_ones_are_refused() -> None:
    for port in (1, 7448, MAX_PORT):
        member = info(A_ID, data_port=port)
        assert decode_message(encode_message(MemberList((member,)))) == MemberList((member,))
    # No native relay: left out, and read back as none.
    assert "data_port" not in info(A_ID).to_body()
    assert decode_message(encode_message(MemberList((info(A_ID),)))) == MemberList((info(A_ID),))
    body = info(A_ID).to_body()
    for bad in (0, -1, MAX_PORT + 1, 70000, "x", "7448", 7448.0, True, None):
        with pytest.raises(MalformedMessageError):
            MemberInfo.from_body({**body, "data_port": bad})
    with pytest.raises(ValueError):  # the encoder checks its own output
        encode_message(MemberList((info(A_ID, data_port=70000),)))
