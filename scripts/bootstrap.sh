#!/usr/bin/env bash
# Prepare a fresh machine: system tools, the virtual environment, the pinned
# llama.cpp build (cached outside the repo) and the default model.
#
# Needs Python 3.11 or newer (tested: 3.11 to 3.13): $PYTHON if set, else the first
# of python3.13, python3.12, python3.11, python3 that is one (asked to the interpreter
# itself, so a pyenv shim without that version does not count).
# System tools it checks: cmake, ninja, g++, ip (network namespaces in tests),
# curl (the demo), git (applies the b2b patch) and the Python's venv/ensurepip
# modules (Debian ships them apart, in python3.X-venv). As root on an apt system
# it installs what is missing; otherwise it prints the apt-get line and stops.
# Idempotent: a second run only checks, and prints nothing new when all is there.
set -euo pipefail

MIN_PYTHON=(3 11)  # as requires-python in pyproject.toml
PYTHON_RANGE="${MIN_PYTHON[0]}.${MIN_PYTHON[1]} or newer"

# True when interpreter $1 runs and is a supported Python.
python_ok() {
  "$1" -c "import sys; sys.exit(sys.version_info[:2] < (${MIN_PYTHON[0]}, ${MIN_PYTHON[1]}))" >/dev/null 2>&1
}

# Sets PY to the full path of the first supported interpreter; explains and fails when none is.
find_python() {
  local candidate path
  if [ -n "${PYTHON:-}" ] && ! python_ok "$PYTHON"; then
    echo "warning: PYTHON=$PYTHON is not a working Python $PYTHON_RANGE; looking for another" >&2
  fi
  for candidate in ${PYTHON:+"$PYTHON"} python3.13 python3.12 python3.11 python3; do
    path=$(command -v "$candidate" 2>/dev/null) || continue
    if python_ok "$path"; then
      PY=$path
      return 0
    fi
  done
  {
    echo "error: no Python $PYTHON_RANGE found (tried ${PYTHON:+\$PYTHON=$PYTHON, }python3.13, python3.12, python3.11, python3)."
    echo "Install one (Debian 12: sudo apt-get install -y python3 python3-venv; Ubuntu 24.04 has 3.12),"
    echo "or point PYTHON at one: PYTHON=/path/to/python3.12 $0"
  } >&2
  return 1
}

# The apt packages missing for the build, the tests and the demo; one name per line.
missing_packages() {
  command -v cmake >/dev/null 2>&1 || echo cmake
  command -v ninja >/dev/null 2>&1 || echo ninja-build
  command -v g++ >/dev/null 2>&1 || echo g++
  command -v ip >/dev/null 2>&1 || echo iproute2
  command -v curl >/dev/null 2>&1 || echo curl
  command -v git >/dev/null 2>&1 || echo git
  # OpenSSL's headers: setup builds the native data relay (TLS between members) against them.
  [ -f /usr/include/openssl/ssl.h ] || echo libssl-dev
  if [ "$(id -u)" = 0 ]; then
    # The NAT lab of the tests (root only: network namespaces): home routers and their mappings.
    command -v nft >/dev/null 2>&1 || echo nftables
    command -v conntrack >/dev/null 2>&1 || echo conntrack
  fi
  if ! "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; then
    # Debian and Ubuntu split ensurepip out of the interpreter's package: python3.X-venv
    # (python3-venv is the same for the distribution's default python3).
    "$PY" -c 'import sys; print(f"python3.{sys.version_info[1]}-venv")'
  fi
}

# Installs the packages given (as root with apt-get), or says exactly how and fails.
install_packages() {
  (($#)) || return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Installing $* with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  elif command -v apt-get >/dev/null 2>&1; then
    echo "error: missing system packages: $*" >&2
    echo "Install them, then run this again:  sudo apt-get install -y $*" >&2
    return 1
  else
    echo "error: missing system packages (Debian/Ubuntu names): $*; install them with your package manager" >&2
    return 1
  fi
}

# After installing: what is still missing means apt could not help (e.g. a Python not from apt).
check_after_install() {
  local left
  left=$(missing_packages)
  [ -z "$left" ] && return 0
  if grep -q -- '-venv$' <<<"$left"; then
    echo "error: $PY cannot make a virtual environment (no ensurepip/venv module)." >&2
    if [ "$("$PY" -c 'import sys; print(sys.base_prefix)')" != /usr ]; then
      echo "It is not the system's Python, so apt cannot add them: rebuild it with ensurepip, or choose another with PYTHON=..." >&2
    fi
  fi
  echo "error: still missing: $(tr '\n' ' ' <<<"$left")" >&2
  return 1
}

# A venv ($1) made once with $PY; a half-made one (no pip, e.g. from a failed
# `python3 -m venv` without python3-venv) is made again.
ensure_venv() {
  local venv=$1
  if [ -x "$venv/bin/python" ]; then
    if ! python_ok "$venv/bin/python"; then
      echo "error: $venv holds $("$venv/bin/python" -V 2>&1 || echo 'a broken Python'), not $PYTHON_RANGE; remove it (rm -rf $venv) and run this again" >&2
      return 1
    fi
    "$venv/bin/python" -c "import pip" >/dev/null 2>&1 && return 0
    echo "Re-creating $venv: it has no pip (a previous attempt stopped halfway)"
    "$PY" -m venv --clear "$venv"
  else
    echo "Creating $venv with $PY"
    "$PY" -m venv "$venv"
  fi
}

# pip install -e '.[test]' into a venv ($1), when pyproject.toml (or the venv's
# Python) changed since the last successful install; pip's output is shown only when it fails.
install_project() {
  local venv=$1 want log
  local stamp=$venv/.mesh-inference-installed
  want=$({ cat pyproject.toml; "$venv/bin/python" -V; } 2>&1 | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && [ -x "$venv/bin/mesh-inference" ] \
      && "$venv/bin/python" -c "import mesh_sidecar" >/dev/null 2>&1; then
    return 0
  fi
  echo "Installing mesh-inference and its dependencies into $venv (pip)"
  log=$(mktemp)
  if ! { "$venv/bin/python" -m pip install -q --upgrade pip && "$venv/bin/python" -m pip install -q -e '.[test]'; } \
      >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "error: pip install into $venv failed (output above)" >&2
    return 1
  fi
  rm -f "$log"
  echo "$want" >"$stamp"
}

main() {
  cd "$(dirname "$0")/.."
  local packages
  find_python
  mapfile -t packages < <(missing_packages)
  install_packages ${packages[@]+"${packages[@]}"}
  ((${#packages[@]} == 0)) || check_after_install
  ensure_venv .venv
  install_project .venv
  # Builds llama.cpp once per pin (several minutes on 2 cores), then is instant. The CPU build: the
  # tests and the demo run it (setup's default is the machine's GPU backend, see docs/cli.md).
  .venv/bin/mesh-inference setup --backend cpu
}

# Sourcing the script (`source scripts/bootstrap.sh`) only defines the functions.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
