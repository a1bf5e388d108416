#!/usr/bin/env bash
# Creates ./.venv with the pinned CPU (or CUDA) stack and the project installed editable.
# Idempotent: re-runs the install only when the requirement files or setup.cfg changed.
# Sourced by scripts/main_job.sh and scripts/run_tests.sh; safe to run by hand.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PROACTIVE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  REQ="$ROOT/requirements/cuda.txt"
else
  REQ="$ROOT/requirements/cpu.txt"
fi
STAMP="$VENV/.bootstrap-stamp"
WANT="$(cat "$REQ" "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
echo "[bootstrap] installing into $VENV from $(basename "$REQ") (one-time, ~1-2 min)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q -r "$REQ"
# torchrec declares a dependency on `fbgemm-gpu` (a CUDA build). On a CPU machine that build
# overwrites fbgemm-gpu-cpu and breaks `import fbgemm_gpu`, so torchrec goes in without its
# declared deps; its real runtime deps are listed in the requirement file.
"$VENV/bin/python" -m pip install -q --no-deps torchrec==1.8.0
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
# Fail here, not in the middle of a test run, if the stack does not import.
"$VENV/bin/python" -c "import torch, fbgemm_gpu, torchrec, torchx, hydra, torchrec_proactive" \
  || { echo "[bootstrap] the installed stack does not import" >&2; exit 1; }
echo "$WANT" > "$STAMP"
echo "[bootstrap] done" >&2
