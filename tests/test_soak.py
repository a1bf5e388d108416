"""Short soak (the long one is `python benchmarks/soak.py --steps 5000`), run as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def soak(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV)


@pytest.mark.multiprocess
def test_soak_flat_memory_no_leaks_and_exact(tmp_path):
    out = tmp_path / "soak.json"
    proc = soak("--steps", "400", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in json.loads(out.read_text()):
        assert r["steps"] == 400 and r["rows_fetched"] > 10 * r["steps"], "the soak must actually miss"
        assert r["pins_at_drain"] == 0 and r["engine_in_flight"] == 0 and r["unfinished"] == 0
        assert r["records"] == 0 and r["pipeline_batches"] == 0
        assert r["rss_growth_mb"] < 32, r
        assert r["bitwise_equal_to_resident"]
        assert r["max_diff_vs_stock"] < 1e-4
    # what a person reads: a verdict last, progress on stderr, the file named, no warning spam
    assert proc.stdout.strip().splitlines()[-1].startswith("soak: PASS"), proc.stdout[-1000:]
    assert "soak" in proc.stderr and "%|" in proc.stderr and "%|" not in proc.stdout
    assert f"wrote {out}" in proc.stderr
    assert "FutureWarning" not in proc.stdout + proc.stderr and "is_fx_tracing" not in proc.stdout + proc.stderr


@pytest.mark.multiprocess
def test_soak_that_never_misses_fails_with_a_verdict(tmp_path):
    # With a 100% cache no row ever crosses the link: the soak tested nothing, so it must say FAIL.
    proc = soak("--steps", "20", "--cache-load-factor", "1.0")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("soak: FAIL") and "rows_fetched_after_warmup 0 <" in last, last
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--steps", "0"], "argument --steps: invalid value '0': expected an integer >= 1"),
    (["--cache-load-factor", "0"], "argument --cache-load-factor: invalid value '0': expected a number in (0, 1]"),
    (["--depth", "x"], "argument --depth: invalid value 'x': expected an integer >= 0"),
])
def test_soak_usage_errors(args, fragment):
    proc = soak(*args, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert fragment in proc.stderr, proc.stderr
