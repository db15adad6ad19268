#!/usr/bin/env bash
# Lint: ruff over every Python file of the repository (the package, tests, benchmarks), then
# mypy over the package; both configured in pyproject.toml, both from .venv, so their versions
# are the ones pinned in the test extra. Both always run; the exit status says whether either
# found something.
#
# Only the bootstrap's venv steps run here (sourcing it only defines them): linting needs
# neither the system packages nor the llama.cpp build, and a package that does not import
# is reported by the linters rather than stopping the setup.
set -uo pipefail
cd "$(dirname "$0")/.."
source ./scripts/bootstrap.sh
find_python || exit
if ! "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; then
  echo "error: $PY cannot make a venv; run ./scripts/bootstrap.sh first" >&2
  exit 1
fi
ensure_venv .venv || exit
install_project .venv || exit

status=0
echo "== ruff check =="
.venv/bin/ruff check || status=1
echo "== mypy =="
.venv/bin/mypy || status=1
exit $status
