"""mesh-data-relay's C sources (README.md here): built by ../build.py, run by ../process.py."""
