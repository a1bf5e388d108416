#!/usr/bin/env bash
# The test command: sets up ./.venv if needed, then runs the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
# One intra-op thread per process: the multi-rank tests run 2 gloo ranks on 2 cores.
export OMP_NUM_THREADS=1
exec "${PROACTIVE_VENV:-$ROOT/.venv}/bin/python" -m pytest -q "$@"
