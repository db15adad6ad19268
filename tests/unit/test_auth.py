"""The pure admission handshake: proofs hold, and every altered field breaks them."""

from __future__ import annotations

import pytest

from mesh_sidecar.errors import AuthError, MalformedMessageError, ProtocolVersionError
from mesh_sidecar.identity import generate_identity
from mesh_sidecar.wire import auth

SECRET = bytes(range(32))
OTHER_SECRET = bytes(32)
NOW = 1000.0

CLIENT = generate_identity()
SERVER = generate_identity()
STRANGER = generate_identity()


def nonce(n: int) -> bytes:
    return bytes([n]) * auth.NONCE_BYTES


def pair(
    client_secret: bytes = SECRET, server_secret: bytes = SECRET, client_nonce: int = 1, server_nonce: int = 2
) -> tuple[auth.ClientHandshake, auth.ServerHandshake]:
    client = auth.ClientHandshake(CLIENT, client_secret, SERVER.node_id, nonce(client_nonce), NOW)
    server = auth.ServerHandshake(SERVER, server_secret, nonce(server_nonce), NOW)
    return client, server


def flip(message: bytes, index: int) -> bytes:
    return message[:index] + bytes([message[index] ^ 1]) + message[index + 1 :]


def test_both_sides_admit_each_other() -> None:
    client, server = pair()
    client_hello = client.start(SERVER.node_id, NOW)
    server_hello = server.receive(client_hello, NOW)
    client_proof = client.receive(server_hello, NOW)
    assert client_proof is not None
    server_proof = server.receive(client_proof, NOW)
    assert server.complete and server.peer_id == CLIENT.node_id
    assert client.receive(server_proof, NOW) is None
    assert client.complete and client.peer_id == SERVER.node_id


def run_until_client_proof(client: auth.ClientHandshake, server: auth.ServerHandshake) -> bytes:
    server_hello = server.receive(client.start(SERVER.node_id, NOW), NOW)
    proof = client.receive(server_hello, NOW)
    assert proof is not None
    return proof


def test_wrong_secret_is_named() -> None:
    client, server = pair(client_secret=OTHER_SECRET)
    proof = run_until_client_proof(client, server)
    with pytest.raises(AuthError, match=auth.WRONG_SECRET):
        server.receive(proof, NOW)
    assert not server.complete


@pytest.mark.parametrize(
    ("offset", "reason"),
    [(1, auth.WRONG_SECRET), (1 + auth.MAC_BYTES, auth.BAD_SIGNATURE), (auth.PROOF_BYTES - 1, auth.BAD_SIGNATURE)],
    ids=["mac", "signature-start", "signature-end"],
)
def test_tampered_client_proof_fails(offset: int, reason: str) -> None:
    client, server = pair()
    proof = run_until_client_proof(client, server)
    with pytest.raises(AuthError, match=reason):
        server.receive(flip(proof, offset), NOW)


@pytest.mark.parametrize("offset", [1, 1 + auth.MAC_BYTES], ids=["mac", "signature"])
def test_tampered_server_proof_fails(offset: int) -> None:
    client, server = pair()
    server_proof = server.receive(run_until_client_proof(client, server), NOW)
    with pytest.raises(AuthError):
        client.receive(flip(server_proof, offset), NOW)
    assert not client.complete


def test_client_claiming_an_id_whose_key_it_lacks_fails() -> None:
    # An impostor that knows the mesh secret but not CLIENT's key claims to be CLIENT.
    impostor = auth.ClientHandshake(STRANGER, SECRET, SERVER.node_id, nonce(1), NOW)
    _, server = pair()
    hello = impostor.start(SERVER.node_id, NOW)
    claimed = hello[:2] + CLIENT.node_id + hello[2 + 32 :]
    proof = impostor.receive(server.receive(claimed, NOW), NOW)
    assert proof is not None
    with pytest.raises(AuthError, match=auth.BAD_SIGNATURE):
        server.receive(proof, NOW)


def test_client_nonce_altered_in_flight_fails() -> None:
    client, server = pair()
    hello = client.start(SERVER.node_id, NOW)
    proof = client.receive(server.receive(flip(hello, len(hello) - 1), NOW), NOW)
    assert proof is not None
    with pytest.raises(AuthError):
        server.receive(proof, NOW)


def test_server_nonce_altered_in_flight_fails() -> None:
    client, server = pair()
    server_hello = server.receive(client.start(SERVER.node_id, NOW), NOW)
    proof = client.receive(flip(server_hello, len(server_hello) - 1), NOW)
    assert proof is not None
    with pytest.raises(AuthError):
        server.receive(proof, NOW)


def test_server_hello_with_another_id_fails() -> None:
    client, server = pair()
    server_hello = server.receive(client.start(SERVER.node_id, NOW), NOW)
    forged = server_hello[:2] + STRANGER.node_id + server_hello[2 + 32 :]
    with pytest.raises(AuthError, match=auth.KEY_MISMATCH):
        client.receive(forged, NOW)


def test_tls_key_other_than_expected_fails() -> None:
    client, _ = pair()
    with pytest.raises(AuthError, match=auth.KEY_MISMATCH):
        client.start(STRANGER.node_id, NOW)


def test_proof_from_another_connection_fails() -> None:
    first_client, first_server = pair(client_nonce=1, server_nonce=2)
    recorded = run_until_client_proof(first_client, first_server)
    # Same two nodes, fresh nonces: the recorded proof is bound to the old transcript.
    client, server = pair(client_nonce=3, server_nonce=4)
    run_until_client_proof(client, server)
    with pytest.raises(AuthError):
        server.receive(recorded, NOW)


def test_proof_cannot_be_reflected_to_the_other_role() -> None:
    transcript = auth.transcript(CLIENT.node_id, nonce(1), SERVER.node_id, nonce(2))
    server_proof = auth.make_proof(SERVER, SECRET, auth.Role.SERVER, transcript)
    as_client = bytes([auth.MessageType.CLIENT_PROOF]) + server_proof[1:]
    auth.check_proof(server_proof, SERVER.node_id, SECRET, auth.Role.SERVER, transcript)
    with pytest.raises(AuthError):
        auth.check_proof(as_client, SERVER.node_id, SECRET, auth.Role.CLIENT, transcript)


def test_other_version_is_refused() -> None:
    client, server = pair()
    hello = bytearray(client.start(SERVER.node_id, NOW))
    hello[1] = auth.AUTH_VERSION + 1
    with pytest.raises(ProtocolVersionError):
        server.receive(bytes(hello), NOW)


@pytest.mark.parametrize("message", [b"", b"\x01", b"\x03" + bytes(auth.HELLO_BYTES - 1), bytes(auth.HELLO_BYTES + 1)])
def test_malformed_messages_are_refused(message: bytes) -> None:
    _, server = pair()
    with pytest.raises(MalformedMessageError):
        server.receive(message, NOW)


def test_handshake_past_deadline_fails() -> None:
    client, server = pair()
    hello = client.start(SERVER.node_id, NOW)
    with pytest.raises(AuthError, match="timed out"):
        server.receive(hello, NOW + auth.AUTH_TIMEOUT_S)


def test_no_message_after_completion() -> None:
    client, server = pair()
    server_proof = server.receive(run_until_client_proof(client, server), NOW)
    client.receive(server_proof, NOW)
    with pytest.raises(MalformedMessageError):
        client.receive(server_proof, NOW)
    with pytest.raises(MalformedMessageError):
        server.receive(server_proof, NOW)
