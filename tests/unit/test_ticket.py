"""Node tickets: round trip, and every way a pasted ticket can be damaged."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import socket
from collections import namedtuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh_sidecar.errors import (
    TicketChecksumError,
    TicketError,
    TicketMalformedError,
    TicketTruncatedError,
    TicketVersionError,
)
from mesh_sidecar.net.addresses import reachable_addresses
from mesh_sidecar.wire.ticket import (
    MAX_TICKET_ADDRESSES,
    MAX_TICKET_CHARS,
    TICKET_PREFIX,
    PeerAddress,
    Ticket,
    decode_ticket,
    encode_ticket,
)

ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"

SAMPLE = Ticket(
    node_id=bytes(range(32)),
    mesh_secret=bytes(range(100, 132)),
    addresses=(
        PeerAddress("192.0.2.7", 7447),
        PeerAddress("2001:db8::1", 7447),
        PeerAddress("127.0.0.1", 7447),
    ),
)
SAMPLE_TEXT = encode_ticket(SAMPLE)

ipv4_hosts = st.ip_addresses(v=4).map(str)
ipv6_hosts = st.ip_addresses(v=6).map(str)
peer_addresses = st.builds(
    PeerAddress, host=st.one_of(ipv4_hosts, ipv6_hosts), port=st.integers(1, 65535)
)
tickets = st.builds(
    Ticket,
    node_id=st.binary(min_size=32, max_size=32),
    mesh_secret=st.binary(min_size=32, max_size=32),
    addresses=st.lists(peer_addresses, min_size=1, max_size=MAX_TICKET_ADDRESSES).map(tuple),
)


def _b32(raw: bytes) -> str:
    return base64.b32encode(raw).decode().rstrip("=").lower()


def _raw_body(text: str) -> bytes:
    body = text[len(TICKET_PREFIX) :].upper()
    return base64.b32decode(body + "=" * (-len(body) % 8))


def _with_checksum(payload: bytes) -> str:
    return TICKET_PREFIX + _b32(payload + hashlib.sha256(payload).digest()[:4])


# --- round trip --------------------------------------------------------------


@given(tickets)
def test_round_trip(t: Ticket) -> None:
    text = encode_ticket(t)
    assert text.startswith(TICKET_PREFIX)
    assert set(text[len(TICKET_PREFIX) :]) <= set(ALPHABET)
    assert len(text) <= MAX_TICKET_CHARS
    assert decode_ticket(text) == t


def test_sample_layout_matches_docstring() -> None:
    raw = _raw_body(SAMPLE_TEXT)
    assert raw[0] == 1
    assert raw[1:33] == SAMPLE.node_id
    assert raw[33:65] == SAMPLE.mesh_secret
    assert raw[65] == 3
    assert raw[66:73] == bytes([4, 192, 0, 2, 7]) + (7447).to_bytes(2, "big")
    assert raw[73] == 6 and raw[74:90] == ipaddress.IPv6Address("2001:db8::1").packed
    assert raw[-4:] == hashlib.sha256(raw[:-4]).digest()[:4]


@pytest.mark.parametrize(
    "pasted",
    [
        f"  {SAMPLE_TEXT}\n",
        f"Node ticket: {SAMPLE_TEXT}",
        f"\tnode ticket:{SAMPLE_TEXT}  \r\n",
    ],
)
def test_accepts_whitespace_and_label(pasted: str) -> None:
    assert decode_ticket(pasted) == SAMPLE


def test_peer_address_str_and_canonical_host() -> None:
    assert str(PeerAddress("192.0.2.7", 80)) == "192.0.2.7:80"
    assert str(PeerAddress("2001:0db8:0:0::1", 80)) == "[2001:db8::1]:80"
    assert PeerAddress("2001:0db8::1", 80) == PeerAddress("2001:db8::1", 80)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"node_id": b"\x00" * 31},
        {"mesh_secret": b"\x00" * 33},
        {"addresses": ()},
        {"addresses": (PeerAddress("192.0.2.1", 1),) * (MAX_TICKET_ADDRESSES + 1)},
    ],
)
def test_invalid_ticket_refused_on_construction(kwargs: dict) -> None:
    fields = {
        "node_id": SAMPLE.node_id,
        "mesh_secret": SAMPLE.mesh_secret,
        "addresses": SAMPLE.addresses,
        **kwargs,
    }
    with pytest.raises(ValueError):
        encode_ticket(Ticket(**fields))


@pytest.mark.parametrize(
    ("host", "port"),
    [("example.com", 80), ("192.0.2.1", 0), ("192.0.2.1", 65536), ("fe80::1%eth0", 80)],
)
def test_invalid_peer_address_refused(host: str, port: int) -> None:
    with pytest.raises(ValueError):
        PeerAddress(host, port)


# --- damaged tickets ------------------------------------------------------------


def test_every_truncation_is_truncated_or_malformed() -> None:
    for length in range(len(SAMPLE_TEXT)):
        cut = SAMPLE_TEXT[:length]
        with pytest.raises((TicketTruncatedError, TicketMalformedError)):
            decode_ticket(cut)
    # Once the prefix is whole, a cut reads as a cut, whatever the base32 length.
    for length in range(len(TICKET_PREFIX), len(SAMPLE_TEXT)):
        with pytest.raises(TicketTruncatedError, match="truncated"):
            decode_ticket(SAMPLE_TEXT[:length])


def test_every_substitution_is_refused() -> None:
    checksum_errors = 0
    total = 0
    for i in range(len(TICKET_PREFIX), len(SAMPLE_TEXT)):
        for ch in ALPHABET:
            if ch == SAMPLE_TEXT[i]:
                continue
            mutated = SAMPLE_TEXT[:i] + ch + SAMPLE_TEXT[i + 1 :]
            total += 1
            with pytest.raises(TicketError) as info:
                decode_ticket(mutated)
            checksum_errors += isinstance(info.value, TicketChecksumError)
    assert checksum_errors > total * 0.8


def test_checksum_message() -> None:
    i = len(TICKET_PREFIX) + 20
    mutated = SAMPLE_TEXT[:i] + ("a" if SAMPLE_TEXT[i] != "a" else "b") + SAMPLE_TEXT[i + 1 :]
    with pytest.raises(TicketChecksumError, match="altered or mistyped"):
        decode_ticket(mutated)


def test_version_2_is_refused_with_both_versions_named() -> None:
    raw = _raw_body(SAMPLE_TEXT)
    text = _with_checksum(bytes([2]) + raw[1:-4])
    with pytest.raises(TicketVersionError) as info:
        decode_ticket(text)
    message = str(info.value)
    assert "version 2" in message and "version 1" in message
    assert "Upgrade" in message


def test_extra_bytes_are_malformed() -> None:
    raw = _raw_body(SAMPLE_TEXT)
    with pytest.raises(TicketMalformedError, match="longer"):
        decode_ticket(TICKET_PREFIX + _b32(raw + b"\x00"))
    with pytest.raises(TicketMalformedError):
        decode_ticket(SAMPLE_TEXT + "a")


def _payload(n_addr: int, entries: bytes) -> bytes:
    return bytes([1]) + SAMPLE.node_id + SAMPLE.mesh_secret + bytes([n_addr]) + entries


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (_payload(1, bytes([5, 192, 0, 2, 1, 0, 80])), "family 5"),
        (_payload(0, b""), "no addresses"),
        (_payload(MAX_TICKET_ADDRESSES + 1, b""), f"{MAX_TICKET_ADDRESSES + 1} addresses"),
        (_payload(1, bytes([4, 192, 0, 2, 1, 0, 0])), "port 0"),
    ],
    ids=["bad-family", "no-addresses", "too-many-addresses", "port-0"],
)
def test_bad_fields_with_valid_checksum_are_malformed(payload: bytes, words: str) -> None:
    with pytest.raises(TicketMalformedError, match=words):
        decode_ticket(_with_checksum(payload))


def test_address_family_sets_length() -> None:
    # A v6 family byte on a v4-sized entry needs more bytes than there are.
    with pytest.raises(TicketTruncatedError):
        decode_ticket(_with_checksum(_payload(1, bytes([6, 192, 0, 2, 1, 0, 80]))))


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "starts with"),
        ("   \n", "starts with"),
        ("hello world", "starts with"),
        ("meshinx" + SAMPLE_TEXT[7:], "starts with"),
        (SAMPLE_TEXT.upper(), "starts with"),
        (SAMPLE_TEXT[:30] + "1" + SAMPLE_TEXT[31:], "'1'"),
        (SAMPLE_TEXT[:30] + "A" + SAMPLE_TEXT[31:], "'A'"),
        (SAMPLE_TEXT[:30] + " " + SAMPLE_TEXT[30:], "' '"),
        (SAMPLE_TEXT + "=", "'='"),
        (TICKET_PREFIX + "a" * (MAX_TICKET_CHARS + 1), "characters long"),
        ("x" * 10_000_000, "characters long"),
    ],
)
def test_not_a_ticket_is_malformed(text: str, words: str) -> None:
    with pytest.raises(TicketMalformedError, match=words):
        decode_ticket(text)


def test_non_text_is_malformed() -> None:
    with pytest.raises(TicketMalformedError):
        decode_ticket(SAMPLE_TEXT.encode())  # type: ignore[arg-type]


@settings(max_examples=500)
@given(st.text())
def test_arbitrary_text_raises_only_ticket_errors(text: str) -> None:
    with pytest.raises(TicketError):
        decode_ticket(text)


@settings(max_examples=500)
@given(st.text(alphabet=ALPHABET, max_size=700))
def test_arbitrary_base32_body_raises_only_ticket_errors(body: str) -> None:
    # Past the prefix check, so this reaches the binary parser.
    try:
        decode_ticket(TICKET_PREFIX + body)
    except TicketError:
        pass


# --- reachable addresses ------------------------------------------------------------


def test_reachable_addresses_ends_with_loopback() -> None:
    found = reachable_addresses(7447)
    assert found[-1] == PeerAddress("127.0.0.1", 7447)
    assert 1 <= len(found) <= MAX_TICKET_ADDRESSES
    assert len(set(found)) == len(found)
    assert all(a.port == 7447 for a in found)
    assert all(not ipaddress.ip_address(a.host).is_loopback for a in found[:-1])


_Snic = namedtuple("_Snic", "family address netmask broadcast ptp")


def _nic(family: socket.AddressFamily, address: str) -> _Snic:
    return _Snic(family, address, None, None, None)


def _fake_interfaces() -> dict[str, list[_Snic]]:
    return {
        "lo": [_nic(socket.AF_INET, "127.0.0.1"), _nic(socket.AF_INET6, "::1")],
        "eth0": [
            _nic(socket.AF_INET6, "fd00::2"),
            _nic(socket.AF_INET6, "fe80::1%eth0"),
            _nic(socket.AF_INET, "192.0.2.2"),
            _nic(socket.AF_PACKET, "02:00:00:00:00:01"),
        ],
        "eth1": [_nic(socket.AF_INET, "192.0.2.2")]
        + [_nic(socket.AF_INET, f"10.0.0.{i}") for i in range(1, 30)],
    }


def test_reachable_addresses_filters_dedups_and_caps() -> None:
    # an IPv4 socket cannot take it
    assert "fd00::2" not in [a.host for a in reachable_addresses(9000, interfaces=_fake_interfaces)]
    found = reachable_addresses(9000, ipv6=True, interfaces=_fake_interfaces)
    hosts = [a.host for a in found]
    assert len(found) == MAX_TICKET_ADDRESSES
    assert hosts[-1] == "127.0.0.1"
    assert hosts[0] == "192.0.2.2" and hosts.count("192.0.2.2") == 1
    assert "::1" not in hosts and not any(h.startswith("fe80") for h in hosts)
    # The cap drops the last interface addresses, never loopback.
    assert "fd00::2" not in hosts and "10.0.0.29" not in hosts


def test_reachable_addresses_lists_global_ipv6_only_when_asked() -> None:
    def one_interface():
        return {"eth0": [_nic(socket.AF_INET, "192.0.2.2"), _nic(socket.AF_INET6, "fd00::2"),
                         _nic(socket.AF_INET6, "fe80::1%eth0")]}

    assert [a.host for a in reachable_addresses(9000, interfaces=one_interface)] == ["192.0.2.2", "127.0.0.1"]
    assert [a.host for a in reachable_addresses(9000, ipv6=True, interfaces=one_interface)] == [
        "192.0.2.2", "fd00::2", "127.0.0.1"]


def test_reachable_addresses_fit_in_a_ticket() -> None:
    t = Ticket(SAMPLE.node_id, SAMPLE.mesh_secret, reachable_addresses(7447))
    assert decode_ticket(encode_ticket(t)) == t
