"""The native data relay's control channel: what the sidecar tells it and what it reports. Pure.

The sidecar and ``mesh-data-relay`` (net/data_plane/native/, README.md there) share a Unix stream socket.
Each message is one line of ASCII words separated by single spaces, ending in ``\\n``; a tunnel
line carries the accepted TCP socket beside it (SCM_RIGHTS)::

    sidecar -> relay                                     relay -> sidecar
    identity CERT_DER_HEX KEY_DER_HEX                    hello VERSION PORT
    limits FRAME HELD CHECKED HANDSHAKE_MS PIPES SHAKES  probe NODE ok RTT_US | probe NODE fail WHY
           SHAKES_PER_ADDRESS
    guard HISTORY MIN_HISTORY NORM_RATIO MAX_RMS MAX_ABS opened ID
    dialect NAME MAJ MIN MAX REQ REPLY FLAGS REG PUSH    closed ID WHY
            LAST NO_REPLY ASYNC_PUSH                     inbound ID NODE
    rpc-port PORT                                        stats ID FROM_CLIENT FROM_SERVER FRAMES
    member NODE [ADDRESS...] | forget NODE                     ACTIVATION ALLOCATED OWED_US
    new-session                                          fallback ID WHY   (+ the tunnel's socket, unread)
    endpoint NODE INDEX HOST:PORT|-                      rejected ID KIND NAME VALUES RMS LOW HIGH COUNT
    tunnel ID NODE HOST PORT CHECK    (+ socket)         event ID WHAT TEXT...
    probe NODE HOST PORT                                 refused COUNT ADDRESS WHY:N[,WHY:N...]
                                                         error TEXT...

Every report line is printable ASCII (the relay replaces any other byte with ``?``, so bytes a peer
sent can never end a line or forge another); ``parse_report`` refuses a line that is not.
NODE is a node id in hex (64 digits); "-" stands for "none" in optional fields. ``member`` with
addresses names where that member's relay dials from (numeric IPv4 or IPv6): the data port answers no
other source, closing it before any TLS; without addresses it names the key and keeps the addresses.
``endpoint`` sets one entry of member NODE's own table (NODE named by ``member`` first; a ``forget`` drops
the table): the peer index of NODE's REGISTER_PEERs, in NODE's announced rpc order, -> where that peer is
reached here. A REGISTER_PEER on a connection from NODE resolves through NODE's table only, so no member
can remap the indices another member's REGISTER_PEERs use. ``event ID dropped COUNT``: COUNT events of
that connection were lost to a full queue (after the ones reported before it). ``refused`` sums the
connections refused since the last one (at most one line a second): how many, the last one's source,
and how many for each reason. ``stats`` and ``refused`` are the only lines the relay
may hold back while the sidecar is far behind reading (their counts carry on to the next line); every
other line is always sent.
The output judge keeps each worker's histories over all its connections, so a worker cannot start
afresh by reconnecting; ``new-session`` (a llama-server starts) clears them. ``rejected`` KINDs:
non_finite; absolute_outlier (over MAX_RMS or MAX_ABS, judged first; LOW is its largest |value|, HIGH
and COUNT 0); norm_outlier (LOW HIGH COUNT: the history it fell outside); protocol (the worker broke
the RPC protocol: NAME is the reason, the figures 0; an ``event ID violation REASON DETAILS...`` line
comes first). ``stats`` are
deltas since the connection's last ``stats`` (every 100 ms while anything moved). Outbound ids
(tunnels) are the sidecar's, below 2**31; inbound ids are the relay's, from 2**31 up.
Everything llama.cpp-specific the relay needs is told here, from the one place Python names it:
the dialect table (rpc_framing.DIALECTS), the commands that answer (rpc_outputs), the guard.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import MalformedMessageError
from ...wire.rpc_framing import DIALECTS, MAX_HELD_BEFORE_REPLY_BYTES, MAX_RPC_FRAME_BYTES, RpcDialect
from ...wire.rpc_outputs import (
    ABSOLUTE_OUTLIER,
    LAST_CMD_MESH_B2B_7,
    LAST_CMD_UPSTREAM_7,
    MAX_CHECKED_REPLY_BYTES,
    MAX_OUTPUT_ABS,
    MAX_OUTPUT_RMS,
    NO_REPLY_CMDS_7,
)

MAX_REPORT_LINE_BYTES = 1024  # the relay writes no longer line
# Connections not yet authenticated from one address: a stranger sharing a member's address (its NAT)
# holds no more, so the other slots stay free for members elsewhere.
MAX_HANDSHAKES_PER_ADDRESS = 4
# What the output check pairs for each dialect it follows (rpc_outputs.py): its last command, and
# which commands send no reply. Dialects not named here are not checked (bytes pass unchecked).
_CHECKED_LAST_CMD = {"upstream-7": LAST_CMD_UPSTREAM_7, "mesh-b2b-7": LAST_CMD_MESH_B2B_7}


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _cmds(commands: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(commands)) or "-"


def dialect_line(dialect: RpcDialect) -> str:
    """One row of the dialect table, as the relay reads it."""
    if dialect.required_caps:
        raise ValueError(f"dialect {dialect.name}: the relay matches HELLO flags, not caps bits")
    last = _CHECKED_LAST_CMD.get(dialect.name)
    no_reply = NO_REPLY_CMDS_7 | dialect.async_push_cmds if last is not None else frozenset()
    return " ".join(("dialect", dialect.name, str(dialect.major), str(dialect.min_minor), _opt(dialect.max_minor),
                     str(dialect.hello_request_bytes), str(dialect.hello_reply_bytes), str(dialect.required_flags),
                     _opt(dialect.register_peer_cmd), _opt(dialect.push_tensor_cmd), _opt(last),
                     _cmds(no_reply), _cmds(dialect.async_push_cmds)))


def configuration_lines(cert_der: bytes, key_der: bytes, *, handshake_timeout_s: float, max_connections: int,
                        max_handshakes: int, history: int, min_history: int, norm_ratio: float,
                        max_handshakes_per_address: int = MAX_HANDSHAKES_PER_ADDRESS) -> list[str]:
    """Everything a relay is told once at its start, before members and tunnels."""
    return [
        f"identity {cert_der.hex()} {key_der.hex()}",
        f"limits {MAX_RPC_FRAME_BYTES} {MAX_HELD_BEFORE_REPLY_BYTES} {MAX_CHECKED_REPLY_BYTES} "
        f"{round(handshake_timeout_s * 1000)} {max_connections} {max_handshakes} {max_handshakes_per_address}",
        f"guard {history} {min_history} {norm_ratio!r} {MAX_OUTPUT_RMS!r} {MAX_OUTPUT_ABS!r}",
        *(dialect_line(d) for d in DIALECTS),
    ]


# --- reports --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """The relay runs and listens on ``port``."""

    version: str
    port: int


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """A probe of a member's relay: TLS with its key, and an answer (``rtt_us``), or why not."""

    node_id: bytes
    ok: bool
    rtt_us: int
    why: str


@dataclass(frozen=True, slots=True)
class Opened:
    """Tunnel connection ``id`` reaches the member's relay: bytes flow."""

    id: int


@dataclass(frozen=True, slots=True)
class Closed:
    """Connection ``id`` (a tunnel, or an inbound one announced) ended; ``why``: ended, reset, rejected..."""

    id: int
    why: str


@dataclass(frozen=True, slots=True)
class HandedBack:
    """Tunnel ``id`` never reached the member's relay (``why``); its socket comes back unread beside this
    line, for the QUIC path to carry."""

    id: int
    why: str


@dataclass(frozen=True, slots=True)
class Inbound:
    """Member ``node_id``'s relay connected ``id`` to our rpc-server."""

    id: int
    node_id: bytes


@dataclass(frozen=True, slots=True)
class Stats:
    """What moved on connection ``id`` since its last Stats."""

    id: int
    from_client_bytes: int  # from llama-server (a tunnel) or from the member (inbound)
    from_server_bytes: int  # from the member's rpc-server (a tunnel) or from ours (inbound)
    frames: int  # RPC commands read (inbound)
    activation_bytes: int  # layer outputs moved (inbound)
    allocated_bytes: int  # ALLOC_BUFFER sizes asked of our rpc-server (inbound)
    owed_us: int  # time the member owed a reply (a tunnel)


@dataclass(frozen=True, slots=True)
class Rejected:
    """A float reply on tunnel ``id`` failed the output check, or the worker broke the protocol: kept back,
    the connection reset."""

    id: int
    kind: str  # rpc_outputs.NON_FINITE, ABSOLUTE_OUTLIER, NORM_OUTLIER or PROTOCOL_VIOLATION
    name: str  # the tensor's; a protocol violation's reason (rpc_outputs.PROTOCOL_REASONS)
    values: int
    rms: float
    low: float  # norm_outlier: the history's range and size
    high: float
    count: int
    max_abs: float | None = None  # absolute_outlier: its largest |value|


@dataclass(frozen=True, slots=True)
class Event:
    """Something the RPC watch saw on connection ``id`` (dialect, check off, endpoint rewritten)."""

    id: int
    what: str
    text: str


@dataclass(frozen=True, slots=True)
class Refused:
    """Connections to our data port refused since the last Refused (a stranger's address, not a member,
    handshake timeout, caps); at most one a second."""

    count: int
    address: str  # the last one's source
    reasons: tuple[tuple[str, int], ...]  # each reason, and how many were refused for it


@dataclass(frozen=True, slots=True)
class RelayError:
    """The relay could not act on a control line."""

    text: str


Report = (Hello | ProbeResult | Opened | Closed | HandedBack | Inbound | Stats | Rejected | Event | Refused
          | RelayError)


def _node(word: str) -> bytes:
    node_id = bytes.fromhex(word)
    if len(node_id) != 32:
        raise ValueError("not a node id")
    return node_id


def parse_report(line: bytes) -> Report:
    """One report line (without its newline); MalformedMessageError if it is none."""
    try:
        text = line.decode("ascii")
        if not text.isprintable():
            raise ValueError("not printable ASCII")
        words = text.split(" ")
        verb, args = words[0], words[1:]
        match verb, len(args):
            case "stats", 7:
                return Stats(*(int(a) for a in args))
            case "hello", 2:
                return Hello(args[0], int(args[1]))
            case "probe", 3 if args[1] == "ok":
                return ProbeResult(_node(args[0]), True, int(args[2]), "")
            case "probe", n if n >= 3 and args[1] == "fail":
                return ProbeResult(_node(args[0]), False, 0, " ".join(args[2:]))
            case "opened", 1:
                return Opened(int(args[0]))
            case "closed", n if n >= 2:
                return Closed(int(args[0]), " ".join(args[1:]))
            case "fallback", n if n >= 2:
                return HandedBack(int(args[0]), " ".join(args[1:]))
            case "inbound", 2:
                return Inbound(int(args[0]), _node(args[1]))
            case "rejected", 8 if args[1] == ABSOLUTE_OUTLIER:
                return Rejected(int(args[0]), args[1], args[2], int(args[3]), float(args[4]), 0.0, 0.0, 0,
                                float(args[5]))
            case "rejected", 8:
                return Rejected(int(args[0]), args[1], args[2], int(args[3]), float(args[4]), float(args[5]),
                                float(args[6]), int(args[7]))
            case "event", n if n >= 2:
                return Event(int(args[0]), args[1], " ".join(args[2:]))
            case "refused", 3:
                reasons = tuple((why, int(n)) for why, n in (item.split(":") for item in args[2].split(",")))
                return Refused(int(args[0]), args[1], reasons)
            case "error", _:
                return RelayError(" ".join(args))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedMessageError(f"data relay report {line[:80]!r}: {exc}") from exc
    raise MalformedMessageError(f"data relay report {line[:80]!r}: not one the sidecar knows")
