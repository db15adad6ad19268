#!/usr/bin/env bash
# Rebase mesh_sidecar/llama/patches/llama.cpp-b2b.patch (package data: installed packages
# build --b2b from it) onto a new pristine llama.cpp source tree.
#
# usage: scripts/rebase_b2b_patch.sh NEW_PRISTINE_SRC [PATCHED_COPY_DIR]
#
# 1. Copies the files the patch touches out of NEW_PRISTINE_SRC (the tree is never modified)
#    and applies the patch there with `patch -p1` (fuzz allowed).
# 2. On rejects: prints each .rej hunk and exits 1; the patch file is left as it is.
# 3. Otherwise: regenerates mesh_sidecar/llama/patches/llama.cpp-b2b.patch against the new tree (so offsets and
#    fuzz disappear) and runs the checks below, which need a human when they warn.
# With PATCHED_COPY_DIR, a full patched copy of the tree is also written there (for building:
# the cmake options are CMAKE_OPTIONS in mesh_sidecar/llama/build.py).
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }
if [ $# -lt 1 ] || [ $# -gt 2 ]; then die "usage: $0 NEW_PRISTINE_SRC [PATCHED_COPY_DIR]"; fi
SRC=$(cd "$1" && pwd) || die "no such directory: $1"
REPO=$(cd "$(dirname "$0")/.." && pwd)
PATCH="$REPO/mesh_sidecar/llama/patches/llama.cpp-b2b.patch"
RPC=ggml/src/ggml-rpc/ggml-rpc.cpp
[ -f "$PATCH" ] || die "missing $PATCH"
[ -f "$SRC/$RPC" ] || die "$SRC does not look like a llama.cpp tree (no $RPC)"
command -v patch >/dev/null || die "'patch' is not installed"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/b2b-rebase.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# the files the patch touches, from its "+++ b/<path>" lines
mapfile -t FILES < <(sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$PATCH")
[ ${#FILES[@]} -gt 0 ] || die "no '+++ b/' lines in $PATCH"
for f in "${FILES[@]}"; do
    mkdir -p "$WORK/old/$(dirname "$f")" "$WORK/new/$(dirname "$f")"
    if [ -f "$SRC/$f" ]; then
        cp "$SRC/$f" "$WORK/old/$f"
        cp "$SRC/$f" "$WORK/new/$f"
    fi
done

echo "applying $(basename "$PATCH") to $SRC"
if ! (cd "$WORK/new" && patch -p1 --forward --no-backup-if-mismatch -i "$PATCH"); then
    echo
    echo "REJECTED hunks (resolve them by hand in a copy of the tree, then run this script on"
    echo "the pristine tree again after updating the patch):"
    find "$WORK/new" -name '*.rej' -print0 | while IFS= read -r -d '' rej; do
        echo "---- ${rej#"$WORK/new/"}"
        cat "$rej"
    done
    exit 1
fi

# regenerate: one unified diff per file, a/ and b/ prefixes, so `patch -p1` applies it
NEWPATCH="$WORK/llama.cpp-b2b.patch"
: > "$NEWPATCH"
for f in "${FILES[@]}"; do
    old="$WORK/old/$f"
    [ -f "$old" ] || old=/dev/null
    diff -u --label "a/$f" --label "b/$f" "$old" "$WORK/new/$f" >> "$NEWPATCH" || [ $? -eq 1 ]
done
if cmp -s "$NEWPATCH" "$PATCH"; then
    echo "patch file unchanged"
else
    cp "$NEWPATCH" "$PATCH"
    echo "regenerated $PATCH"
fi

# checks that a clean apply does not prove
status=0
f="$WORK/new/$RPC"
# upstream commands must still end at MEMSET_TENSOR = 17 (the patch static_asserts 18 and 19;
# a new upstream command would move them and break deployed peers and the sidecar's dialects)
last_upstream=$(awk '/^enum rpc_cmd/{on=1;next} on&&/RPC_CMD_REGISTER_PEER/{print prev;exit} on&&/^ *RPC_CMD_/{prev=$1} ' "$f" | tr -d ',')
if [ "$last_upstream" != "RPC_CMD_MEMSET_TENSOR" ]; then
    echo "WARNING: the command before RPC_CMD_REGISTER_PEER is now $last_upstream, not RPC_CMD_MEMSET_TENSOR:"
    echo "         upstream added commands; the b2b numbers (18, 19) would move. Decide on new numbers"
    echo "         and update mesh_sidecar/wire/rpc_framing.py's dialect table with them."
    status=1
fi
# the b2b flag lives in the HELLO reply's padding byte: upstream must not use it
if grep -nE '(\.|->)padding\b' "$SRC/$RPC"; then
    echo "WARNING: upstream now reads or writes the HELLO reply's padding byte (lines above)"
    status=1
fi
grep -q '^#define RPC_PROTO_MAJOR_VERSION    7' "$WORK/new/ggml/include/ggml-rpc.h" || {
    echo "WARNING: RPC protocol major version is no longer 7: review the whole patch"; status=1; }
# every rpc_server method that touches backends or buffers must take rpc_server_mutex
# (upstream may add methods); list those that do not
awk -v file="$RPC" '
    /^(bool|void|ggml_tensor \*) rpc_server::[a-z_]+\(/ || /^rpc_server::~rpc_server/ {
        name=$0; sub(/\(.*/, "", name); sub(/.*rpc_server::/, "", name); want=1; next }
    want && /rpc_server_mutex/ { want=0; next }
    want && /^}/ { if (name !~ /^(hello|deserialize_tensor|create_node|get_cached_file|register_peer|push_tensor_to_peer)$/)
                       print "WARNING: rpc_server::" name " (" file ") does not lock rpc_server_mutex"; want=0 }
' "$f" | tee "$WORK/locks"
[ -s "$WORK/locks" ] && status=1

if [ $# -eq 2 ]; then
    OUTDIR=$2
    [ -e "$OUTDIR" ] && die "$OUTDIR exists; give a new directory"
    cp -a "$SRC" "$OUTDIR"
    (cd "$OUTDIR" && patch -p1 --forward --no-backup-if-mismatch -s -i "$PATCH")
    echo "patched copy: $OUTDIR"
fi
[ $status -eq 0 ] && echo "ok" || echo "applied, but see the warnings above"
exit $status
