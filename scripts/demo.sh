#!/usr/bin/env bash
# Set up, start one serving node on :8080 with the default model, ask it a
# question through the OpenAI-compatible API, print the answer, and stop.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
PORT=${PORT:-8080}
HOME_DIR=${MESH_HOME:-$HOME/.local/share/mesh-inference}
.venv/bin/mesh-inference --serve "$PORT" --home "$HOME_DIR" &
node=$!
trap 'kill -TERM $node 2>/dev/null; wait $node 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -fs "http://localhost:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $node 2>/dev/null || { echo "the node exited; see above" >&2; exit 1; }
  sleep 0.5
done
echo "Asking SmolLM2 through http://localhost:$PORT/v1/chat/completions ..."
curl -fsS "http://localhost:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"Name three fruits that are red."}],"max_tokens":64,"temperature":0}' \
  | .venv/bin/python -c 'import json,sys; print("Answer:", json.load(sys.stdin)["choices"][0]["message"]["content"].strip())'
