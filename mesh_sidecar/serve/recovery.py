"""One generation request's way through failovers, as a machine: events in, decisions out.

The exchange (exchange.py) asks llama-server and relays the answer; this module decides
what to ask, and what to do when the llama-server under a request dies, stalls
or is found slow (a failover). It does no I/O: the exchange performs each decision
and feeds back what happened, in h11's shape. Theory of operation:

    event                        what the client has / the request   decision
    (start)                                                          Ask the request
    Failed                       failovers left                      WaitForUpstream
    Failed, llama-server alive   failovers left                      as UpstreamReady, on the same one
    Failed                       the MAX_FAILOVERS_PER_REQUEST-th +1   GiveUp 502 upstream_failed
    Unavailable                  (no llama-server in time, refused)  GiveUp 503 with its code
    UpstreamReady                nothing (no response begun)          Ask the request again (RETRIED)
    UpstreamReady, other model   a plain answer being assembled       Ask it again whole (SWITCHED)
    UpstreamReady, other model   a stream with text                   GiveUp 503 model_switched
    UpstreamReady                a stream begun, continuation covers  Prepare (render, spell the ids)
    UpstreamReady                a stream begun, otherwise            Ask the request, replayed (REPLAYED)
    Prepared                     the ids spell the text delivered     Ask the continuation (CONTINUED)
    Prepared (they do not),      PrepareFailed, Refused               Ask the request, replayed (REPLAYED)
    Cut                          a planned resume point (verify)      Prepare, on the same llama-server
    Broken                       (replay mismatch, oversized event)   GiveUp 502 upstream_failed

Once replayed, a request is never continued again: the continuation's record of
token ids stops where the replay began. Text from two models is never spliced.

The data path is ``relay``: each server-sent event llama-server sends, in, and
the events for the client, out (a continuation's reshaped into the client's
endpoint format, a replay's with what the client has dropped).

``continued_at`` is for the run receipt: where an answer was continued is where
a replay of the receipt must continue it too (the text after a continuation
point need not be an undisturbed run's: llama.cpp is not batch-invariant). The
proxy reproduces it when asked with ``continue_at``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .continuation import CONTINUE_PATH, Continuation
from .sse import Replay, StreamLedger

MAX_FAILOVERS_PER_REQUEST = 2
UPSTREAM_FAILED_CODE = "upstream_failed"
MODEL_SWITCHED_CODE = "model_switched"
UPSTREAM_FAILED_STATUS = 502  # the gateway's upstream failed
UNAVAILABLE_STATUS = 503  # nothing to ask: loading, refused, or another model in service


class Shape(enum.Enum):
    """How the client gets its answer, which decides what a failover can do."""

    WHOLE = "whole"  # one response, read whole from llama-server first: retried whole
    STREAM = "stream"  # server-sent events passed on as they come
    ASSEMBLED = "assembled"  # a plain answer that llama-server streams and the proxy assembles


class Step(enum.Enum):
    """Why a request was sent (again) to llama-server."""

    ASKED = "asked"  # the first time
    RETRIED = "retried"  # whole, nothing had reached the client
    SWITCHED = "switched"  # whole, on the model now in service (a plain answer being assembled)
    CONTINUED = "continued"  # from the token ids delivered
    REPLAYED = "replayed"  # whole, what the client has checked and dropped


# --- events: what happened --------------------------------------------------------------------


@dataclass(frozen=True)
class Failed:
    """The llama-server under the request died, stalled, or was found slow; or only the request's connection
    to it was lost."""

    reason: str
    # The llama-server still answers its health check and the node did not cut it: only the connection was
    # lost, and the request goes on on the same llama-server (no newer one is coming).
    upstream_alive: bool = False


@dataclass(frozen=True)
class UpstreamReady:
    """A llama-server newer than the one that failed is ready."""

    model: str  # the id of the model it serves


@dataclass(frozen=True)
class Unavailable:
    """No newer llama-server came in time, or the mesh refuses to serve."""

    message: str
    code: str


@dataclass(frozen=True)
class Prepared:
    """The new llama-server's answers to a Prepare decision."""

    prompt: Any  # the rendered chat prompt (a str when sound); None when no template was asked for
    detokenized: Any  # the detokenize answer for the resume ids


@dataclass(frozen=True)
class PrepareFailed:
    """A Prepare decision's requests failed."""

    reason: str


@dataclass(frozen=True)
class Refused:
    """llama-server answered a continuation with another status than 200."""

    status: int
    detail: str


@dataclass(frozen=True)
class Cut:
    """A planned resume point (``continue_at``) was reached: the stream there was closed."""


@dataclass(frozen=True)
class Broken:
    """The answer cannot go on: a replay differs from what was sent, or an event is malformed."""

    message: str


Event = Failed | UpstreamReady | Unavailable | Prepared | PrepareFailed | Refused | Cut | Broken


# --- decisions: what the proxy does next ------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """Send ``body`` to the current llama-server's ``target`` (path and query) and relay the answer."""

    target: str
    body: bytes
    step: Step
    resume_tokens: int = 0  # CONTINUED: the tokens delivered that the answer goes on from
    why: str = ""  # REPLAYED: why not continued (for the log)


@dataclass(frozen=True)
class WaitForUpstream:
    """Wait for a llama-server newer than the one that failed (the request is not in flight meanwhile)."""


@dataclass(frozen=True)
class Prepare:
    """Ask the current llama-server to render the chat prompt (``template``, when not None) and
    to detokenize the resume ids (``detokenize``); feed back Prepared or PrepareFailed."""

    template: dict[str, Any] | None
    detokenize: dict[str, Any]


@dataclass(frozen=True)
class GiveUp:
    """End the request with this error: a response of ``status``, or an error event ending a
    stream that has begun."""

    status: int
    message: str
    code: str


Decision = Ask | WaitForUpstream | Prepare | GiveUp


class RequestRecovery:
    """One request's recovery state; see the module docstring for the decisions.

    ``path_qs`` and ``body``: the request as llama-server gets it. ``continuation``: None
    when continuation does not cover the request (or is turned off): a stream is replayed.
    ``continue_at``: resume points to reproduce (a receipt's ``continued_at``).
    """

    def __init__(self, path_qs: str, body: bytes, shape: Shape, model: str,
                 continuation: Continuation | None = None, continue_at: Sequence[int] = (),
                 max_failovers: int = MAX_FAILOVERS_PER_REQUEST) -> None:
        self._path_qs = path_qs
        self._body = body
        self.shape = shape
        self._model = model
        self._continuation = continuation
        self._planned_cuts = sorted(continue_at)
        self._max_failovers = max_failovers
        self._failovers = 0
        self._ledger = StreamLedger()
        self._replay: Replay | None = None
        self._continuing = False  # the answer relayed now is a continuation's (reshaped)
        self._began = False  # the client's response (a stream) has begun
        self.continued_at: list[int] = []  # the tokens delivered at each continuation, in order

    # --- questions ---

    @property
    def delivered(self) -> bool:
        """Whether any text reached the client (or the assembly of a plain answer)."""
        return bool(self._ledger.delivered)

    @property
    def continuing(self) -> bool:
        return self._continuing

    def resume_tokens(self) -> int:
        return len(self._continuation.resume_ids) if self._continuation is not None else 0

    # --- the data path ---

    def began(self) -> None:
        """The client's response has begun (a stream's headers went out)."""
        self._began = True

    def relay(self, event: bytes) -> list[bytes]:
        """The events for the client for one event from llama-server (MeshError: feed Broken)."""
        events = self._continuation.reshape(event) if self._continuing and self._continuation else [event]
        out = []
        for each in events:
            if self._replay is not None:
                passed = self._replay.filter(each)
                if passed is not None:
                    out.append(passed)
                continue
            self._ledger.record(each)
            if self._continuation is not None:
                self._continuation.record(each)
            out.append(each)
        return out

    def cut_due(self) -> bool:
        """Whether the answer has reached the next planned resume point: close the stream, feed Cut.

        A point passed over (the answer differs from the receipt's) is dropped."""
        if not self._planned_cuts or self._continuation is None or self._replay is not None:
            return False
        resumed = self.resume_tokens()
        while self._planned_cuts and self._planned_cuts[0] < resumed:
            self._planned_cuts.pop(0)
        return bool(self._planned_cuts) and self._planned_cuts[0] == resumed and self._continuation.resumable()

    # --- events in, decisions out ---

    def start(self) -> Ask:
        return Ask(self._path_qs, self._body, Step.ASKED)

    def handle(self, event: Event) -> Decision:
        match event:
            case Failed(reason=reason, upstream_alive=alive):
                self._failovers += 1
                if self._failovers > self._max_failovers:
                    return GiveUp(UPSTREAM_FAILED_STATUS, f"llama-server failed again ({reason})",
                                  UPSTREAM_FAILED_CODE)
                return self._on_upstream(self._model) if alive else WaitForUpstream()
            case Unavailable(message=message, code=code):
                return GiveUp(UPSTREAM_FAILED_STATUS if code == UPSTREAM_FAILED_CODE else UNAVAILABLE_STATUS,
                              message, code)
            case UpstreamReady(model=model):
                return self._on_upstream(model)
            case Prepared(prompt=prompt, detokenized=detokenized):
                return self._on_prepared(prompt, detokenized)
            case PrepareFailed(reason=reason):
                return self._replayed(f"cannot prepare its continuation ({reason})")
            case Refused(status=status, detail=detail):
                if self._continuing:
                    self.continued_at.pop()  # nothing of it was delivered: the receipt must not name it
                return self._replayed(f"llama-server refused the continuation ({status}: {detail})")
            case Cut():
                if self._planned_cuts:
                    self._planned_cuts.pop(0)
                return self._prepare()
            case Broken(message=message):
                return GiveUp(UPSTREAM_FAILED_STATUS, message, UPSTREAM_FAILED_CODE)
        raise AssertionError(f"not an event: {event!r}")

    def _on_upstream(self, model: str) -> Decision:
        switched, self._model = model != self._model, model
        if switched and self.delivered and self.shape is Shape.ASSEMBLED:
            # Nothing reached the client: the new model answers it whole, as any plain request.
            self._ledger, self._replay, self._continuing = StreamLedger(), None, False
            if self._continuation is not None:
                self._continuation = Continuation(self._continuation.path, self._continuation.sent)
            return self._ask(Step.SWITCHED)
        if switched and self.delivered:
            return GiveUp(UNAVAILABLE_STATUS, (
                f"The mesh lost capacity and now serves {model!r} instead of the model that began the answer; "
                "a stream cannot continue on another model. Send the request again."), MODEL_SWITCHED_CODE)
        if not (self._began or self.delivered):
            return self._ask(Step.RETRIED)
        if self._continuation is None:
            return self._replayed("continuation does not cover the request")
        if self._replay is not None:
            return self._replayed("it was replayed before")
        if not self._continuation.resumable():
            return self._replayed(self._continuation.why_not or "no token to continue from")
        return self._prepare()

    def _prepare(self) -> Prepare:
        assert self._continuation is not None
        return Prepare(self._continuation.template_request(), self._continuation.detokenize_request())

    def _on_prepared(self, prompt: Any, detokenized: Any) -> Decision:
        continuation = self._continuation
        assert continuation is not None
        if continuation.template_request() is not None and not isinstance(prompt, str):
            return self._replayed("the chat template was rendered without a prompt")
        if not continuation.spells_delivered(detokenized):
            return self._replayed("its token ids do not spell the text delivered")
        resumed = self.resume_tokens()
        body = json.dumps(continuation.request(prompt if isinstance(prompt, str) else None)).encode()
        self._continuing = True
        self.continued_at.append(resumed)
        return Ask(CONTINUE_PATH, body, Step.CONTINUED, resume_tokens=resumed)

    def _replayed(self, why: str) -> Ask:
        self._replay = Replay(self._ledger)
        return self._ask(Step.REPLAYED, why)

    def _ask(self, step: Step, why: str = "") -> Ask:
        self._continuing = False
        return Ask(self._path_qs, self._body, step, why=why)
