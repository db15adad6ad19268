"""A node's identity: one Ed25519 keypair, created once and kept in the node's home.

The node id IS the 32-byte raw public key. People see it short
(``node_3f9a1c2b``); the wire and tickets carry all 32 bytes. The same key signs
a self-signed X.509 certificate that the node presents in every QUIC handshake,
so a peer can check "the key on this connection is the id I expected".
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.x509.oid import NameOID

from .errors import AuthError, SetupError

NODE_ID_BYTES = 32
KEY_FILE_NAME = "identity.key"
SHORT_ID_HEX_CHARS = 8
CERT_VALIDITY_DAYS = 3650


def short_id(node_id: bytes) -> str:
    """The form people read: ``node_`` and the first hex digits of the key."""
    return "node_" + node_id.hex()[:SHORT_ID_HEX_CHARS]


@dataclass(frozen=True)
class NodeIdentity:
    """A node's private key and the id derived from it."""

    private_key: Ed25519PrivateKey

    @property
    def node_id(self) -> bytes:
        """The 32-byte raw public key."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def short_id(self) -> str:
        return short_id(self.node_id)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def certificate(self) -> x509.Certificate:
        """A self-signed certificate over this node's key, for the QUIC handshake."""
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.short_id)])
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.private_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=CERT_VALIDITY_DAYS))
            .sign(self.private_key, algorithm=None)
        )


def generate_identity() -> NodeIdentity:
    return NodeIdentity(Ed25519PrivateKey.generate())


def load_or_create_identity(home: Path) -> NodeIdentity:
    """Read the node key from ``home``, creating it (mode 0600) on first start."""
    path = home / KEY_FILE_NAME
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except ValueError as exc:
            raise SetupError(
                f"The node key {path} is unreadable ({exc}). Move it away to start "
                "this node with a new identity (peers will see a new node)."
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise SetupError(f"The node key {path} is not an Ed25519 key. Move it away and restart.")
        return NodeIdentity(key)
    home.mkdir(parents=True, exist_ok=True)
    identity = generate_identity()
    pem = identity.private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Not home.write_private_file: that replaces a file, and a node's key must never be replaced.
    # O_EXCL makes a second node started at the same moment on this home fail here instead of
    # overwriting the key the first one already runs with. 0600 from creation, as there.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return identity


def node_id_of_certificate(cert: x509.Certificate) -> bytes:
    """The node id a certificate speaks for; AuthError if it is not an Ed25519 cert."""
    key = cert.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise AuthError("peer certificate does not carry an Ed25519 node key")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def verify_signature(node_id: bytes, signature: bytes, message: bytes) -> None:
    """Check ``signature`` by ``node_id`` over ``message``; AuthError if it fails."""
    if len(node_id) != NODE_ID_BYTES:
        raise AuthError("node id has the wrong length")
    try:
        Ed25519PublicKey.from_public_bytes(node_id).verify(signature, message)
    except InvalidSignature as exc:
        raise AuthError(f"bad signature from {short_id(node_id)}") from exc
