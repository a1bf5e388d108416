#!/usr/bin/env bash
# The main job: sets up ./.venv if needed, generates a small Criteo-format dataset and trains
# DLRM on 2 local gloo ranks, reactive (prefetch_depth=0) and proactive (prefetch_depth=2) on
# the same data and cache, then prints the comparison. Extra arguments go to `compare`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
exec "${PROACTIVE_VENV:-$ROOT/.venv}/bin/torchrec-proactive" compare "$@"
