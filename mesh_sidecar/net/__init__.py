"""The network edge: QUIC connections to peers, their streams, TCP tunnel ports, LAN discovery.

Imports the pure ``wire`` layer and the foundation; knows nothing of membership or serving.
"""
