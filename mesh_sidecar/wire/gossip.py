"""Gossip: who is in the mesh. A wire codec and a membership state machine, both sans-I/O.

Nothing here touches a socket, a clock or an event loop. The transport feeds
bytes into :class:`GossipDecoder` and messages into :class:`Membership`,
passes the current time in as ``now`` (seconds, any monotonic origin), and
pulls out what to do (:meth:`Membership.next_action`) and what happened
(:meth:`Membership.next_event`).

Frame layout (one gossip stream carries a sequence of these)::

    0                   1                   2                   3
    +-------+-------+-------+-------+-------+-------+---------------- - -
    |        length (u32, big-endian)       |version| type  | body ...
    +-------+-------+-------+-------+-------+-------+---------------- - -
    |<-------- LENGTH_PREFIX_BYTES -------->|<------- length bytes ------>|

    length   counts version + type + body; at most MAX_GOSSIP_FRAME_BYTES
    version  GOSSIP_WIRE_VERSION; anything else is ProtocolVersionError
    type     a key of MESSAGE_TYPES (1 MemberList, 2 Leave, 3 RpcOrder,
             4 Ping, 5 Pong, 6 Rekey)
    body     one UTF-8 JSON object with exactly the keys its type names;
             node ids are lowercase hex of all 32 bytes

Every field has a length limit, chosen so that a MemberList of
MAX_MEMBERS_PER_LIST members at the limits still fits in one frame.

Adding a message: write a frozen dataclass with ``TYPE``, ``to_body`` and
``from_body`` and list it in MESSAGE_TYPES. The encoder runs ``from_body`` on
its own output, so the one schema guards both directions.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from ..errors import FrameTooLargeError, MalformedMessageError, ProtocolVersionError, WireError
from ..identity import NODE_ID_BYTES, short_id

GOSSIP_WIRE_VERSION = 2  # 2: MemberInfo.model_sha256 and secret_epoch; Rekey
LENGTH_PREFIX_BYTES = 4
FRAME_HEADER_BYTES = 2  # version u8 + type u8, counted in the length
MAX_GOSSIP_FRAME_BYTES = 1024 * 1024  # 1 MiB, version + type + body

MAX_NAME_CHARS = 64
MAX_VERSION_CHARS = 32
MAX_ADDRESSES = 8
MAX_ADDRESS_CHARS = 259  # a 253-char DNS name, ":" and a 5-digit port
MAX_CAPACITY_ENTRIES = 8
MAX_CAPACITY_KEY_CHARS = 32
MAX_CAPACITY_VALUE = 2**63 - 1  # fits an i64 for any peer that is not Python
MAX_MEMBERS_PER_LIST = 256  # so the largest mesh gossip can describe
MAX_RPC_ORDER_ENTRIES = 256
MAX_REASON_CHARS = 256
MAX_NONCE = 2**64 - 1
MAX_EPOCH = 2**63 - 1
MESH_SECRET_BYTES = 32
MAX_REMOVED_PER_REKEY = MAX_MEMBERS_PER_LIST

_NODE_ID_RE = re.compile(f"[0-9a-f]{{{2 * NODE_ID_BYTES}}}")
_ADDRESS_RE = re.compile(r"(?:\[[0-9A-Za-z:.%_-]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")
_CAPACITY_KEY_RE = re.compile(f"[a-z][a-z0-9_]{{0,{MAX_CAPACITY_KEY_CHARS - 1}}}")
_VERSION_RE = re.compile(f"[!-~]{{1,{MAX_VERSION_CHARS}}}")  # printable ASCII, no spaces
_SHA256_RE = re.compile("(?:[0-9a-f]{64})?")  # empty: the node holds no model file
_SECRET_RE = re.compile(f"[0-9a-f]{{{2 * MESH_SECRET_BYTES}}}")
_MAX_PORT = 65535


# --- field checks: each raises MalformedMessageError naming the field -------------------


def _bad(what: str, expected: str) -> MalformedMessageError:
    return MalformedMessageError(f"gossip field {what}: expected {expected}")


def _object(value: Any, what: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(what, "a JSON object")
    if set(value) != set(keys):
        raise _bad(what, f"exactly the keys {', '.join(keys)}; got {', '.join(sorted(value))}")
    return value


def _list(value: Any, what: str, max_items: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > max_items:
        raise _bad(what, f"a list of at most {max_items} items")
    return value


def _text(value: Any, what: str, max_chars: int, *, min_chars: int = 0) -> str:
    # isprintable() also rejects lone surrogates, which could not be re-encoded as UTF-8.
    if (
        not isinstance(value, str)
        or not min_chars <= len(value) <= max_chars
        or not value.isprintable()
    ):
        raise _bad(what, f"{min_chars} to {max_chars} printable characters")
    return value


def _matching(value: Any, what: str, pattern: re.Pattern[str], expected: str) -> str:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise _bad(what, expected)
    return value


def _int(value: Any, what: str, maximum: int) -> int:
    # bool is an int in Python but not in our schema.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise _bad(what, f"an integer from 0 to {maximum}")
    return value


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(what, "true or false")
    return value


def _time(value: Any, what: str) -> float:
    try:
        # JSON integers have no size limit: float() of one past ~1e308 is an OverflowError.
        seconds = float(value) if isinstance(value, int | float) else math.nan
    except OverflowError:
        seconds = math.inf
    if isinstance(value, bool) or not math.isfinite(seconds):
        raise _bad(what, "a finite number of seconds")
    return seconds


def _node_id(value: Any, what: str) -> bytes:
    hex_id = _matching(value, what, _NODE_ID_RE, f"{NODE_ID_BYTES} bytes as lowercase hex")
    return bytes.fromhex(hex_id)


def _node_ids(value: Any, what: str, max_items: int) -> tuple[bytes, ...]:
    ids = tuple(_node_id(v, f"{what}[{i}]") for i, v in enumerate(_list(value, what, max_items)))
    if len(set(ids)) != len(ids):
        raise _bad(what, "no node id twice")
    return ids


def _address(value: Any, what: str) -> str:
    match = (
        _ADDRESS_RE.fullmatch(value)
        if isinstance(value, str) and len(value) <= MAX_ADDRESS_CHARS
        else None
    )
    if match is None or not 1 <= int(match.group(1)) <= _MAX_PORT:
        raise _bad(what, f"host:port of at most {MAX_ADDRESS_CHARS} characters")
    return value


# --- messages ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberInfo:
    """What a node says about itself. Travels inside MemberList.

    ``addresses`` are "host:port" strings (IPv6 hosts in brackets).
    ``capacity`` is a tuple of (key, value) pairs rather than a dict so the
    dataclass stays frozen and hashable; it is sorted by key on construction,
    so equal contents compare equal. Use ``dict(info.capacity)`` to read it.
    """

    node_id: bytes
    name: str
    addresses: tuple[str, ...]
    version: str
    capacity: tuple[tuple[str, int], ...]
    serving: bool
    rpc_ready: bool
    # sha256 (hex) of the GGUF this node serves or holds; "" when it holds none.
    model_sha256: str = ""
    # How many times the mesh secret this node holds has been rotated (see Rekey).
    secret_epoch: int = 0

    def __post_init__(self) -> None:
        pairs = tuple(sorted(self.capacity))
        if len({key for key, _ in pairs}) != len(pairs):
            raise ValueError(f"capacity names a key twice: {pairs!r}")
        object.__setattr__(self, "capacity", pairs)

    def to_body(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id.hex(),
            "name": self.name,
            "addresses": list(self.addresses),
            "version": self.version,
            "capacity": dict(self.capacity),
            "serving": self.serving,
            "rpc_ready": self.rpc_ready,
            "model_sha256": self.model_sha256,
            "secret_epoch": self.secret_epoch,
        }

    @classmethod
    def from_body(cls, body: Any, what: str = "member") -> MemberInfo:
        fields = _object(
            body,
            what,
            ("node_id", "name", "addresses", "version", "capacity", "serving", "rpc_ready",
             "model_sha256", "secret_epoch"),
        )
        capacity = fields["capacity"]
        if not isinstance(capacity, dict) or len(capacity) > MAX_CAPACITY_ENTRIES:
            raise _bad(f"{what}.capacity", f"an object of at most {MAX_CAPACITY_ENTRIES} entries")
        return cls(
            node_id=_node_id(fields["node_id"], f"{what}.node_id"),
            name=_text(fields["name"], f"{what}.name", MAX_NAME_CHARS, min_chars=1),
            addresses=tuple(
                _address(a, f"{what}.addresses[{i}]")
                for i, a in enumerate(
                    _list(fields["addresses"], f"{what}.addresses", MAX_ADDRESSES)
                )
            ),
            version=_matching(
                fields["version"],
                f"{what}.version",
                _VERSION_RE,
                f"1 to {MAX_VERSION_CHARS} printable ASCII characters",
            ),
            capacity=tuple(
                (
                    _matching(
                        key,
                        f"{what}.capacity key",
                        _CAPACITY_KEY_RE,
                        f"a lowercase name of at most {MAX_CAPACITY_KEY_CHARS} characters",
                    ),
                    _int(value, f"{what}.capacity.{key}", MAX_CAPACITY_VALUE),
                )
                for key, value in capacity.items()
            ),
            serving=_bool(fields["serving"], f"{what}.serving"),
            rpc_ready=_bool(fields["rpc_ready"], f"{what}.rpc_ready"),
            model_sha256=_matching(fields["model_sha256"], f"{what}.model_sha256", _SHA256_RE,
                                   "64 lowercase hex digits or nothing"),
            secret_epoch=_int(fields["secret_epoch"], f"{what}.secret_epoch", MAX_EPOCH),
        )


@dataclass(frozen=True)
class MemberList:
    """The sender and every member it has its own connection to; sent on connect and on change."""

    TYPE: ClassVar[int] = 1
    members: tuple[MemberInfo, ...]

    def to_body(self) -> dict[str, Any]:
        return {"members": [m.to_body() for m in self.members]}

    @classmethod
    def from_body(cls, body: Any) -> MemberList:
        fields = _object(body, "member_list", ("members",))
        members = tuple(
            MemberInfo.from_body(m, f"members[{i}]")
            for i, m in enumerate(_list(fields["members"], "members", MAX_MEMBERS_PER_LIST))
        )
        if len({m.node_id for m in members}) != len(members):
            raise _bad("members", "no node listed twice")
        return cls(members)


@dataclass(frozen=True)
class Leave:
    """The sender is leaving on purpose: do not redial it."""

    TYPE: ClassVar[int] = 2
    node_id: bytes
    reason: str

    def to_body(self) -> dict[str, Any]:
        return {"node_id": self.node_id.hex(), "reason": self.reason}

    @classmethod
    def from_body(cls, body: Any) -> Leave:
        fields = _object(body, "leave", ("node_id", "reason"))
        return cls(
            node_id=_node_id(fields["node_id"], "leave.node_id"),
            reason=_text(fields["reason"], "leave.reason", MAX_REASON_CHARS),
        )


@dataclass(frozen=True)
class RpcOrder:
    """The serving node's llama-server ``--rpc`` list: entry i is the node behind RPC peer i."""

    TYPE: ClassVar[int] = 3
    node_ids: tuple[bytes, ...]

    def to_body(self) -> dict[str, Any]:
        return {"node_ids": [n.hex() for n in self.node_ids]}

    @classmethod
    def from_body(cls, body: Any) -> RpcOrder:
        fields = _object(body, "rpc_order", ("node_ids",))
        return cls(_node_ids(fields["node_ids"], "node_ids", MAX_RPC_ORDER_ENTRIES))


def _heartbeat_fields(body: Any, what: str) -> tuple[int, float]:
    fields = _object(body, what, ("nonce", "sent_at"))
    return (
        _int(fields["nonce"], f"{what}.nonce", MAX_NONCE),
        _time(fields["sent_at"], f"{what}.sent_at"),
    )


@dataclass(frozen=True)
class Ping:
    """Heartbeat; the receiver answers with a Pong echoing both fields."""

    TYPE: ClassVar[int] = 4
    nonce: int
    sent_at: float  # the pinger's clock, seconds

    def to_body(self) -> dict[str, Any]:
        return {"nonce": self.nonce, "sent_at": self.sent_at}

    @classmethod
    def from_body(cls, body: Any) -> Ping:
        return cls(*_heartbeat_fields(body, "ping"))


@dataclass(frozen=True)
class Pong:
    """Answer to a Ping; the pinger's RTT is its ``now`` minus the echoed ``sent_at``."""

    TYPE: ClassVar[int] = 5
    nonce: int
    sent_at: float  # echoed from the Ping

    def to_body(self) -> dict[str, Any]:
        return {"nonce": self.nonce, "sent_at": self.sent_at}

    @classmethod
    def from_body(cls, body: Any) -> Pong:
        return cls(*_heartbeat_fields(body, "pong"))


@dataclass(frozen=True)
class Rekey:
    """A new mesh secret, flooded over the (encrypted, admitted) connections.

    ``removed`` are members it is withheld from: they are disconnected and not
    redialed. Of two rotations, every node keeps the one with the higher
    (epoch, secret), so concurrent rotations settle on one secret.
    """

    TYPE: ClassVar[int] = 6
    epoch: int
    secret: bytes
    removed: tuple[bytes, ...]
    by: bytes  # the node that rotated

    def __repr__(self) -> str:  # keeps the secret out of logs and tracebacks
        return f"Rekey(epoch={self.epoch}, removed={[short_id(n) for n in self.removed]}, by={short_id(self.by)})"

    @property
    def rank(self) -> tuple[int, bytes]:
        return (self.epoch, self.secret)

    def to_body(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "secret": self.secret.hex(),
                "removed": [n.hex() for n in self.removed], "by": self.by.hex()}

    @classmethod
    def from_body(cls, body: Any) -> Rekey:
        fields = _object(body, "rekey", ("epoch", "secret", "removed", "by"))
        return cls(
            epoch=_int(fields["epoch"], "rekey.epoch", MAX_EPOCH),
            secret=bytes.fromhex(_matching(fields["secret"], "rekey.secret", _SECRET_RE,
                                           f"{MESH_SECRET_BYTES} bytes as lowercase hex")),
            removed=_node_ids(fields["removed"], "rekey.removed", MAX_REMOVED_PER_REKEY),
            by=_node_id(fields["by"], "rekey.by"),
        )


GossipMessage: TypeAlias = MemberList | Leave | RpcOrder | Ping | Pong | Rekey


MESSAGE_TYPES: dict[int, type[GossipMessage]] = {
    cls.TYPE: cls for cls in (MemberList, Leave, RpcOrder, Ping, Pong, Rekey)
}


# --- codec ------------------------------------------------------------------------------


def encode_message(msg: GossipMessage) -> bytes:
    """One complete frame. ValueError if ``msg`` breaks the schema (a bug on our side)."""
    body = msg.to_body()
    try:
        type(msg).from_body(body)
    except MalformedMessageError as exc:
        raise ValueError(f"refusing to send an invalid {type(msg).__name__}: {exc}") from exc
    payload = bytes((GOSSIP_WIRE_VERSION, msg.TYPE)) + json.dumps(
        body, ensure_ascii=False, separators=(",", ":"), allow_nan=False
    ).encode("utf-8")
    return len(payload).to_bytes(LENGTH_PREFIX_BYTES, "big") + payload


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise MalformedMessageError("gossip body names a JSON key twice")
    return result


def _reject_constant(name: str) -> Any:
    raise MalformedMessageError(f"gossip body contains {name}, which JSON does not allow")


def _decode_payload(payload: bytes) -> GossipMessage:
    """Decode version + type + body (the part the length prefix counts)."""
    version, type_byte = payload[0], payload[1]
    if version != GOSSIP_WIRE_VERSION:
        raise ProtocolVersionError(
            f"peer speaks gossip wire version {version}; this build speaks "
            f"{GOSSIP_WIRE_VERSION}. Run the same mesh-inference release on every node."
        )
    cls = MESSAGE_TYPES.get(type_byte)
    if cls is None:
        raise MalformedMessageError(f"unknown gossip message type {type_byte}")
    try:
        body = json.loads(
            payload[FRAME_HEADER_BYTES:].decode("utf-8"),
            object_pairs_hook=_reject_duplicate_keys,
            parse_constant=_reject_constant,
        )
    # ValueError covers bad UTF-8, bad JSON and over-long integers; deep nesting recurses.
    except (ValueError, RecursionError) as exc:
        raise MalformedMessageError(f"gossip body is not valid UTF-8 JSON: {exc}") from exc
    return cls.from_body(body)


class GossipDecoder:
    """Turns a byte stream into messages.

    ``feed`` takes bytes as they arrive and decodes every complete frame at
    once, so only the one unfinished frame is ever buffered: at most
    LENGTH_PREFIX_BYTES + MAX_GOSSIP_FRAME_BYTES. ``next_message`` returns the
    decoded messages in order, then None when it needs more data. A bad frame
    is raised (a WireError) once the messages before it have been taken, and
    again on every later call: the stream cannot be trusted past it. Call
    ``end_of_stream`` when the peer closes, to catch a frame cut short.
    """

    def __init__(self) -> None:
        self._partial = bytearray()  # the unfinished frame, length prefix included
        self._ready: deque[GossipMessage] = deque()
        self._error: WireError | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._partial)

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view and self._error is None:
            if len(self._partial) < LENGTH_PREFIX_BYTES:
                take = LENGTH_PREFIX_BYTES - len(self._partial)
                self._partial += view[:take]
                view = view[take:]
                if len(self._partial) == LENGTH_PREFIX_BYTES:
                    self._check_length(int.from_bytes(self._partial, "big"))
                continue
            length = int.from_bytes(self._partial[:LENGTH_PREFIX_BYTES], "big")
            frame_end = LENGTH_PREFIX_BYTES + length
            take = frame_end - len(self._partial)
            self._partial += view[:take]
            view = view[take:]
            if len(self._partial) == frame_end:
                payload = bytes(self._partial[LENGTH_PREFIX_BYTES:])
                self._partial.clear()
                try:
                    self._ready.append(_decode_payload(payload))
                except WireError as exc:
                    self._error = exc

    def end_of_stream(self) -> None:
        """The peer closed the stream: MalformedMessageError if it did so inside a frame."""
        if self._partial:
            raise MalformedMessageError(
                f"gossip stream ended {len(self._partial)} bytes into an unfinished frame"
            )

    def _check_length(self, length: int) -> None:
        # Checked before any of the frame is buffered: a hostile length costs nothing.
        if length > MAX_GOSSIP_FRAME_BYTES:
            self._error = FrameTooLargeError(
                f"gossip frame of {length} bytes is over the {MAX_GOSSIP_FRAME_BYTES}-byte limit"
            )
        elif length < FRAME_HEADER_BYTES:
            self._error = MalformedMessageError(
                f"gossip frame of {length} bytes has no room for its header"
            )
        if self._error is not None:
            self._partial.clear()

    def next_message(self) -> GossipMessage | None:
        if self._ready:
            return self._ready.popleft()
        if self._error is not None:
            raise self._error
        return None


# --- membership: actions (for the transport) and events (for the rest of the node) ------


@dataclass(frozen=True)
class Send:
    to: bytes
    msg: GossipMessage


@dataclass(frozen=True)
class Dial:
    """Connect to a member we heard of; call ``peer_connected`` once it is up."""

    member: MemberInfo
    learned_via: bytes


@dataclass(frozen=True)
class Disconnect:
    node_id: bytes
    reason: str


Action: TypeAlias = Send | Dial | Disconnect


@dataclass(frozen=True)
class MemberJoined:
    """We now have our own connection to this member, and know its info."""

    info: MemberInfo
    learned_via: bytes | None  # None: it reached us before anyone mentioned it


@dataclass(frozen=True)
class MemberUpdated:
    info: MemberInfo


@dataclass(frozen=True)
class MemberLost:
    """Our connection to a member ended without a Leave; its info is kept for a redial."""

    node_id: bytes
    reason: str


@dataclass(frozen=True)
class MemberLeft:
    node_id: bytes
    reason: str


@dataclass(frozen=True)
class MemberRemoved:
    """A Rekey removed this member: disconnected, never redialed."""

    node_id: bytes
    by: bytes


@dataclass(frozen=True)
class SecretRotated:
    """The mesh secret changed: admit new connections with ``rekey.secret`` from now on."""

    rekey: Rekey


Event: TypeAlias = MemberJoined | MemberUpdated | MemberLost | MemberLeft | MemberRemoved | SecretRotated


class MemberState(enum.StrEnum):
    CONNECTED = "connected"  # we have our own connection to it
    KNOWN = "known"  # heard of through gossip; a Dial is out
    LOST = "lost"  # was connected, or its Dial failed; info kept
    LEFT = "left"  # said Leave; only its own new connection brings it back
    REMOVED = "removed"  # a Rekey left it out: it no longer holds the secret


@dataclass(frozen=True)
class MemberStatus:
    """One row of :meth:`Membership.members`."""

    info: MemberInfo
    state: MemberState
    learned_via: bytes | None
    last_change: float  # ``now`` of the last change of state or info
    rtt_s: float | None  # from the last answered Ping


@dataclass
class _Record:
    info: MemberInfo
    state: MemberState
    learned_via: bytes | None
    last_change: float
    rtt_s: float | None = None


class Membership:
    """One node's view of the mesh, driven by the transport.

    The transport calls ``peer_connected``/``peer_disconnected`` as its
    connections (inbound, or made for a Dial) come and go, once per connection
    it keeps: settling two connections between the same pair is its job. It
    also calls ``peer_disconnected`` when a Dial fails. Messages from a node
    we hold no connection to are ignored (they race with our own close).

    Joins spread because a node re-sends its MemberList to all its peers
    whenever its own connections or the infos it holds change; a receiver dials
    the members it has never heard of. A lost member is dialed again when a
    peer lists it (that peer is connected to it); the transport may also redial
    the ``lost`` members of :meth:`members` on its own schedule.
    """

    def __init__(self, self_info: MemberInfo) -> None:
        self._self = self_info
        self._records: dict[bytes, _Record] = {}
        # Connected, but its MemberList (so its info) has not arrived yet.
        self._unidentified: set[bytes] = set()
        self._actions: deque[Action] = deque()
        self._events: deque[Event] = deque()
        self._rpc_order: tuple[bytes, ...] = ()
        self._announced_rpc_order: RpcOrder | None = None
        self._ping_nonces: dict[bytes, int] = {}  # the one outstanding Ping per peer
        self._next_nonce = 0
        self._left = False
        self._rekey_rank: tuple[int, bytes] = (self_info.secret_epoch, b"")

    # --- outputs ---

    def next_action(self) -> Action | None:
        return self._actions.popleft() if self._actions else None

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    @property
    def self_info(self) -> MemberInfo:
        return self._self

    @property
    def rpc_order(self) -> tuple[bytes, ...]:
        """The last RpcOrder a peer sent (empty until one arrives): index i -> node id."""
        return self._rpc_order

    def members(self) -> tuple[MemberStatus, ...]:
        """Every member we know of except ourselves, in the order we learned of them."""
        return tuple(
            MemberStatus(r.info, r.state, r.learned_via, r.last_change, r.rtt_s)
            for r in self._records.values()
        )

    # --- inputs ---

    def peer_connected(self, node_id: bytes, now: float) -> None:
        if node_id == self._self.node_id:
            raise ValueError("a node cannot connect to itself")
        if self._left or self._is_connected(node_id):
            return
        record = self._records.get(node_id)
        if record is None:
            self._unidentified.add(node_id)
        else:
            self._set_state(record, MemberState.CONNECTED, now)
            self._events.append(MemberJoined(record.info, record.learned_via))
            self._broadcast_view(except_id=node_id)
        self._actions.append(Send(node_id, self._member_list()))
        if self._announced_rpc_order is not None:
            self._actions.append(Send(node_id, self._announced_rpc_order))

    def peer_disconnected(self, node_id: bytes, now: float, reason: str) -> None:
        if self._left:
            return
        self._unidentified.discard(node_id)
        self._ping_nonces.pop(node_id, None)
        record = self._records.get(node_id)
        if record is None:
            return
        if record.state is MemberState.CONNECTED:
            self._set_state(record, MemberState.LOST, now)
            self._events.append(MemberLost(node_id, reason))
            self._broadcast_view(except_id=None)
        elif record.state is MemberState.KNOWN:  # its Dial failed
            self._set_state(record, MemberState.LOST, now)

    def receive(self, from_id: bytes, msg: GossipMessage, now: float) -> None:
        if self._left or not self._is_connected(from_id):
            return
        match msg:
            case MemberList():
                self._on_member_list(from_id, msg, now)
            case Leave():
                self._on_leave(from_id, msg, now)
            case RpcOrder():
                self._rpc_order = msg.node_ids
            case Ping():
                self._actions.append(Send(from_id, Pong(msg.nonce, msg.sent_at)))
            case Pong():
                record = self._records.get(from_id)
                if record is not None and self._ping_nonces.get(from_id) == msg.nonce:
                    del self._ping_nonces[from_id]
                    record.rtt_s = now - msg.sent_at
            case Rekey():
                self._on_rekey(from_id, msg, now)

    def update_self(self, info: MemberInfo) -> None:
        if info.node_id != self._self.node_id:
            raise ValueError("update_self cannot change the node id")
        if self._left or info == self._self:
            return
        self._self = info
        self._broadcast_view(except_id=None)

    def announce_rpc_order(self, node_ids: tuple[bytes, ...]) -> None:
        """As the serving node: tell every peer, now and on each later connect, our --rpc order."""
        if self._left:
            return
        self._announced_rpc_order = RpcOrder(node_ids)
        for peer in self._connected_ids():
            self._actions.append(Send(peer, self._announced_rpc_order))

    def heartbeat(self, now: float) -> None:
        """Ping every identified peer; the Pongs fill in ``rtt_s``."""
        if self._left:
            return
        for node_id, record in self._records.items():
            if record.state is MemberState.CONNECTED:
                self._next_nonce += 1
                self._ping_nonces[node_id] = self._next_nonce
                self._actions.append(Send(node_id, Ping(self._next_nonce, now)))

    def rotate_secret(self, secret: bytes, removed: tuple[bytes, ...], now: float) -> Rekey:
        """Give every member except ``removed`` a new secret; disconnect the removed ones."""
        if self._self.node_id in removed:
            raise ValueError("a node cannot remove itself; use leave")
        epochs = [self._rekey_rank[0]] + [r.info.secret_epoch for r in self._records.values()]
        rekey = Rekey(max(epochs) + 1, secret, removed, self._self.node_id)
        self._on_rekey(None, rekey, now)
        return rekey

    def leave(self, reason: str) -> None:
        """Say Leave to every peer, then ignore all input. Receivers close the connections."""
        if self._left:
            return
        for peer in self._connected_ids():
            self._actions.append(Send(peer, Leave(self._self.node_id, reason)))
        self._left = True

    # --- internals ---

    def _on_member_list(self, from_id: bytes, msg: MemberList, now: float) -> None:
        own = next((m for m in msg.members if m.node_id == from_id), None)
        if own is None:
            self._actions.append(
                Disconnect(from_id, f"{short_id(from_id)} sent a member list without itself")
            )
            return
        changed = self._learn(own, from_id, now)
        for info in msg.members:
            if info.node_id not in (from_id, self._self.node_id):
                changed |= self._learn(info, from_id, now)
        if changed:
            self._broadcast_view(except_id=from_id)

    def _learn(self, info: MemberInfo, via: bytes, now: float) -> bool:
        """Take in ``info`` as told by ``via``; True if our own view (connected infos) changed."""
        node_id = info.node_id
        direct = node_id == via
        if node_id in self._unidentified:
            self._unidentified.discard(node_id)
            learned_via = None if direct else via
            self._records[node_id] = _Record(info, MemberState.CONNECTED, learned_via, now)
            self._events.append(MemberJoined(info, learned_via))
            return True
        record = self._records.get(node_id)
        if record is None:
            self._records[node_id] = _Record(info, MemberState.KNOWN, via, now)
            self._actions.append(Dial(info, via))
        elif direct and record.info != info:
            # Only a member speaks for itself: a third party's copy may be stale.
            record.info = info
            record.last_change = now
            self._events.append(MemberUpdated(info))
            return True
        elif not direct and record.state is MemberState.LOST:
            # `via` holds a live connection to it, so its copy is worth a redial.
            record.info = info
            record.learned_via = via
            self._set_state(record, MemberState.KNOWN, now)
            self._actions.append(Dial(info, via))
        return False

    def _on_leave(self, from_id: bytes, msg: Leave, now: float) -> None:
        if msg.node_id != from_id:
            # Each member says its own Leave; a relayed one could not be told from a forged one.
            self._actions.append(
                Disconnect(from_id, f"{short_id(from_id)} sent a Leave for {short_id(msg.node_id)}")
            )
            return
        self._unidentified.discard(from_id)
        self._ping_nonces.pop(from_id, None)
        record = self._records.get(from_id)
        if record is not None:
            self._set_state(record, MemberState.LEFT, now)
            self._events.append(MemberLeft(from_id, msg.reason))
            self._broadcast_view(except_id=None)
        self._actions.append(Disconnect(from_id, f"{short_id(from_id)} left: {msg.reason}"))

    def _on_rekey(self, from_id: bytes | None, msg: Rekey, now: float) -> None:
        if msg.rank <= self._rekey_rank or self._self.node_id in msg.removed:
            return  # seen it, or lost to a concurrent rotation; never adopt a key meant to exclude us
        self._rekey_rank = msg.rank
        self._events.append(SecretRotated(msg))
        for node_id in msg.removed:
            if self._is_connected(node_id):
                self._actions.append(Disconnect(node_id, f"removed from the mesh by {short_id(msg.by)}"))
            self._unidentified.discard(node_id)
            self._ping_nonces.pop(node_id, None)
            if (record := self._records.get(node_id)) is not None:
                self._set_state(record, MemberState.REMOVED, now)
                self._events.append(MemberRemoved(node_id, msg.by))
        for peer in self._connected_ids():
            if peer != from_id:
                self._actions.append(Send(peer, msg))
        self._broadcast_view(except_id=None)

    def _is_connected(self, node_id: bytes) -> bool:
        record = self._records.get(node_id)
        return node_id in self._unidentified or (
            record is not None and record.state is MemberState.CONNECTED
        )

    def _connected_ids(self) -> list[bytes]:
        return [
            node_id for node_id, r in self._records.items() if r.state is MemberState.CONNECTED
        ] + sorted(self._unidentified)

    def _member_list(self) -> MemberList:
        return MemberList(
            (self._self,)
            + tuple(r.info for r in self._records.values() if r.state is MemberState.CONNECTED)
        )

    def _broadcast_view(self, except_id: bytes | None) -> None:
        view = self._member_list()
        for peer in self._connected_ids():
            if peer != except_id:
                self._actions.append(Send(peer, view))

    @staticmethod
    def _set_state(record: _Record, state: MemberState, now: float) -> None:
        record.state = state
        record.last_change = now
