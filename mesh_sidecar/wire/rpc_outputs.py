"""Check the layer outputs a worker's rpc-server returns, before llama-server reads them: the
measurement (:class:`RpcOutputCheck`, :func:`measure`) and the rule that judges it (:class:`OutputGuard`).

Where it sits (serving node, one check per TCP connection through a peer's tunnel)::

    llama-server --requests--> RpcOutputCheck.receive_from_client --> (forwarded by the caller)
                 <--replies--  RpcOutputCheck.data_to_client  <--  receive_from_server <-- peer

Requests are only read: every command's header, and the start of a GET_TENSOR's payload::

    0        1             9                                          305         313        321
    +--------+-------------+------------------------------------------+-----------+----------+
    | cmd u8 | size u64 LE | rpc_tensor[296]: id u64 | type u32 | ... | offset u64| size u64 |
    +--------+-------------+------------------------------------------+-----------+----------+

Replies are ``size u64 LE | payload[size]``, one per command that has one, in the order of the
commands (rpc-server serves one command at a time per connection), so a queue of what each
pending command expects pairs every reply with its request. A GET_TENSOR reply of an F32 or
F16 tensor (at most MAX_CHECKED_REPLY_BYTES) is held until it is whole, measured
(:class:`TensorMeasured`: all values finite, root mean square, largest absolute value) and
handed to the ``judge`` (the serving node's :class:`OutputGuard`): passed on when the judge finds
nothing, kept back for good when it names a fault (:class:`OutputRejected`; the caller closes the
connection, so no corrupt value reaches llama-server). Every other reply passes as it arrives.

Commands with no reply are upstream 7.x's (read from the pinned ``ggml-rpc.cpp``) and, in our
b2b build, its asynchronous pushes (rpc_framing.py).

Who may stop the check: the client (llama-server, our own) may lead it where it cannot follow
(a HELLO request or dialect it does not check, an unknown command, a command before the HELLO
reply) and switches it off for the connection (:class:`CheckOff`; bytes then pass untouched, as
in rpc_framing.py). The server (a member's rpc-server) may not: a reply nothing asked for, a
first reply too big for a HELLO reply, a HELLO reply that fits no dialect of the request, or a
checked reply of another size than asked is a PROTOCOL_VIOLATION fault, kept back and blamed
like a corrupt tensor, since a worker able to switch the check off could then send anything.

Sans-I/O: bytes in, bytes and events out; no sockets, no clock. Payload bytes pass as
memoryview slices of the caller's ``bytes``; only a header, a GET_TENSOR's first 312 bytes,
the HELLO reply and a checked reply are ever held.
"""

from __future__ import annotations

import enum
import math
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .rpc_framing import (
    DIALECTS,
    GET_TENSOR_CMD,
    GET_TENSOR_SIZE_OFFSET,
    HELLO_CMD,
    MESH_B2B_7,
    REPLY_SIZE,
    REPLY_SIZE_BYTES,
    RPC_HEADER,
    RPC_HEADER_BYTES,
    RPC_TENSOR_NAME_BYTES,
    RPC_TENSOR_NAME_OFFSET,
    UPSTREAM_7,
)

RPC_TENSOR_TYPE_OFFSET = 8  # rpc_tensor: id u64 | type u32 | ...
GET_TENSOR_HEAD_BYTES = GET_TENSOR_SIZE_OFFSET + 8  # rpc_tensor | offset u64 | size u64
# ggml_type values of the float types activations travel as.
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
_FLOAT_DTYPES: dict[int, np.dtype[np.floating[Any]]] = {GGML_TYPE_F32: np.dtype("<f4"), GGML_TYPE_F16: np.dtype("<f2")}
# Activations are n_embd floats per token (a prompt batch: a few MiB); bigger replies are not
# layer outputs and pass unchecked rather than be held.
MAX_CHECKED_REPLY_BYTES = 64 * 1024 * 1024
MAX_HELLO_REPLY_BYTES = 64  # 28 in 7.x; a bigger first reply is no HELLO reply and is not collected
# Upstream 7.x commands that send no reply: FREE_BUFFER, BUFFER_CLEAR, SET_TENSOR, GRAPH_COMPUTE,
# INIT_TENSOR, GRAPH_RECOMPUTE, MEMSET_TENSOR. Every other command up to the last answers.
NO_REPLY_CMDS_7 = frozenset({4, 5, 6, 10, 12, 16, 17})
LAST_CMD_UPSTREAM_7 = 17
LAST_CMD_MESH_B2B_7 = 22  # REGISTER_PEER 18 and PUSH_TENSOR_TO_PEER 19 answer a u8; 20-22 do not

_GET_TENSOR_HEAD = struct.Struct(f"<{RPC_TENSOR_TYPE_OFFSET}xI")


@dataclass(frozen=True, slots=True)
class TensorMeasured:
    """A float tensor a GET_TENSOR reply carried, measured whole."""

    name: str
    """llama.cpp's tensor name (``l_out-11`` for layer 11's output)."""
    values: int
    """How many values the reply carried."""
    finite: bool
    """No NaN and no Inf among them."""
    rms: float | None
    """Root mean square of the values (None when not finite): a norm independent of the batch size.
    Not NaN: a NaN field would make equal verdicts compare unequal."""
    max_abs: float | None = None
    """The largest absolute value (None when not finite, or not measured: a relay's report)."""


NON_FINITE = "non_finite"  # a NaN or an Inf among the values
NORM_OUTLIER = "norm_outlier"  # a norm far outside the worker's own recent range for that tensor
ABSOLUTE_OUTLIER = "absolute_outlier"  # values beyond what any real model produces
PROTOCOL_VIOLATION = "protocol"  # the worker's rpc-server broke the RPC protocol (no tensor to blame)
# A PROTOCOL_VIOLATION's reason, one word (the native relay reports the same words).
UNSOLICITED_REPLY = "unsolicited-reply"  # a reply to a command the client has not sent
WRONG_REPLY_SIZE = "wrong-reply-size"  # a checked reply of another size than the GET_TENSOR asked for
UNKNOWN_DIALECT = "unknown-dialect"  # a HELLO reply that fits no dialect of the client's HELLO request
BAD_HELLO_REPLY = "bad-hello-reply"  # a first reply too big to be a HELLO reply
PROTOCOL_REASONS = frozenset({UNSOLICITED_REPLY, WRONG_REPLY_SIZE, UNKNOWN_DIALECT, BAD_HELLO_REPLY})


@dataclass(frozen=True, slots=True)
class Fault:
    """What a judge found wrong with a tensor."""

    kind: str
    """NON_FINITE, NORM_OUTLIER, ABSOLUTE_OUTLIER or PROTOCOL_VIOLATION: what gossip, status and scripts carry."""
    detail: str
    """The figures, for the log."""


@dataclass(frozen=True, slots=True)
class OutputRejected:
    """The judge named a fault in a reply: it was kept back, and nothing more passes."""

    tensor: TensorMeasured | None
    """The tensor it was found in; None for a PROTOCOL_VIOLATION (no tensor was read)."""
    fault: Fault
    """What the judge found."""


@dataclass(frozen=True, slots=True)
class CheckOff:
    """The stream is not one this check can follow; from now on every byte passes unchecked."""

    reason: str
    """Why, for the log."""


# --- the output rule: whether a measured tensor is corrupt -----------------------------------
#
# Theory of operation: a healthy model's layer output has a root mean square that stays within a
# narrow band per layer, token after token (it is the residual stream's scale). Faulty memory or a
# faulty GPU returns NaN/Inf, zeros, or bit-flipped values whose scale is off by orders of
# magnitude. So each (worker, tensor name) keeps the RMS of its last HISTORY_SAMPLES healthy
# outputs, and once it has MIN_HISTORY_SAMPLES, an RMS more than NORM_RATIO above the largest or
# below the smallest of them is a fault. The bound is wide on purpose: a false alarm takes a healthy
# machine out of the mesh, while real garbage is off by far more. The relative rule needs a history,
# so beside it absolute bounds (MAX_OUTPUT_RMS, MAX_OUTPUT_ABS) judge from the very first reply: a
# worker returning every value scaled by 1e30 from the start would otherwise build its own history.
# A member who returns plausible finite values is not caught (docs/security.md). The native relay
# judges by the same rule with these figures (net/data_plane/native/judge.c, told them in its
# ``guard`` line); docs/architecture.md, "The output check", names every place the check acts.

# The rule's figures (OutputGuard judges with them; the native relay is told them).
HISTORY_SAMPLES = 64  # healthy RMS values kept per worker and tensor name
MIN_HISTORY_SAMPLES = 8  # norms are judged only with at least this many
NORM_RATIO = 64.0  # an RMS this far outside the recent range (either way) is a fault
# Absolute bounds, judged from the first reply on (the relative rule needs a history, and a worker
# scaling every value by 1e30 from its first reply builds one): real residual streams reach |values| of
# about 1e4 in the largest models ("massive activations") and RMS values of about 1e3 (a first token's
# warm-up); a model run in F16 cannot exceed 65504 at all. Both limits sit orders of magnitude above,
# so no healthy machine trips them: the RMS one catches dense garbage, the max-abs one a sparse spike.
MAX_OUTPUT_RMS = 1e6
MAX_OUTPUT_ABS = 1e8


def non_finite_fault(tensor: TensorMeasured) -> Fault:
    return Fault(NON_FINITE, f"NaN or Inf among the {tensor.values} values of {tensor.name}")


def norm_outlier_fault(tensor: TensorMeasured, low: float, high: float, samples: int) -> Fault:
    return Fault(NORM_OUTLIER, f"{tensor.name} has RMS {tensor.rms:.3g}, over {NORM_RATIO:g}x outside "
                               f"its last {samples} ({low:.3g} to {high:.3g})")


def absolute_outlier_fault(tensor: TensorMeasured) -> Fault:
    largest = "unmeasured" if tensor.max_abs is None else f"{tensor.max_abs:.3g}"
    return Fault(ABSOLUTE_OUTLIER, f"{tensor.name} has RMS {tensor.rms:.3g} and largest |value| {largest}, "
                                   f"beyond any real model's (limits {MAX_OUTPUT_RMS:g} and {MAX_OUTPUT_ABS:g})")


def protocol_fault(reason: str, detail: str = "") -> Fault:
    """``reason``: one of PROTOCOL_REASONS; ``detail``: its figures, when known."""
    return Fault(PROTOCOL_VIOLATION, f"its rpc-server broke the RPC protocol: {reason}"
                                     + (f" ({detail})" if detail else ""))


class OutputGuard:
    """The serving node's judge of its workers' layer outputs (the rule above); mesh/serving.py holds one.

    Whose history: one per worker and tensor name, kept across that worker's connections, so a worker
    cannot start afresh by dropping its tunnel connection. Only :meth:`new_session` clears it, called
    when llama-server (our own process) starts again; nothing a worker does can.
    """

    def __init__(self) -> None:
        self._history: dict[tuple[bytes, str], deque[float]] = {}

    def judge(self, worker: bytes, tensor: TensorMeasured) -> Fault | None:
        """A fault in ``tensor`` returned by ``worker``, or None (then it joins the worker's history)."""
        if not tensor.finite:
            return non_finite_fault(tensor)
        rms = tensor.rms
        assert rms is not None  # finite values have one
        if rms > MAX_OUTPUT_RMS or (tensor.max_abs is not None and tensor.max_abs > MAX_OUTPUT_ABS):
            return absolute_outlier_fault(tensor)
        history = self._history.setdefault((worker, tensor.name), deque(maxlen=HISTORY_SAMPLES))
        if len(history) >= MIN_HISTORY_SAMPLES:
            low, high = min(history), max(history)
            if rms > high * NORM_RATIO or rms < low / NORM_RATIO:
                return norm_outlier_fault(tensor, low, high, len(history))
        history.append(rms)
        return None

    def new_session(self) -> None:
        """llama-server starts again: its warm-up's outputs are far from a running session's (a first
        token's), so the histories begin anew. The one thing that clears them (the class docstring)."""
        self._history.clear()


def rejected_natively(kind: str, name: str, values: int, rms: float, max_abs: float | None,
                      history: tuple[float, float, int]) -> OutputRejected:
    """A fault the native relay's judge found by this rule (judge.c), reported as figures: the rejection in
    this rule's own words, as if OutputGuard had found it. ``name`` is the tensor's, or for a
    PROTOCOL_VIOLATION its reason; ``history``: a NORM_OUTLIER's range and sample count (low, high, samples)."""
    if kind == PROTOCOL_VIOLATION:  # no tensor was read
        return OutputRejected(None, protocol_fault(name))
    if kind == NON_FINITE:
        tensor = TensorMeasured(name, values, False, None)
        return OutputRejected(tensor, non_finite_fault(tensor))
    if kind == ABSOLUTE_OUTLIER:
        tensor = TensorMeasured(name, values, True, rms, max_abs)
        return OutputRejected(tensor, absolute_outlier_fault(tensor))
    tensor = TensorMeasured(name, values, True, rms)
    return OutputRejected(tensor, norm_outlier_fault(tensor, *history))


OutputEvent = OutputRejected | CheckOff
Judge = Callable[[TensorMeasured], Fault | None]  # what is wrong with the tensor, or None


def measure(name: str, data: bytes, ggml_type: int) -> TensorMeasured:
    """All values finite, their RMS and their largest absolute value, of a reply's raw bytes of a float tensor."""
    values = np.frombuffer(data, dtype=_FLOAT_DTYPES[ggml_type])
    if not values.size:
        return TensorMeasured(name, 0, True, 0.0, 0.0)
    # One pass in float64: the sum of squares is NaN or Inf exactly when a value is (no float32
    # value squares past float64's range), so finiteness costs no second pass. einsum's own loop, not
    # np.dot: BLAS would start a thread per core for every reply (18 s of CPU in 9 s on 16 cores).
    square_sum = float(np.einsum("i,i->", values, values, dtype=np.float64))
    if not math.isfinite(square_sum):
        return TensorMeasured(name, values.size, False, None)
    # max and min are plain reductions: no temporary (np.abs would copy the reply), no thread.
    max_abs = max(float(values.max()), -float(values.min()))
    return TensorMeasured(name, values.size, True, math.sqrt(square_sum / values.size), max_abs)


@dataclass(frozen=True, slots=True)
class _Expected:
    """What the reply to one pending command is: checked (a float tensor), the HELLO reply, or neither."""

    name: str = ""
    ggml_type: int | None = None  # None: pass the reply unchecked
    size: int = 0  # the bytes the GET_TENSOR asked for
    hello: bool = False  # read it for the dialect (and pass it on)


_UNCHECKED = _Expected()
_HELLO = _Expected(hello=True)
# The dialects whose replies this check can pair with their commands, and their last command.
_LAST_CMD = {UPSTREAM_7.name: LAST_CMD_UPSTREAM_7, MESH_B2B_7.name: LAST_CMD_MESH_B2B_7}
_NO_REPLY_CMDS = {UPSTREAM_7.name: NO_REPLY_CMDS_7, MESH_B2B_7.name: NO_REPLY_CMDS_7 | MESH_B2B_7.async_push_cmds}


class _Phase(enum.Enum):
    HELLO = enum.auto()  # until the HELLO reply names the dialect
    CHECKING = enum.auto()
    OFF = enum.auto()  # pass everything
    REJECTED = enum.auto()  # a fault was found: hold everything


class RpcOutputCheck:
    """Sans-I/O check of the replies on one RPC connection, judged by ``judge``.

    Show every client byte to :meth:`receive_from_client` before forwarding it; feed every
    server byte to :meth:`receive_from_server` and forward what :meth:`data_to_client` returns
    instead; drain :meth:`next_event`. Input must be ``bytes``.
    """

    def __init__(self, judge: Judge, max_checked_bytes: int = MAX_CHECKED_REPLY_BYTES) -> None:
        self._judge = judge
        self._max_checked_bytes = max_checked_bytes
        self._phase = _Phase.HELLO
        self._hello_request_bytes: int | None = None
        self._hello_reply = bytearray()
        self._last_cmd = 0
        self._no_reply_cmds = NO_REPLY_CMDS_7
        self.checked = 0
        """Tensors measured and judged so far."""
        # Client side: the header being read, payload bytes to skip, a GET_TENSOR's head.
        self._header = bytearray()
        self._skip = 0
        self._head: bytearray | None = None
        self._pending: deque[_Expected] = deque()
        # Server side: the reply size being read, payload bytes left, and a held reply.
        self._reply_header = bytearray()
        self._reply_left = 0
        self._reply_expected = _UNCHECKED
        self._held: list[bytes | memoryview] = []
        self._out: list[bytes | memoryview] = []
        self._events: deque[OutputEvent] = deque()

    # --- client -> server: read only ---------------------------------------------------

    @property
    def replies_owed(self) -> bool:
        """Whether the server owes a reply to what the client sent so far (always, unless checking:
        then only while a command that answers is unanswered; b2b's asynchronous pushes never are)."""
        return self._phase is not _Phase.CHECKING or bool(self._pending) or self._head is not None

    def receive_from_client(self, data: bytes) -> None:
        """Read a command's bytes on their way to the server."""
        view, pos, end = memoryview(data), 0, len(data)
        while pos < end and self._phase in (_Phase.HELLO, _Phase.CHECKING):
            if self._skip:
                take = min(self._skip, end - pos)
                if self._head is not None:
                    self._head += view[pos : pos + min(take, GET_TENSOR_HEAD_BYTES - len(self._head))]
                    if len(self._head) == GET_TENSOR_HEAD_BYTES:
                        self._pending.append(self._get_tensor(bytes(self._head)))
                        self._head = None
                self._skip -= take
                pos += take
            else:
                chunk = view[pos : pos + RPC_HEADER_BYTES - len(self._header)]
                self._header += chunk
                pos += len(chunk)
                if len(self._header) == RPC_HEADER_BYTES:
                    cmd, size = RPC_HEADER.unpack(self._header)
                    self._header.clear()
                    self._on_command(cmd, size)

    def _on_command(self, cmd: int, size: int) -> None:
        self._skip = size
        if self._phase is _Phase.HELLO:
            # A conforming client sends nothing after HELLO until its reply, which ends this phase.
            if cmd != HELLO_CMD or self._hello_request_bytes is not None:
                self._off(f"command {cmd} before the HELLO reply")
                return
            if not any(d.hello_request_bytes == size for d in DIALECTS):
                self._off(f"the HELLO request has {size} bytes, no known dialect's size")
                return
            self._hello_request_bytes = size
            self._pending.append(_HELLO)
        elif cmd > self._last_cmd:
            self._off(f"unknown command {cmd}")
        elif cmd == GET_TENSOR_CMD:
            if size < GET_TENSOR_HEAD_BYTES:
                self._off(f"a GET_TENSOR of {size} bytes")  # rpc-server closes the connection on it
            else:
                self._head = bytearray()  # queued once its head is read: the reply cannot come before
        elif cmd not in self._no_reply_cmds:
            self._pending.append(_UNCHECKED)

    def _get_tensor(self, head: bytes) -> _Expected:
        (ggml_type,) = _GET_TENSOR_HEAD.unpack_from(head)
        (size,) = REPLY_SIZE.unpack_from(head, GET_TENSOR_SIZE_OFFSET)
        dtype = _FLOAT_DTYPES.get(ggml_type)
        if dtype is None or size > self._max_checked_bytes or size % dtype.itemsize:
            return _UNCHECKED
        name = head[RPC_TENSOR_NAME_OFFSET : RPC_TENSOR_NAME_OFFSET + RPC_TENSOR_NAME_BYTES]
        return _Expected(name.split(b"\0", 1)[0].decode("utf-8", "replace"), ggml_type, size)

    # --- server -> client: held while a checked reply arrives -------------------------

    def receive_from_server(self, data: bytes) -> None:
        """Take the server's bytes; what may go on to the client comes out of :meth:`data_to_client`."""
        view, pos, end = memoryview(data), 0, len(data)
        while pos < end:
            if self._phase is _Phase.OFF:
                self._out.append(view[pos:])
                return
            if self._phase is _Phase.REJECTED:
                return
            if self._reply_left:
                take = min(self._reply_left, end - pos)
                chunk = view[pos : pos + take]
                if self._reply_expected.ggml_type is not None:
                    self._held.append(chunk)
                else:
                    self._out.append(chunk)
                    if self._reply_expected.hello:
                        self._hello_reply += chunk
                self._reply_left -= take
                pos += take
                if not self._reply_left:
                    self._reply_done()
                continue
            chunk = view[pos : pos + REPLY_SIZE_BYTES - len(self._reply_header)]
            self._reply_header += chunk
            pos += len(chunk)
            if len(self._reply_header) == REPLY_SIZE_BYTES:
                header = bytes(self._reply_header)
                self._reply_header.clear()
                self._on_reply(header)

    def _on_reply(self, header: bytes) -> None:
        (size,) = REPLY_SIZE.unpack(header)
        if not self._pending:
            self._violation(UNSOLICITED_REPLY, f"a reply of {size} bytes to no command")
            return
        expected = self._pending.popleft()
        if expected.hello and size > MAX_HELLO_REPLY_BYTES:
            self._violation(BAD_HELLO_REPLY, f"a first reply of {size} bytes is no HELLO reply")
            return
        if expected.ggml_type is not None and size != expected.size:
            self._violation(WRONG_REPLY_SIZE, f"a reply of {size} bytes to a GET_TENSOR of {expected.size}")
            return
        (self._held if expected.ggml_type is not None else self._out).append(header)
        self._reply_expected, self._reply_left = expected, size
        if not size:
            self._reply_done()

    def _reply_done(self) -> None:
        expected, self._reply_expected = self._reply_expected, _UNCHECKED
        if expected.hello:
            self._on_hello_reply(bytes(self._hello_reply))
        if expected.ggml_type is None:
            return
        held, self._held = self._held, []
        reply = b"".join(held)
        tensor = measure(expected.name, reply[REPLY_SIZE_BYTES:], expected.ggml_type)
        self.checked += 1
        if (fault := self._judge(tensor)) is not None:
            self._reject(OutputRejected(tensor, fault))
            return
        self._out.append(reply)

    def _on_hello_reply(self, reply: bytes) -> None:
        assert self._hello_request_bytes is not None
        # The size first: matches() reads the version bytes, and a worker's reply may be shorter.
        dialect = next((d for d in DIALECTS if len(reply) == d.hello_reply_bytes
                        and d.matches(self._hello_request_bytes, reply)), None)
        if dialect is None:  # the request's size named dialects (_on_command): the reply fits none of them
            self._violation(UNKNOWN_DIALECT, f"the HELLO exchange ({self._hello_request_bytes}-byte request, "
                                             f"{len(reply)}-byte reply) matches no known dialect")
            return
        if dialect.name not in _LAST_CMD:  # chosen by the client's request (the fork's is 0 bytes)
            self._off(f"RPC dialect {dialect.name} is not checked")
            return
        self._last_cmd = _LAST_CMD[dialect.name]
        self._no_reply_cmds = _NO_REPLY_CMDS[dialect.name]
        self._phase = _Phase.CHECKING

    def data_to_client(self) -> bytes:
        """Everything releasable so far, in order; b"" when nothing is."""
        out, self._out = self._out, []
        if len(out) == 1 and isinstance(out[0], memoryview) and isinstance(out[0].obj, bytes) \
                and out[0].nbytes == len(out[0].obj):
            return out[0].obj  # once off, a whole input chunk goes back as the same object
        return b"".join(out)

    def next_event(self) -> OutputEvent | None:
        """The oldest event not yet taken, or None."""
        return self._events.popleft() if self._events else None

    def _off(self, reason: str) -> None:
        self._phase = _Phase.OFF
        self._events.append(CheckOff(reason))
        self._out.extend(self._held)
        self._held = []
        if self._reply_header:  # a size field begun (the client went off the rails meanwhile)
            self._out.append(bytes(self._reply_header))
            self._reply_header.clear()

    def _violation(self, reason: str, detail: str) -> None:
        self._reject(OutputRejected(None, protocol_fault(reason, detail)))

    def _reject(self, event: OutputRejected) -> None:
        # Whatever this input carried before the fault stays back too (as in rpc_watch.c): the
        # connection is reset, so nothing more of it is worth passing.
        self._phase = _Phase.REJECTED
        self._events.append(event)
        self._held, self._out = [], []
