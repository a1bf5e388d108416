"""The prepared GPU script keeps working: its CPU dry run exercises the same code paths."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.py")


def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["exactness"]["ok"] and res["exactness"]["max_weight_diff"] < 1e-4
    assert res["bandwidth"]["engine_gather_host_gbps"] > 0  # the engine's gather path ran
    # Without a GPU there is no host-to-device copy: no H2D figure, in the table or the JSON.
    assert res["bandwidth"]["h2d_measured"] is False
    assert res["bandwidth"]["plain_pinned_copy_gbps"] is None and res["bandwidth"]["engine_gather_h2d_gbps"] is None
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    for name in ("plain pinned H2D copy", "cold-row gather + H2D (engine)"):
        assert "needs a GPU" in rows[name] and "GB/s |" not in rows[name], rows[name]
    assert f"wrote {out}" in proc.stderr


def test_gpu_check_asked_for_cuda_without_one():
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cuda", "--quick"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "argument --device: 'cuda' needs a CUDA device" in proc.stderr, proc.stderr
