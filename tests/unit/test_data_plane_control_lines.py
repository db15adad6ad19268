"""The native relay's control lines (net/data_plane/control_lines.py): what the sidecar says, what it accepts back."""

from __future__ import annotations

import pytest

from mesh_sidecar.errors import MalformedMessageError
from mesh_sidecar.net.data_plane import control_lines as reports

NODE = bytes(range(32))


@pytest.mark.parametrize("line", [
    b"closed 3 ended\rstats 3 1 1 1 1 1 1",
    b"event 3 dialect \xff",
    b"error a\tb",
    b"event 3 rewritten 0 x\x00",
])
def test_a_report_that_is_not_printable_ascii_is_refused(line):
    with pytest.raises(MalformedMessageError):
        reports.parse_report(line)


def test_reports_parse():
    assert reports.parse_report(b"closed 3 ended") == reports.Closed(3, "ended")
    assert reports.parse_report(f"inbound 2147483648 {NODE.hex()}".encode()) == reports.Inbound(2**31, NODE)
    assert reports.parse_report(b"stats 1 2 3 4 5 6 7") == reports.Stats(1, 2, 3, 4, 5, 6, 7)


def test_rejections_parse_by_kind():
    absolute = reports.parse_report(b"rejected 4 absolute_outlier l_out-3 64 1e+07 2e+07 0 0")
    assert (absolute.kind, absolute.rms, absolute.max_abs, absolute.low) == ("absolute_outlier", 1e7, 2e7, 0.0)
    norm = reports.parse_report(b"rejected 4 norm_outlier l_out-3 64 900 5.5 8.4 16")
    assert (norm.low, norm.high, norm.count, norm.max_abs) == (5.5, 8.4, 16, None)
    protocol = reports.parse_report(b"rejected 4 protocol unsolicited-reply 0 0 0 0 0")
    assert (protocol.kind, protocol.name) == ("protocol", "unsolicited-reply")


def test_the_guard_line_carries_the_absolute_limits():
    lines = reports.configuration_lines(b"c", b"k", handshake_timeout_s=5, max_connections=8, max_handshakes=4,
                                        history=64, min_history=8, norm_ratio=64.0)
    assert "guard 64 8 64.0 1000000.0 100000000.0" in lines
