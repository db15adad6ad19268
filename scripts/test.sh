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
# The lossy-link test (tests/integration/test_link_loss_netns.py) drops packets with nftables.
if ! command -v nft >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "Installing nftables with apt-get (for the lossy-link test)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null \
    || echo "warning: nftables did not install; the lossy-link test is skipped." >&2
fi
# The Vulkan build's test (tests/integration/test_vulkan_build.py) runs on Mesa's llvmpipe, a Vulkan
# device in software. As root with apt-get, install its packages when missing; then build it once per pin
# (about 6 min on 2 cores, cached like the CPU build). Without them, or when it does not build, that test
# is skipped with the reason.
vulkan_packages=(mesa-vulkan-drivers libvulkan-dev glslc spirv-headers)
if command -v dpkg-query >/dev/null; then
  missing=()
  for package in "${vulkan_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
  done
  if ((${#missing[@]})); then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "Installing ${missing[*]} with apt-get (for the Vulkan build's test)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      echo "Install ${missing[*]} (sudo apt-get install ${missing[*]}) to run the Vulkan build's test;" \
           "it is skipped meanwhile." >&2
    fi
  fi
fi
if .venv/bin/python -c 'import sys; from mesh_sidecar.llama.backends import VULKAN, Machine, missing_toolkit
sys.exit(bool(missing_toolkit(VULKAN, Machine.here())))'; then
  # A node runs the build the last setup made: the CPU one again after, which the rest of the suite runs.
  .venv/bin/mesh-inference setup --backend vulkan >/dev/null \
    || echo "warning: the Vulkan build failed (above); its test is skipped." >&2
  .venv/bin/mesh-inference setup --backend cpu >/dev/null
fi

venv=.venv
if [ -n "${TEST_PYTHON:-}" ]; then
  # The bootstrap's own venv and install steps (sourcing it only defines them), for this Python.
  source ./scripts/bootstrap.sh
  if ! PY=$(command -v "$TEST_PYTHON") || ! python_ok "$PY"; then
    echo "TEST_PYTHON=$TEST_PYTHON is not a working Python $PYTHON_RANGE" >&2
    exit 1
  fi
  minor=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  venv=.venv-$minor
  if ! "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; then
    echo "error: $PY cannot make a venv (on Debian/Ubuntu: apt-get install python$minor-venv)" >&2
    exit 1
  fi
  ensure_venv "$venv"
  install_project "$venv"
fi
version=$("$venv/bin/python" -c 'import platform; print(platform.python_version())')
echo "== ${TEST_LABEL:-tests} on Python $version ($venv) =="
exec "$venv/bin/python" -m pytest -rs "$@"
