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
    # The keys, with what a CPU dry run can establish: exactness across depths on one
    # cache (a roomy one and one that defers and overflows), and no host read of device data.
    for key in ("bit_identical_across_depths", "host_syncs_per_step", "gpu_stall_ms_per_step",
                "fetch_fraction_of_pinned_copy", "compute_slowdown_while_fetching", "plan_ms_per_step_by_ids"):
        assert key in res, key
    assert res["bit_identical_across_depths"] is True
    assert sorted(res["gpu_stall_ms_per_step"]) == ["0", "1", "2", "4", "8"]
    assert sum(res["exactness"]["tiny"]["overflow_rows"].values()) > 0
    assert res["host_syncs_per_step"] == 0 and "sync_detector" in res["syncs"]["how"]
    assert sorted(res["plan_ms_per_step_by_ids"]) == ["25000", "250000"]
    # Counters a CPU can fill (fake CUDA tensors), and the GPU-only one left null.
    for key in ("host_steps_ahead_of_gpu", "plan_launches_per_group_step", "update_launches_per_group_step",
                "plan_ops_identical_across_cache_sizes", "per_table_bounds_ok"):
        assert key in res, key
    assert res["host_steps_ahead_of_gpu"] is None
    assert res["plan_ops_identical_across_cache_sizes"] is True
    assert isinstance(res["plan_launches_per_group_step"], int) and res["plan_launches_per_group_step"] > 0
    assert 0 < res["update_launches_per_group_step"] <= 30  # (tests/test_device_cost.py's bound)
    assert res["per_table_bounds_ok"] is True and res["bounds"]["bad_ids_counted"] == 1
    assert res["plan_costs"]["per_phase"]["plan"]["bytes"] > 0
    # Without a GPU there is no host-to-device copy: no bandwidth figure, in the table or the JSON.
    assert res["fetch_fraction_of_pinned_copy"] is None
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert "needs a GPU" in rows["fetch / plain pinned copy"]
    assert "needs a GPU" in rows["host steps ahead of a 200 ms GPU sleep (depth 2)"]
    assert f"wrote {out}" in proc.stderr
    # Issue 44's keys: the update counted at the issue's size (sizes landed), timed, and
    # planning timed with batches in flight; the TorchRec path's host bytes; the plan-graph
    # cache's memory; the row moves' largest grid.
    assert res["update_ids"] == 2_000_000 and res["dim"] == 128
    assert 0 < res["update_bytes_per_group_step"] <= 4e9
    assert res["plan_costs"]["update_bytes_per_group_step_sizes_unknown"] > res["update_bytes_per_group_step"]
    assert sorted(res["update_ms_per_step_by_ids"]) == ["25000"] and res["update_ms_per_step_by_ids"]["25000"] > 0
    assert sorted(res["plan_ms_per_step_by_ids_in_flight"]) == ["25000"]
    assert res["host_tier_bytes_ratio"] is not None and res["host_tier_bytes_ratio"] <= 1.05
    assert isinstance(res["plan_graph_cache_bytes"], int) and res["plan_graph_cache_bytes"] > 0
    assert isinstance(res["move_grid_blocks_max"], int) and res["move_grid_blocks_max"] > 0
    assert res["interference"]["fetches_issued_in_timed_region"] == res["interference"]["tickets"] == 6
    assert "host_syncs_per_step" in res["syncs"]
    # The disk tier through the device's transport: bit-identical to host memory at every
    # depth, with rows overflowing the device cache and read from the file.
    disk = res["disk_tier"]
    assert res["disk_bit_identical"] is True and sorted(disk["by_depth"]) == ["0/0", "1/1", "2/4"]
    assert all(d["bit_identical"] and d["overflow_rows"] > 0 and d["row_misses"] > disk["host_cache_rows"]
               for d in disk["by_depth"].values())


def test_gpu_check_asked_for_cuda_without_one():
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cuda", "--quick"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "argument --device: 'cuda' needs a CUDA device" in proc.stderr, proc.stderr
