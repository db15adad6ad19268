"""The native relay's control lines (wire/data_relay.py): what the sidecar says, what it accepts back."""

from __future__ import annotations

import pytest

from mesh_sidecar.errors import MalformedMessageError
from mesh_sidecar.wire import data_relay as reports

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
