"""The prepared GPU script keeps working: its CPU dry run exercises the same code paths."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["exactness"]["ok"] and res["exactness"]["max_weight_diff"] < 1e-4
    assert res["bandwidth"]["engine_gather_h2d_gbps"] > 0
    assert "| cold-row gather + H2D (engine) |" in proc.stdout
