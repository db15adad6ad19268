#!/usr/bin/env bash
# Set up everything the tests need, then run them. Extra arguments go to pytest,
# e.g. `./scripts/test.sh -m "not slow"` for the fast run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
# The dashboard's browser test drives Debian's Chromium through Playwright (no browser download);
# without /usr/bin/chromium that one test is skipped.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "Installing chromium with apt-get (for the dashboard's browser test)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "Install chromium (e.g. sudo apt-get install chromium) to run the dashboard's browser test;" \
         "it is skipped meanwhile." >&2
  fi
fi
exec .venv/bin/python -m pytest "$@"
