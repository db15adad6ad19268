"""Admission of a peer on one connection: the pure handshake (no I/O, no clock).

Runs as the first four messages on a new connection's control stream, right
after TLS. By then the client has checked that the server's TLS certificate
carries the node key it dialed (:meth:`ClientHandshake.start`), so it talks to
the node it meant; the server learns the client's id here and admits any id
whose proofs hold: the mesh secret is the admission, the node key the name.

    client                                              server
      |-- CLIENT_HELLO  version | client_id | Nc  ----------->|
      |<------------ SERVER_HELLO  version | server_id | Ns --|
      |-- CLIENT_PROOF  mac_c | sig_c  ---------------------->|  server checks
      |<------------------------- SERVER_PROOF  mac_s | sig_s |  client checks

    message    = type (1 byte) | body
    HELLO body = version (1) | node id (32) | nonce (32)    HELLO_BYTES = 66
    PROOF body = mac (32) | Ed25519 signature (64)          PROOF_BYTES = 97

    transcript = DOMAIN | version | client_id | Nc | server_id | Ns
    mac_role   = HMAC-SHA256(mesh secret, role label | transcript)
    sig_role   = Ed25519 signature by the role's node key over (role label | transcript)

Both nonces are fresh per connection, so a proof recorded on one connection
fails on any other; the role label stops a proof being reflected back at its
maker. The client proves first: the server sends nothing that depends on the
secret to a peer that has not shown it. Every field has a fixed length, so the
concatenations are unambiguous.
"""

from __future__ import annotations

import enum
import hashlib
import hmac

from ..errors import AuthError, MalformedMessageError, ProtocolVersionError
from ..identity import NODE_ID_BYTES, NodeIdentity, short_id, verify_signature

AUTH_VERSION = 1
DOMAIN = b"mesh-inference/1 auth"
NONCE_BYTES = 32
MESH_SECRET_BYTES = 32
MAC_BYTES = 32
SIGNATURE_BYTES = 64
AUTH_TIMEOUT_S = 5.0

HELLO_BYTES = 1 + 1 + NODE_ID_BYTES + NONCE_BYTES
PROOF_BYTES = 1 + MAC_BYTES + SIGNATURE_BYTES
MAX_MESSAGE_BYTES = max(HELLO_BYTES, PROOF_BYTES)

# Reasons a refusal names; the transport logs them and sends them to the peer.
WRONG_SECRET = "wrong mesh secret"
KEY_MISMATCH = "node key does not match ticket id"
BAD_SIGNATURE = "node key proof failed"
TIMED_OUT = "authentication timed out"
REMOVED = "node was removed from the mesh"


class MessageType(enum.IntEnum):
    CLIENT_HELLO = 1
    SERVER_HELLO = 2
    CLIENT_PROOF = 3
    SERVER_PROOF = 4


class Role(enum.Enum):
    """Who made a proof; its label is mixed into both the MAC and the signature."""

    CLIENT = b"client proof"
    SERVER = b"server proof"


def transcript(client_id: bytes, client_nonce: bytes, server_id: bytes, server_nonce: bytes) -> bytes:
    """What both proofs on one connection are bound to."""
    return DOMAIN + bytes([AUTH_VERSION]) + client_id + client_nonce + server_id + server_nonce


def _proof_input(role: Role, transcript_bytes: bytes) -> bytes:
    return role.value + b"|" + transcript_bytes


def make_proof(identity: NodeIdentity, mesh_secret: bytes, role: Role, transcript_bytes: bytes) -> bytes:
    """The PROOF message for ``role`` over ``transcript_bytes``."""
    signed = _proof_input(role, transcript_bytes)
    mac = hmac.new(mesh_secret, signed, hashlib.sha256).digest()
    message_type = MessageType.CLIENT_PROOF if role is Role.CLIENT else MessageType.SERVER_PROOF
    return bytes([message_type]) + mac + identity.sign(signed)


def check_proof(
    message: bytes, node_id: bytes, mesh_secret: bytes, role: Role, transcript_bytes: bytes
) -> None:
    """Raise AuthError unless ``message`` proves ``node_id``'s key and the mesh secret."""
    message_type = MessageType.CLIENT_PROOF if role is Role.CLIENT else MessageType.SERVER_PROOF
    body = _body(message, message_type, PROOF_BYTES)
    mac, signature = body[:MAC_BYTES], body[MAC_BYTES:]
    signed = _proof_input(role, transcript_bytes)
    try:
        verify_signature(node_id, signature, signed)
    except AuthError as exc:
        raise AuthError(f"{BAD_SIGNATURE} for {short_id(node_id)}") from exc
    expected = hmac.new(mesh_secret, signed, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise AuthError(WRONG_SECRET)


def timeout_error(timeout_s: float = AUTH_TIMEOUT_S) -> AuthError:
    """The refusal of a peer that did not finish the handshake within ``timeout_s``."""
    return AuthError(f"{TIMED_OUT} after {timeout_s:g} s")


def encode_hello(message_type: MessageType, node_id: bytes, nonce: bytes) -> bytes:
    return bytes([message_type, AUTH_VERSION]) + node_id + nonce


def decode_hello(message: bytes, message_type: MessageType) -> tuple[bytes, bytes]:
    """(node id, nonce) of a HELLO; WireError if it is not one we speak."""
    body = _body(message, message_type, HELLO_BYTES)
    if body[0] != AUTH_VERSION:
        raise ProtocolVersionError(
            f"peer speaks auth version {body[0]}, this node speaks {AUTH_VERSION}: "
            "run the same mesh-inference version on every node"
        )
    node_id = body[1 : 1 + NODE_ID_BYTES]
    return node_id, body[1 + NODE_ID_BYTES :]


def _body(message: bytes, message_type: MessageType, size: int) -> bytes:
    if not message or message[0] != message_type:
        got = message[0] if message else "nothing"
        raise MalformedMessageError(f"expected auth message {message_type.name}, got type {got}")
    if len(message) != size:
        raise MalformedMessageError(f"{message_type.name} is {len(message)} bytes, not {size}")
    return message[1:]


class _Handshake:
    """State shared by both roles: keys, nonce, deadline, outcome."""

    def __init__(
        self, identity: NodeIdentity, mesh_secret: bytes, nonce: bytes, now: float, timeout_s: float = AUTH_TIMEOUT_S
    ) -> None:
        if len(mesh_secret) != MESH_SECRET_BYTES:
            raise ValueError(f"mesh secret must be {MESH_SECRET_BYTES} bytes")
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
        self._identity = identity
        self._secret = mesh_secret
        self._nonce = nonce
        self.timeout_s = timeout_s
        self.deadline = now + timeout_s
        self.peer_id: bytes | None = None  # trustworthy only once `complete`
        self.complete = False

    def _check_time(self, now: float) -> None:
        if now >= self.deadline:
            raise timeout_error(self.timeout_s)

    def _check_open(self) -> None:
        if self.complete:
            raise MalformedMessageError("auth message after the handshake completed")


class ClientHandshake(_Handshake):
    """The dialing side: knows which node it wants before it starts."""

    def __init__(
        self,
        identity: NodeIdentity,
        mesh_secret: bytes,
        expected_id: bytes,
        nonce: bytes,
        now: float,
        timeout_s: float = AUTH_TIMEOUT_S,
    ) -> None:
        super().__init__(identity, mesh_secret, nonce, now, timeout_s)
        self._expected_id = expected_id
        self._transcript: bytes | None = None
        self._started = False

    def _check_peer_key(self, node_id: bytes) -> None:
        if node_id != self._expected_id:
            raise AuthError(
                f"{KEY_MISMATCH} (expected {short_id(self._expected_id)}, got {short_id(node_id)})"
            )

    def start(self, tls_peer_id: bytes, now: float) -> bytes:
        """CLIENT_HELLO, once TLS showed the server's key is ``tls_peer_id``."""
        self._check_time(now)
        self._check_peer_key(tls_peer_id)
        self._started = True
        return encode_hello(MessageType.CLIENT_HELLO, self._identity.node_id, self._nonce)

    def receive(self, message: bytes, now: float) -> bytes | None:
        """Take one server message; return the reply, or None once admitted."""
        self._check_time(now)
        self._check_open()
        if not self._started:
            raise MalformedMessageError("server spoke before the client hello")
        if self._transcript is None:
            server_id, server_nonce = decode_hello(message, MessageType.SERVER_HELLO)
            self._check_peer_key(server_id)
            self._transcript = transcript(self._identity.node_id, self._nonce, server_id, server_nonce)
            return make_proof(self._identity, self._secret, Role.CLIENT, self._transcript)
        check_proof(message, self._expected_id, self._secret, Role.SERVER, self._transcript)
        self.peer_id = self._expected_id
        self.complete = True
        return None


class ServerHandshake(_Handshake):
    """The accepting side: learns the client's id from its hello."""

    def __init__(
        self, identity: NodeIdentity, mesh_secret: bytes, nonce: bytes, now: float, timeout_s: float = AUTH_TIMEOUT_S
    ) -> None:
        super().__init__(identity, mesh_secret, nonce, now, timeout_s)
        self._transcript: bytes | None = None

    def receive(self, message: bytes, now: float) -> bytes:
        """Take one client message; return the reply (SERVER_PROOF means admitted)."""
        self._check_time(now)
        self._check_open()
        if self._transcript is None:
            client_id, client_nonce = decode_hello(message, MessageType.CLIENT_HELLO)
            self.peer_id = client_id
            own_id = self._identity.node_id
            self._transcript = transcript(client_id, client_nonce, own_id, self._nonce)
            return encode_hello(MessageType.SERVER_HELLO, own_id, self._nonce)
        assert self.peer_id is not None
        check_proof(message, self.peer_id, self._secret, Role.CLIENT, self._transcript)
        self.complete = True
        return make_proof(self._identity, self._secret, Role.SERVER, self._transcript)
