"""wire/http1.py: a forwarded request as HTTP/1.0 bytes, and the head of the answer a server writes."""

import pytest

from mesh_sidecar.errors import FrameTooLargeError, MalformedMessageError
from mesh_sidecar.wire.api_forward import ForwardedRequest, ForwardedResponseHead
from mesh_sidecar.wire.http1 import MAX_RESPONSE_HEAD_BYTES, ResponseHeadReader, http1_request


def test_a_request_as_http_1_0_with_its_length_and_extra_headers_last():
    request = ForwardedRequest("POST", "/v1/completions?x=1", (("X-Two", "a"), ("X-Two", "b")), b'{"a": 1}')
    assert http1_request(request, (("Mesh-Forwarded", "t"),)) == (
        b"POST /v1/completions?x=1 HTTP/1.0\r\nHost: mesh\r\nContent-Length: 8\r\n"
        b"X-Two: a\r\nX-Two: b\r\nMesh-Forwarded: t\r\n\r\n" + b'{"a": 1}')


def test_hop_by_hop_headers_are_never_written_again():
    request = ForwardedRequest("GET", "/", (("Host", "evil"), ("Content-Length", "99"), ("Connection", "x")), b"")
    assert http1_request(request) == b"GET / HTTP/1.0\r\nHost: mesh\r\nContent-Length: 0\r\n\r\n"


ANSWER = (b"HTTP/1.0 201 Created\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
          b"X-Odd:  spaced \t\r\n\r\ndata: 0\n\n")


@pytest.mark.parametrize("cut", range(1, len(ANSWER)))
def test_an_answer_head_however_it_is_split(cut):
    reader = ResponseHeadReader()
    first = reader.feed(ANSWER[:cut])
    got = first if first is not None else reader.feed(ANSWER[cut:])
    assert got is not None
    head, body = got
    assert head == ForwardedResponseHead(201, (("Content-Type", "text/event-stream"), ("X-Odd", "spaced")))
    # The body bytes fed with the head's end come with it; the rest would follow as is.
    body_starts = ANSWER.index(b"\r\n\r\n") + 4
    assert body == (ANSWER[body_starts:cut] if first is not None else ANSWER[body_starts:])


@pytest.mark.parametrize("head", [b"HTTP/2 200 OK\r\n\r\n", b"HTTP/1.1 OK\r\n\r\n", b"garbage\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", b"HTTP/1.1 200 OK\r\n X: y\r\n\r\n"])
def test_what_is_not_an_http_1_head_is_malformed(head):
    with pytest.raises(MalformedMessageError):
        ResponseHeadReader().feed(head)


def test_a_head_that_never_ends_is_refused_past_its_limit():
    reader = ResponseHeadReader()
    reader.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(FrameTooLargeError):
        reader.feed(b"X: " + b"y" * MAX_RESPONSE_HEAD_BYTES)
