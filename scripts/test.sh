#!/usr/bin/env bash
# Set up everything the tests need, then run them. Extra arguments go to pytest,
# e.g. `./scripts/test.sh -m "not slow"` for the fast run. Skip reasons are always
# printed (-rs; a later -r of yours replaces it).
#
# TEST_PYTHON=python3.13 ./scripts/test.sh ...: run them under another interpreter, in a
# venv of its own (.venv-3.13, created or updated here); .venv, which the bootstrap makes
# and the demo uses, stays as it is. TEST_LABEL names the run in the header line
# (default "tests"), e.g. "== fast tests on Python 3.13.0 (.venv-3.13) ==".
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

venv=.venv
if [ -n "${TEST_PYTHON:-}" ]; then
  if ! minor=$("$TEST_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
    echo "TEST_PYTHON=$TEST_PYTHON does not run" >&2
    exit 1
  fi
  venv=.venv-$minor
  if [ ! -x "$venv/bin/python" ]; then
    echo "Creating $venv with $TEST_PYTHON"
    # Debian/Ubuntu ship venv apart: python3.X-venv.
    "$TEST_PYTHON" -m venv "$venv" || { rm -rf "$venv"; echo "$TEST_PYTHON -m venv failed" \
      "(on Debian/Ubuntu: apt-get install python$minor-venv)" >&2; exit 1; }
  fi
  # pip install -e '.[test]' when pyproject.toml or the venv's Python changed since the last
  # install (as the bootstrap does for .venv); pip's output only when it fails.
  stamp=$venv/.mesh-inference-installed
  want=$({ cat pyproject.toml; "$venv/bin/python" -V; } 2>&1 | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "Installing mesh-inference and its dependencies into $venv (pip)"
    log=$(mktemp)
    if ! { "$venv/bin/python" -m pip install -q --upgrade pip \
           && "$venv/bin/python" -m pip install -q -e '.[test]'; } >"$log" 2>&1; then
      cat "$log" >&2; rm -f "$log"
      echo "error: pip install into $venv failed (output above)" >&2
      exit 1
    fi
    rm -f "$log"
    echo "$want" >"$stamp"
  fi
fi
version=$("$venv/bin/python" -c 'import platform; print(platform.python_version())')
echo "== ${TEST_LABEL:-tests} on Python $version ($venv) =="
exec "$venv/bin/python" -m pytest -rs "$@"
