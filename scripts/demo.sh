#!/usr/bin/env bash
# Set up, start one serving node with the default model, ask it a question
# through the OpenAI-compatible API, print the answer, and stop.
#
# It leaves nothing behind: the node runs in a throwaway home (mktemp -d; no mesh
# is remembered, so nothing rejoins later), stays off the LAN (--no-mdns), and
# serves on :8080, or on a free port when 8080 is taken ($PORT picks one). The
# node is stopped and its home removed at the end, on failure and on Ctrl-C too.
# What stays is the setup's cache (~/.cache/mesh-inference: the llama.cpp build
# and the model), which later runs reuse.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh

PY=.venv/bin/python
STOP_GRACE_S=30

# True when nothing listens on 127.0.0.1:$1 (a bind test, by the venv's Python).
port_free() {
  "$PY" -c 'import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)' "$1"
}

free_port() {
  "$PY" -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

if [ -n "${PORT:-}" ]; then
  port=$PORT
elif port_free 8080; then
  port=8080
else
  port=$(free_port)
  echo "Port 8080 is taken; the demo uses port $port"
fi

demo_home=$(mktemp -d "${TMPDIR:-/tmp}/mesh-demo.XXXXXX")
node=

# Stop the node (SIGTERM, as Ctrl-C does; SIGKILL after STOP_GRACE_S), wait for it,
# then remove its home. Runs once, on any exit.
cleanup() {
  local status=$? waited=0
  trap '' INT TERM
  if [ -n "$node" ] && kill -0 "$node" 2>/dev/null; then
    kill -TERM "$node" 2>/dev/null || true
    while kill -0 "$node" 2>/dev/null && ((waited < STOP_GRACE_S * 10)); do
      sleep 0.1
      waited=$((waited + 1))
    done
    if kill -0 "$node" 2>/dev/null; then
      echo "The node did not stop within ${STOP_GRACE_S}s; killing it" >&2
      kill -KILL "$node" 2>/dev/null || true
    fi
    wait "$node" 2>/dev/null || true
  fi
  rm -rf "$demo_home"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

.venv/bin/mesh-inference --serve "$port" --home "$demo_home" --no-mdns &
node=$!
ready=
for _ in $(seq 300); do
  curl -fs --max-time 2 "http://localhost:$port/health" >/dev/null 2>&1 && { ready=1; break; }
  kill -0 "$node" 2>/dev/null || { echo "the node exited; see above" >&2; exit 1; }
  sleep 0.5
done
[ -n "$ready" ] || { echo "the node did not answer on http://localhost:$port/health in time" >&2; exit 1; }
echo "Asking SmolLM2 through http://localhost:$port/v1/chat/completions ..."
curl -fsS --max-time 300 "http://localhost:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"Name three fruits that are red."}],"max_tokens":64,"temperature":0}' \
  | "$PY" -c 'import json,sys; print("Answer:", json.load(sys.stdin)["choices"][0]["message"]["content"].strip())'
