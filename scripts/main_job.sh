#!/usr/bin/env bash
# The main job: sets up ./.venv if needed, generates a small Criteo-format dataset and trains
# DLRM on 2 local gloo ranks, reactive (prefetch_depth=0) and proactive (prefetch_depth=2) on
# the same data and cache, in 14 interleaved rounds (experiment=compare_cpu), then prints the
# comparison: the speed-up with its 95% interval and verdict (`1.23x [1.10-1.37], beyond noise`),
# where each run's step time went per phase, and where the run's files went (compare.json).
# About 1.5 minutes on 2 cores once ./.venv exists. Extra arguments go to `compare`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
exec "${PROACTIVE_VENV:-$ROOT/.venv}/bin/torchrec-proactive" compare "$@"
