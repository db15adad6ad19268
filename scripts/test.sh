#!/usr/bin/env bash
# Set up everything the tests need, then run them. Extra arguments go to pytest,
# e.g. `./scripts/test.sh -m "not slow"` for the fast run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
