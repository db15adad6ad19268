"""One exception tree for the whole sidecar.

Every error a person can see derives from :class:`MeshError` and carries a
sentence that says what went wrong and what to do next. Deep code raises;
the CLI and each connection/process entry point catch ``MeshError`` once and
turn it into a message or a close with a reason.

    MeshError
    ├── UsageError              bad command-line input or configuration
    │   └── PortInUseError      a port the user named is taken
    ├── SetupError              preparing what a node needs
    │   ├── BuildError          fetching or compiling llama.cpp
    │   ├── BinariesMissingError a --llama-bin dir lacks a binary
    │   ├── ModelError          a missing, non-GGUF or corrupt model
    │   └── PlanError           the mesh cannot hold the model (names the shortfall)
    ├── ProcessError            a child process misbehaved
    │   ├── ChildExitedError    a child died (carries its last log lines)
    │   └── ReadinessTimeoutError a child never became ready
    ├── TicketError             a node ticket could not be used
    │   ├── TicketMalformedError      not a ticket at all / bad characters
    │   ├── TicketTruncatedError      shorter than its own header says
    │   ├── TicketVersionError        a version this build does not read
    │   └── TicketChecksumError       altered or mistyped
    ├── WireError               a peer sent bytes we cannot accept
    │   ├── FrameTooLargeError        a length field over the limit
    │   ├── MalformedMessageError     a frame that does not decode
    │   └── ProtocolVersionError      a wire version we do not speak
    ├── AuthError               a peer failed admission (key or mesh secret)
    ├── PeerConnectionError     a connection to a peer could not be made or is gone
    │   ├── AddressUnresolvedError    a peer's host name does not resolve
    │   ├── DialTimeoutError          no answer from an address in time
    │   ├── ConnectionClosedError     used after it closed, or closed before admission
    │   ├── TransportStoppedError     the node's QUIC endpoint is not running
    │   └── RelayRefusedError         a member would not relay towards a peer (and said why)
    ├── ServingError            a request could not be served as asked
    │   ├── ServiceUnavailableError   no llama-server to take it (the API answers 503)
    │   ├── UpstreamLostError         llama-server (or a member) did not answer, or its answer broke off
    │   │   └── UpstreamCutError      the node cut the answer itself: llama-server stalled or was slow
    │   └── ReplayMismatchError       a failover's replay gave other text than was sent
    └── ReceiptError            a run receipt is damaged, altered or not reproduced
"""

from __future__ import annotations


class MeshError(Exception):
    """Base of every error the sidecar raises on purpose."""


class UsageError(MeshError):
    """Bad command-line input or configuration."""


class PortInUseError(UsageError):
    """A port the user asked for is already taken."""


class SetupError(MeshError):
    """Something a node needs before it starts could not be prepared."""


class BuildError(SetupError):
    """Fetching or compiling the pinned llama.cpp failed."""


class SourceUnavailableError(BuildError):
    """The pinned llama.cpp source is in the cache neither here nor on PyPI (a member may have it)."""


class BinariesMissingError(SetupError):
    """A llama.cpp binary directory lacks ggml-rpc-server or llama-server."""


class ModelError(SetupError):
    """The model file is missing, not a GGUF, or fails its checksum."""


class PlanError(SetupError):
    """The members' capacity cannot hold the model; the message names the shortfall."""


class ProcessError(MeshError):
    """A child process (rpc-server, llama-server) misbehaved."""


class ChildExitedError(ProcessError):
    """A child process exited; the message carries its last log lines."""


class ReadinessTimeoutError(ProcessError):
    """A child process did not become ready in time."""


class TicketError(MeshError):
    """A node ticket could not be decoded."""


class TicketMalformedError(TicketError):
    """The text is not a ticket (wrong prefix or characters)."""


class TicketTruncatedError(TicketError):
    """The ticket is shorter than its own header says: it was cut when copied."""


class TicketVersionError(TicketError):
    """The ticket has a format version this build does not read."""


class TicketChecksumError(TicketError):
    """The ticket's checksum does not match: it was altered or mistyped."""


class WireError(MeshError):
    """A peer sent bytes that we cannot accept."""


class FrameTooLargeError(WireError):
    """A length field is over the limit for its kind of frame."""


class MalformedMessageError(WireError):
    """A frame's contents do not decode as the message it claims to be."""


class ProtocolVersionError(WireError):
    """A peer speaks a wire version we do not."""


class AuthError(MeshError):
    """A peer failed admission: wrong node key or no proof of the mesh secret."""


class PeerConnectionError(MeshError):
    """A connection to a peer could not be made, or is gone."""


class AddressUnresolvedError(PeerConnectionError):
    """A peer's address names a host that does not resolve."""


class DialTimeoutError(PeerConnectionError):
    """An address did not answer (TLS and admission included) in time."""


class ConnectionClosedError(PeerConnectionError):
    """The connection was used after it closed, or it closed before admission."""


class TransportStoppedError(PeerConnectionError):
    """The node's QUIC endpoint is not running (not started yet, or stopped)."""


class RelayRefusedError(PeerConnectionError):
    """A member would not relay towards a peer (not a member it reaches, or itself), and said why."""


class ServingError(MeshError):
    """A request to the API could not be served as asked."""


class ServiceUnavailableError(ServingError):
    """No llama-server can take the request now; the API answers 503 with this message and ``code``."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code  # the OpenAI-style error code: "model_loading" or "insufficient_capacity"


class UpstreamLostError(ServingError):
    """The llama-server or member a request was sent to could not be reached, or its answer broke off."""


class UpstreamCutError(UpstreamLostError):
    """The node cut the answer itself (llama-server stalled, or a worker held it up): a new one is coming."""


class ReplayMismatchError(ServingError):
    """After a failover the replayed stream differs from the text the client already has."""


class ReceiptError(MeshError):
    """A run receipt failed verification, or its replay gave other output."""
