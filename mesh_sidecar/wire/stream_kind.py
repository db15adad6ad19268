"""The first byte of every stream a peer opens: what the stream is for.

    stream opened by a peer:  kind u8 | what that kind carries ...

    RPC             a tunnel to the receiver's rpc-server (net/tunnel.py)
    MODEL_FILE      a model file request (net/model_transfer.py)
    RELAY_REQUEST   relay my packets to a member you reach (wire/packet_relay.py)
    RELAY_DELIVERY  packets relayed to you from a member (wire/packet_relay.py)
    API_FORWARD     an HTTP request for your API, answered on the stream (wire/api_forward.py)

The control stream (stream 0, wire/frames.py) has no kind byte.
"""

from __future__ import annotations

import enum


class StreamKind(enum.IntEnum):
    """The first byte of every stream a peer opens: what it is for."""

    RPC = 1
    MODEL_FILE = 2
    RELAY_REQUEST = 3
    RELAY_DELIVERY = 4
    API_FORWARD = 5
