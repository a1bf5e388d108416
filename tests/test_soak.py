"""Short soak (the long one is `python benchmarks/soak.py --steps 5000`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_soak_flat_memory_no_leaks_and_exact(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--steps", "400", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in json.loads(out.read_text()):
        assert r["steps"] == 400 and r["rows_fetched"] > 10 * r["steps"], "the soak must actually miss"
        assert r["pins_at_drain"] == 0 and r["engine_in_flight"] == 0 and r["unfinished"] == 0
        assert r["records"] == 0 and r["pipeline_batches"] == 0
        assert r["rss_growth_mb"] < 32, r
        assert r["bitwise_equal_to_resident"]
        assert r["max_diff_vs_stock"] < 1e-4
