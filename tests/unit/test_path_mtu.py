"""Datagram size discovery (path_mtu.py): the search alone (over real links of unequal MTU:
tests/integration/test_path_mtu.py)."""

from __future__ import annotations

from mesh_sidecar.net import path_mtu
from mesh_sidecar.net.path_mtu import BASE_DATAGRAM_BYTES, DatagramSizeSearch, candidate_sizes

ETHERNET, JUMBO = 1500 - 28, 9000 - 28


def test_candidates_are_the_interface_limit_then_common_mtus_below_it() -> None:
    assert candidate_sizes(65536) == [path_mtu.MAX_PROBED_DATAGRAM_BYTES, JUMBO, ETHERNET]
    assert candidate_sizes(9000) == [JUMBO, ETHERNET]
    assert candidate_sizes(1500) == [ETHERNET]
    assert candidate_sizes(1500, ipv6=True) == [1500 - 48]
    assert candidate_sizes(1420) == [1420 - 28]  # a WireGuard link
    assert candidate_sizes(1280, ipv6=True) == [1232]  # IPv6's minimum link
    assert candidate_sizes(1228) == []  # nothing above QUIC's minimum
    assert candidate_sizes(None) == []


def test_search_takes_the_first_acknowledged_size_from_the_top() -> None:
    search = DatagramSizeSearch([JUMBO, ETHERNET])
    for _ in range(path_mtu.PROBE_ATTEMPTS):  # a loss may be congestion: a size gets several tries
        assert search.next_probe() == JUMBO
        assert search.next_probe() is None  # one probe at a time
        search.on_probe_result(JUMBO, acknowledged=False)
        assert search.confirmed == BASE_DATAGRAM_BYTES and not search.done
    assert search.next_probe() == ETHERNET
    search.on_probe_result(ETHERNET, acknowledged=True)
    assert (search.confirmed, search.done, search.next_probe()) == (ETHERNET, True, None)


def test_an_acknowledged_top_size_ends_the_search() -> None:
    search = DatagramSizeSearch([JUMBO, ETHERNET])
    search.on_probe_result(search.next_probe(), acknowledged=True)
    assert (search.confirmed, search.done) == (JUMBO, True)


def test_a_black_hole_goes_back_to_the_base_size_and_searches_again() -> None:
    search = DatagramSizeSearch([JUMBO])
    search.on_probe_result(search.next_probe(), acknowledged=True)
    search.on_black_hole([ETHERNET])
    assert (search.confirmed, search.done) == (BASE_DATAGRAM_BYTES, False)
    stale = JUMBO
    assert search.next_probe() == ETHERNET
    search.on_probe_result(stale, acknowledged=True)  # a probe from before the black hole: ignored
    assert search.confirmed == BASE_DATAGRAM_BYTES
    search.on_probe_result(ETHERNET, acknowledged=True)
    assert search.confirmed == ETHERNET
