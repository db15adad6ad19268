#!/usr/bin/env bash
# Builds llama.cpp's web UI from the pinned llama.cpp source into mesh_sidecar/serve/chat/ui/ (each file gzipped),
# the chat page the API serves at /chat/<model>/ (serve/chat_page.py). Our llama-server build leaves the UI out
# (-DLLAMA_BUILD_UI=OFF: it takes npm); run this, with node and npm, after moving the pin, and commit the result.
# Usage: scripts/build_chat_ui.sh [SDIST]   (default: the sdist `mesh-inference setup` cached)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
pin="$(python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); from mesh_sidecar.llama.build import LLAMA_CPP_PYTHON_PIN as p; print(p)' "$here")"
sdist="${1:-$HOME/.cache/mesh-inference/sources/llama_cpp_python-$pin.tar.gz}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" -C "$work" "llama_cpp_python-$pin/vendor/llama.cpp/tools/ui"
cd "$work/llama_cpp_python-$pin/vendor/llama.cpp/tools/ui"
PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund
LLAMA_UI_OUT_DIR="$work/out" npm run build
out="$here/mesh_sidecar/serve/chat/ui"
rm -rf "$out" && mkdir -p "$out"
# The page, its bundle and icons; not its service worker (it would cache API answers in the browser) nor the
# splash screens of an installed app.
(cd "$work/out" && find . -type f ! -name 'sw.js' ! -name 'workbox-*.js' ! -name 'apple-splash-*' \
   ! -path './recommended-mcp/*' -printf '%P\n') | while read -r name; do
  mkdir -p "$out/$(dirname "$name")"
  gzip -9 -n -c "$work/out/$name" > "$out/$name.gz"
done
ls -l "$out"
