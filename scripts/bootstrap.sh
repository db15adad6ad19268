#!/usr/bin/env bash
# Prepare a fresh machine: system tools, the virtual environment, the pinned
# llama.cpp build (cached outside the repo) and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
command -v ip >/dev/null || need_apt+=(iproute2)
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "Installing ${need_apt[*]} with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "Please install: ${need_apt[*]} (e.g. sudo apt-get install ${need_apt[*]})" >&2
    exit 1
  fi
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
# Builds llama.cpp once per pin (several minutes on 2 cores), then is instant.
.venv/bin/mesh-inference setup
