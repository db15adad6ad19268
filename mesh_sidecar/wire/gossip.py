"""Gossip's wire format: the messages members exchange, and their codec. Pure: no I/O.

Each gossip message is the payload of one control frame (wire/frames.py puts
the length in front and splits the stream; the mesh decodes each frame it
receives with :func:`decode_message`)::

    0       1       2       3       4       5       6
    +-------+-------+-------+-------+-------+-------+---------------- - -
    |   frame length (u32, big-endian)  |version| type  | body ...
    +-------+-------+-------+-------+-------+-------+---------------- - -
    |<-------- wire/frames.py -------->|<- encode_message / decode_message ->|

    length   counts version + type + body; at most MAX_CONTROL_MESSAGE_BYTES
    version  GOSSIP_WIRE_VERSION; anything else is ProtocolVersionError
    type     a key of MESSAGE_TYPES (1 MemberList, 2 Leave, 3 RpcOrder,
             4 Ping, 5 Pong, 6 Rekey, 7 Observed; 8 LayerShare and
             9 LayersFetched are in wire/layer_share.py)
    body     one UTF-8 JSON object with exactly the keys its type names;
             node ids are lowercase hex of all 32 bytes

Every field has a length limit, chosen so that a MemberList of
MAX_MEMBERS_PER_LIST members at the limits still fits in one control frame.

Adding a message: write a frozen dataclass with ``TYPE``, ``to_body`` and
``from_body`` and list it in MESSAGE_TYPES. The encoder runs ``from_body`` on
its own output, so the one schema guards both directions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from ..errors import FrameTooLargeError, MalformedMessageError, ProtocolVersionError
from ..identity import short_id
from .auth import MESH_SECRET_BYTES
from .frames import MAX_CONTROL_MESSAGE_BYTES
from .gossip_fields import (
    address,
    boolean,
    bounded_list,
    field_error,
    integer,
    json_object,
    matching,
    node_id,
    node_ids,
    port,
    rpc_version,
    seconds,
    text,
)
from .layer_share import LayersFetched, LayerShare
from .rpc_hello import RpcVersion

# 10: LayerShare and LayersFetched (wire/layer_share.py): workers fetch their layers of a hub model themselves.
# 9: each of MemberInfo.devices gains whether its speed is settled (llama/calibration.py: two calibrations agree):
# [name, total, free, decode, prefill, settled]; at most 186 members a list (was 187), to make room for it.
# 8: each of MemberInfo.devices gains its measured speeds (decode and prefill bytes per second, 0: not
# measured): [name, total, free, decode, prefill].
# 7: MemberInfo.data_port (the TCP port of the member's native data relay, optional: absent means none).
# 6: MemberInfo.devices (the devices a member's rpc-server offers: name, total and free memory); at most
# 190 members a list (was 200), to make room for them.
# 5: MemberInfo.serves (what a serving node serves: the mesh routes requests and assigns workers by it);
# at most 200 members a list (was 256), to make room for it.
# 4: MemberInfo.llama_build; Observed. Later in 4, optional (absent means none, and they are left out
# when empty): MemberInfo.run_id, corrupt_outputs and slow_workers. Version 3 is not decoded: a
# version-3 node closes the connection on our first version-4 frame, so reading its frames would
# keep no mixed mesh together.
# 3: one message per control frame, without gossip's own length prefix inside it;
# 2: MemberInfo.model_sha256 and secret_epoch; Rekey.
GOSSIP_WIRE_VERSION = 10
MESSAGE_HEADER_BYTES = 2  # version u8 + type u8, before the body

MAX_NAME_CHARS = 64
MAX_VERSION_CHARS = 32
MAX_BUILD_LABEL_CHARS = 64
MAX_ADDRESSES = 8
MAX_ADDRESS_CHARS = 259  # a 253-char DNS name, ":" and a 5-digit port
MAX_CAPACITY_ENTRIES = 8
MAX_CAPACITY_KEY_CHARS = 32
MAX_CAPACITY_VALUE = 2**63 - 1  # fits an i64 for any peer that is not Python
# The largest mesh gossip can describe: 186 members at every field's limit take about
# 1047 KB, within one control frame (MAX_CONTROL_MESSAGE_BYTES, 1 MiB less its header).
MAX_MEMBERS_PER_LIST = 186
# An rpc-server lists its GPUs (or its CPU): a few a machine. Names as ggml gives them: CPU, Vulkan0, CUDA1.
MAX_DEVICES_PER_MEMBER = 4
MAX_DEVICE_NAME_CHARS = 16
# A device's measured speed: 10 PB/s, far above any device's weight rate per prompt token; at most 16 digits, so
# the largest member list still fits one frame.
MAX_BYTES_PER_S = 10**16 - 1
MAX_RPC_ORDER_ENTRIES = 256
MAX_REASON_CHARS = 256
MAX_NONCE = 2**64 - 1
MAX_EPOCH = 2**63 - 1
MAX_REMOVED_PER_REKEY = MAX_MEMBERS_PER_LIST
MAX_RUN_ID = 2**63 - 1
# A serving node lists the last few members it found returning corrupt output or too slow (about 150
# and 180 bytes each), at most this many in both lists together: 256 members at every limit still fit one frame.
MAX_JUDGED_MEMBERS = 4
MAX_FAULT_CHARS = 24
MAX_JUDGED_MS = 10**9  # the times a slow verdict names, in ms (11 days: any real window fits)
MAX_MODEL_ID_CHARS = 64
MAX_SERVED_MEMBERS = 8  # a plan's members as gossip shows them (status); the first ones of a larger plan
MAX_IN_FLIGHT = 10**6
SERVED_STATES = ("loading", "ready", "unavailable")

DEVICE_NAME_RE = re.compile(f"[A-Za-z0-9_.-]{{1,{MAX_DEVICE_NAME_CHARS}}}")
_CAPACITY_KEY_RE = re.compile(f"[a-z][a-z0-9_]{{0,{MAX_CAPACITY_KEY_CHARS - 1}}}")
_VERSION_RE = re.compile(f"[!-~]{{1,{MAX_VERSION_CHARS}}}")  # printable ASCII, no spaces
_BUILD_LABEL_RE = re.compile(f"[ -~]{{1,{MAX_BUILD_LABEL_CHARS}}}")  # printable ASCII
_SHA256_RE = re.compile("(?:[0-9a-f]{64})?")  # empty: the node holds no model file
_FAULT_RE = re.compile(f"[a-z_]{{1,{MAX_FAULT_CHARS}}}")  # a code such as non_finite
_SECRET_RE = re.compile(f"[0-9a-f]{{{2 * MESH_SECRET_BYTES}}}")


# --- messages ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaBuild:
    """The llama.cpp a node runs, as far as RPC goes. Travels inside MemberInfo.

    ``rpc`` is what the node's own rpc-server answered HELLO with; a serving node's
    llama-server speaks the same version (one build directory, one ggml-rpc.h).
    """

    rpc: RpcVersion | None  # None: the rpc-server answered no HELLO this release reads
    b2b: bool  # the HELLO reply carried our b2b patch's flag
    llama_cpp: str  # which llama.cpp, for people: the pin and variant, or a build's own version line

    def __str__(self) -> str:
        return f"RPC {self.rpc or 'unknown'}{' b2b' if self.b2b else ''}, {self.llama_cpp}"

    def to_body(self) -> dict[str, Any]:
        return {"rpc_version": None if self.rpc is None else str(self.rpc), "b2b": self.b2b,
                "llama_cpp": self.llama_cpp}

    @classmethod
    def from_body(cls, body: Any, what: str = "llama_build") -> LlamaBuild:
        fields = json_object(body, what, ("rpc_version", "b2b", "llama_cpp"))
        return cls(
            rpc=rpc_version(fields["rpc_version"], f"{what}.rpc_version"),
            b2b=boolean(fields["b2b"], f"{what}.b2b"),
            llama_cpp=matching(fields["llama_cpp"], f"{what}.llama_cpp", _BUILD_LABEL_RE,
                                f"1 to {MAX_BUILD_LABEL_CHARS} printable ASCII characters"),
        )


@dataclass(frozen=True)
class CorruptOutput:
    """A member a serving node found returning corrupt layer outputs, in that run. Travels inside MemberInfo.

    The serving node leaves it out until it restarts: a new ``run_id`` is a new start.
    """

    node_id: bytes
    run_id: int  # the member's run_id when it was found
    fault: str  # what was found: a code (wire/rpc_outputs.py: non_finite, norm_outlier)

    def to_body(self) -> dict[str, Any]:
        return {"node_id": self.node_id.hex(), "run_id": self.run_id, "fault": self.fault}

    @classmethod
    def from_body(cls, body: Any, what: str) -> CorruptOutput:
        fields = json_object(body, what, ("node_id", "run_id", "fault"))
        return cls(node_id=node_id(fields["node_id"], f"{what}.node_id"),
                   run_id=integer(fields["run_id"], f"{what}.run_id", MAX_RUN_ID),
                   fault=matching(fields["fault"], f"{what}.fault", _FAULT_RE,
                                   f"1 to {MAX_FAULT_CHARS} lowercase letters or _"))


@dataclass(frozen=True)
class SlowWorker:
    """A member a serving node found holding its tokens up, in that run. Travels inside MemberInfo.

    The serving node leaves it out until it restarts or for a while (serve/pace.py judges the tokens,
    the tunnels' reply waits name the worker).
    """

    node_id: bytes
    run_id: int  # the member's run_id when it was found
    owed_ms: int  # how long, of the window, the serving node waited for its rpc-server's replies
    window_ms: int  # the window the tokens were judged over
    token_ms: int  # the time one token was expected to take

    def to_body(self) -> dict[str, Any]:
        return {"node_id": self.node_id.hex(), "run_id": self.run_id, "owed_ms": self.owed_ms,
                "window_ms": self.window_ms, "token_ms": self.token_ms}

    @classmethod
    def from_body(cls, body: Any, what: str) -> SlowWorker:
        fields = json_object(body, what, ("node_id", "run_id", "owed_ms", "window_ms", "token_ms"))
        return cls(node_id=node_id(fields["node_id"], f"{what}.node_id"),
                   run_id=integer(fields["run_id"], f"{what}.run_id", MAX_RUN_ID),
                   **{key: integer(fields[key], f"{what}.{key}", MAX_JUDGED_MS)
                      for key in ("owed_ms", "window_ms", "token_ms")})


@dataclass(frozen=True)
class ServedModel:
    """What a serving node serves and what holding it takes. Travels inside MemberInfo.

    Every node routes API requests by it (``model``, ``state``, ``in_flight``) and computes the
    same assignment of workers to serving nodes from it (``since`` orders the claims; the byte
    figures say how many workers the model needs: serve/assignment.py).
    """

    model: str  # the id clients send (the file's stem)
    state: str  # one of SERVED_STATES
    since: float  # wall time it began serving: earlier serving nodes pick their workers first
    in_flight: int  # API requests it is answering now
    alone_bytes: int  # the whole model on the serving node alone
    margin_bytes: int  # what each more device costs
    layer_bytes: int  # the largest layer
    spread: bool = False  # --spread: it takes every free worker
    members: tuple[bytes, ...] = ()  # its plan's members in --rpc order (the first MAX_SERVED_MEMBERS)
    by_speed: bool = True  # --plan-by speed: it takes workers fastest first (False: --plan-by memory)
    # sha256 of its --mmproj projector: the model takes images. "" (the key left out): text only, so
    # nodes of the same wire version without projectors still read each other.
    projector_sha256: str = ""

    def to_body(self) -> dict[str, Any]:
        return {"model": self.model, "state": self.state, "since": self.since, "in_flight": self.in_flight,
                "alone_bytes": self.alone_bytes, "margin_bytes": self.margin_bytes,
                "layer_bytes": self.layer_bytes, "spread": self.spread,
                "members": [node_id.hex() for node_id in self.members], "by_speed": self.by_speed,
                **({"projector_sha256": self.projector_sha256} if self.projector_sha256 else {})}

    @classmethod
    def from_body(cls, body: Any, what: str) -> ServedModel:
        keys = ("model", "state", "since", "in_flight", "alone_bytes", "margin_bytes", "layer_bytes", "spread",
                "members", "by_speed")
        fields = json_object(body, what, keys, optional=("projector_sha256",))
        state = fields["state"]
        if state not in SERVED_STATES:
            raise field_error(f"{what}.state", f"one of {', '.join(SERVED_STATES)}")
        return cls(
            model=text(fields["model"], f"{what}.model", MAX_MODEL_ID_CHARS, min_chars=1),
            state=state, since=seconds(fields["since"], f"{what}.since"),
            in_flight=integer(fields["in_flight"], f"{what}.in_flight", MAX_IN_FLIGHT),
            **{key: integer(fields[key], f"{what}.{key}", MAX_CAPACITY_VALUE)
               for key in ("alone_bytes", "margin_bytes", "layer_bytes")},
            spread=boolean(fields["spread"], f"{what}.spread"),
            members=node_ids(fields["members"], f"{what}.members", MAX_SERVED_MEMBERS),
            by_speed=boolean(fields["by_speed"], f"{what}.by_speed"),
            projector_sha256=matching(fields.get("projector_sha256", ""), f"{what}.projector_sha256", _SHA256_RE,
                                      "64 lowercase hex digits"))


@dataclass(frozen=True)
class OfferedDevice:
    """One device a member's rpc-server offers, as its startup listing said, and how fast it measured it."""

    name: str  # ggml's: CPU, Vulkan0, CUDA1, ...
    total_bytes: int
    free_bytes: int  # at the rpc-server's start
    # Bytes of quantized weights per second through one token's matrix-vector products (llama/calibration.py);
    # 0: not measured.
    decode_bytes_per_s: int = 0
    # The same per prompt token, in a batch of prompt tokens; 0: not measured.
    prefill_bytes_per_s: int = 0
    # Whether two calibrations agreed on those speeds; False: one sample (or none), which planning weighs no device
    # below.
    settled: bool = False

    def to_body(self) -> list[Any]:
        return [self.name, self.total_bytes, self.free_bytes, self.decode_bytes_per_s, self.prefill_bytes_per_s,
                self.settled]

    @classmethod
    def from_body(cls, body: Any, what: str) -> OfferedDevice:
        items = bounded_list(body, what, 6)
        if len(items) != 6:
            raise field_error(what, "[name, total bytes, free bytes, decode bytes/s, prefill bytes/s, settled]")
        return cls(matching(items[0], f"{what}[0]", DEVICE_NAME_RE,
                            f"1 to {MAX_DEVICE_NAME_CHARS} letters, digits, '_', '.' or '-'"),
                   integer(items[1], f"{what}[1]", MAX_CAPACITY_VALUE),
                   integer(items[2], f"{what}[2]", MAX_CAPACITY_VALUE),
                   integer(items[3], f"{what}[3]", MAX_BYTES_PER_S),
                   integer(items[4], f"{what}[4]", MAX_BYTES_PER_S),
                   boolean(items[5], f"{what}[5]"))


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
    llama_build: LlamaBuild
    # sha256 (hex) of the GGUF this node serves or holds; "" when it holds none.
    model_sha256: str = ""
    # How many times the mesh secret this node holds has been rotated (see Rekey).
    secret_epoch: int = 0
    # Random at every start of the node (0: not announced): another value means the member restarted.
    run_id: int = 0
    # A serving node's: members it leaves out for corrupt output until they restart (newest last).
    corrupt_outputs: tuple[CorruptOutput, ...] = ()
    # A serving node's: members it leaves out as too slow, until they restart or for a while (newest last).
    slow_workers: tuple[SlowWorker, ...] = ()
    # A serving node's: the model it serves (None: it serves none, or has not planned yet).
    serves: ServedModel | None = None
    # The devices its rpc-server offers (none before it has listed them).
    devices: tuple[OfferedDevice, ...] = ()
    # Its native data relay's TCP port, on the hosts of ``addresses`` (0: none; tunnels to it use QUIC).
    data_port: int = 0

    def judged_within_limit(self, what: str) -> MemberInfo:
        if len(self.corrupt_outputs) + len(self.slow_workers) > MAX_JUDGED_MEMBERS:
            raise field_error(f"{what}.corrupt_outputs and slow_workers",
                              f"at most {MAX_JUDGED_MEMBERS} items together")
        return self

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
            "llama_build": self.llama_build.to_body(),
            "model_sha256": self.model_sha256,
            "secret_epoch": self.secret_epoch,
            # Optional within version 4: left out when unset, read as unset when absent.
            **({"run_id": self.run_id} if self.run_id else {}),
            **({"corrupt_outputs": [c.to_body() for c in self.corrupt_outputs]} if self.corrupt_outputs else {}),
            **({"slow_workers": [w.to_body() for w in self.slow_workers]} if self.slow_workers else {}),
            **({"serves": self.serves.to_body()} if self.serves is not None else {}),
            **({"devices": [d.to_body() for d in self.devices]} if self.devices else {}),
            **({"data_port": self.data_port} if self.data_port else {}),
        }

    @classmethod
    def from_body(cls, body: Any, what: str = "member") -> MemberInfo:
        fields = json_object(
            body,
            what,
            ("node_id", "name", "addresses", "version", "capacity", "serving", "rpc_ready",
             "llama_build", "model_sha256", "secret_epoch"),
            ("run_id", "corrupt_outputs", "slow_workers", "serves", "devices", "data_port"),
        )
        capacity = fields["capacity"]
        if not isinstance(capacity, dict) or len(capacity) > MAX_CAPACITY_ENTRIES:
            raise field_error(f"{what}.capacity", f"an object of at most {MAX_CAPACITY_ENTRIES} entries")
        return cls(
            node_id=node_id(fields["node_id"], f"{what}.node_id"),
            name=text(fields["name"], f"{what}.name", MAX_NAME_CHARS, min_chars=1),
            addresses=tuple(
                address(a, f"{what}.addresses[{i}]", MAX_ADDRESS_CHARS)
                for i, a in enumerate(
                    bounded_list(fields["addresses"], f"{what}.addresses", MAX_ADDRESSES)
                )
            ),
            version=matching(
                fields["version"],
                f"{what}.version",
                _VERSION_RE,
                f"1 to {MAX_VERSION_CHARS} printable ASCII characters",
            ),
            capacity=tuple(
                (
                    matching(
                        key,
                        f"{what}.capacity key",
                        _CAPACITY_KEY_RE,
                        f"a lowercase name of at most {MAX_CAPACITY_KEY_CHARS} characters",
                    ),
                    integer(value, f"{what}.capacity.{key}", MAX_CAPACITY_VALUE),
                )
                for key, value in capacity.items()
            ),
            serving=boolean(fields["serving"], f"{what}.serving"),
            rpc_ready=boolean(fields["rpc_ready"], f"{what}.rpc_ready"),
            llama_build=LlamaBuild.from_body(fields["llama_build"], f"{what}.llama_build"),
            model_sha256=matching(fields["model_sha256"], f"{what}.model_sha256", _SHA256_RE,
                                   "64 lowercase hex digits or nothing"),
            secret_epoch=integer(fields["secret_epoch"], f"{what}.secret_epoch", MAX_EPOCH),
            run_id=integer(fields.get("run_id", 0), f"{what}.run_id", MAX_RUN_ID),
            corrupt_outputs=tuple(
                CorruptOutput.from_body(c, f"{what}.corrupt_outputs[{i}]")
                for i, c in enumerate(bounded_list(fields.get("corrupt_outputs", []), f"{what}.corrupt_outputs",
                                            MAX_JUDGED_MEMBERS))),
            slow_workers=tuple(
                SlowWorker.from_body(w, f"{what}.slow_workers[{i}]")
                for i, w in enumerate(bounded_list(fields.get("slow_workers", []), f"{what}.slow_workers",
                                            MAX_JUDGED_MEMBERS))),
            serves=None if fields.get("serves") is None else ServedModel.from_body(fields["serves"], f"{what}.serves"),
            devices=tuple(
                OfferedDevice.from_body(d, f"{what}.devices[{i}]") for i, d in
                enumerate(bounded_list(fields.get("devices", []), f"{what}.devices", MAX_DEVICES_PER_MEMBER))),
            data_port=port(fields["data_port"], f"{what}.data_port") if "data_port" in fields else 0,
        ).judged_within_limit(what)


@dataclass(frozen=True)
class MemberList:
    """The sender and every member it has its own connection to; sent on connect and on change."""

    TYPE: ClassVar[int] = 1
    members: tuple[MemberInfo, ...]

    def to_body(self) -> dict[str, Any]:
        return {"members": [m.to_body() for m in self.members]}

    @classmethod
    def from_body(cls, body: Any) -> MemberList:
        fields = json_object(body, "member_list", ("members",))
        members = tuple(
            MemberInfo.from_body(m, f"members[{i}]")
            for i, m in enumerate(bounded_list(fields["members"], "members", MAX_MEMBERS_PER_LIST))
        )
        if len({m.node_id for m in members}) != len(members):
            raise field_error("members", "no node listed twice")
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
        fields = json_object(body, "leave", ("node_id", "reason"))
        return cls(
            node_id=node_id(fields["node_id"], "leave.node_id"),
            reason=text(fields["reason"], "leave.reason", MAX_REASON_CHARS),
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
        fields = json_object(body, "rpc_order", ("node_ids",))
        return cls(node_ids(fields["node_ids"], "node_ids", MAX_RPC_ORDER_ENTRIES))


def _heartbeat_fields(body: Any, what: str) -> tuple[int, float]:
    fields = json_object(body, what, ("nonce", "sent_at"))
    return (
        integer(fields["nonce"], f"{what}.nonce", MAX_NONCE),
        seconds(fields["sent_at"], f"{what}.sent_at"),
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
        fields = json_object(body, "rekey", ("epoch", "secret", "removed", "by"))
        return cls(
            epoch=integer(fields["epoch"], "rekey.epoch", MAX_EPOCH),
            secret=bytes.fromhex(matching(fields["secret"], "rekey.secret", _SECRET_RE,
                                           f"{MESH_SECRET_BYTES} bytes as lowercase hex")),
            removed=node_ids(fields["removed"], "rekey.removed", MAX_REMOVED_PER_REKEY),
            by=node_id(fields["by"], "rekey.by"),
        )


@dataclass(frozen=True)
class Observed:
    """The address the sender sees this connection's datagrams come from: behind a NAT, the
    receiver's public mapping, which other members can dial (and punch through)."""

    TYPE: ClassVar[int] = 7
    address: str  # host:port

    def to_body(self) -> dict[str, Any]:
        return {"address": self.address}

    @classmethod
    def from_body(cls, body: Any) -> Observed:
        return cls(address(json_object(body, "observed", ("address",))["address"], "observed.address",
                           MAX_ADDRESS_CHARS))


GossipMessage: TypeAlias = MemberList | Leave | RpcOrder | Ping | Pong | Rekey | Observed | LayerShare | LayersFetched


MESSAGE_TYPES: dict[int, type[GossipMessage]] = {
    cls.TYPE: cls for cls in (MemberList, Leave, RpcOrder, Ping, Pong, Rekey, Observed, LayerShare, LayersFetched)
}

# --- codec ------------------------------------------------------------------------------


def encode_message(msg: GossipMessage) -> bytes:
    """One control frame's payload: version, type, body. ValueError if ``msg`` breaks the schema
    (a bug on our side); the field limits keep every valid message within one frame."""
    body = msg.to_body()
    try:
        type(msg).from_body(body)
    except MalformedMessageError as exc:
        raise ValueError(f"refusing to send an invalid {type(msg).__name__}: {exc}") from exc
    payload = bytes((GOSSIP_WIRE_VERSION, msg.TYPE)) + json.dumps(
        body, ensure_ascii=False, separators=(",", ":"), allow_nan=False
    ).encode("utf-8")
    return payload


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise MalformedMessageError("gossip body names a JSON key twice")
    return result


def _reject_constant(name: str) -> Any:
    raise MalformedMessageError(f"gossip body contains {name}, which JSON does not allow")


def decode_message(payload: bytes) -> GossipMessage:
    """One control frame's payload -> its message; a WireError names what is wrong with it."""
    # The frame decoder refuses longer frames before buffering them; a caller holding
    # bytes from elsewhere gets the same limit.
    if len(payload) > MAX_CONTROL_MESSAGE_BYTES:
        raise FrameTooLargeError(
            f"gossip message of {len(payload)} bytes is over the {MAX_CONTROL_MESSAGE_BYTES}-byte limit"
        )
    if len(payload) < MESSAGE_HEADER_BYTES:
        raise MalformedMessageError(f"gossip message of {len(payload)} bytes has no room for its header")
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
            payload[MESSAGE_HEADER_BYTES:].decode("utf-8"),
            object_pairs_hook=_reject_duplicate_keys,
            parse_constant=_reject_constant,
        )
    # ValueError covers bad UTF-8, bad JSON and over-long integers; deep nesting recurses.
    except (ValueError, RecursionError) as exc:
        raise MalformedMessageError(f"gossip body is not valid UTF-8 JSON: {exc}") from exc
    return cls.from_body(body)
