"""The native data relay's sources (README.md here): built by net/data_relay_build.py, run by net/data_relay.py."""
