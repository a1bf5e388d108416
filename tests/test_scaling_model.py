"""The scaling study: step model, hardware profiles, cache replay, validation, projection files.

Nothing here times anything: the validation test checks the *model* against a recorded
measurement (tests/fixtures/scaling_validation.json, from `bench --scaling`), the replay
tests check counted rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from torchrec_proactive.bench.cache_replay import replay, replay_table, zipf_id_stream
from torchrec_proactive.bench.hardware import PROFILES, collective_bandwidth, profile_named
from torchrec_proactive.bench.scaling_study import (
    PAYS_ABOVE,
    StudySettings,
    project,
    validate,
    verdicts,
    write_study,
)
from torchrec_proactive.bench.step_model import DLRMShape, StageCosts, gpu_stage_costs, step_s

MS = 1e-3
FIXTURE = Path(__file__).parent / "fixtures" / "scaling_validation.json"


def _costs(main_ms=20.0, copy_ms=10.0, plan_ms=0.0, out_ms=2.0):
    compute = main_ms - 1 - out_ms  # 1 ms input all-to-all, no all-reduce
    return StageCosts(input_a2a_s=1 * MS, forward_s=compute / 3 * MS, output_a2a_s=out_ms * MS,
                      backward_s=2 * compute / 3 * MS, allreduce_s=0.0, copy_s=copy_ms * MS, plan_s=plan_ms * MS)


# ------------------------------------------------------------------------------------------
# step model


def test_step_model_hand_computed():
    c = _costs(main_ms=20, copy_ms=10)
    assert c.main_s == pytest.approx(20 * MS)
    assert step_s(c, 0) == pytest.approx(30 * MS)  # reactive: the copy on the critical path
    for k in (1, 2, 8):  # a 10 ms copy hides behind a 20 ms step
        assert step_s(c, k) == pytest.approx(20 * MS)
    # a copy longer than the step: the copy engine bounds it; x = (F - k S0) / (k + 1) below that
    slow = _costs(main_ms=6, copy_ms=10)
    assert step_s(slow, 1) == pytest.approx(10 * MS)
    assert step_s(slow, 0) == pytest.approx(16 * MS)
    # planning hides behind the output all-to-all (2 ms) only: 5 ms shows 3 ms at depth k,
    # all of it at depth 0
    planned = _costs(main_ms=20, copy_ms=10, plan_ms=5, out_ms=2)
    assert step_s(planned, 2) == pytest.approx(23 * MS)
    assert step_s(planned, 0) == pytest.approx(35 * MS)
    # the copy of batch N+k is issued after the rest of forward N (L = forward + plan) and
    # must land by the lookup of N+k: main 6 ms (forward 1 ms), copy 10 ms at mean depth 0.5
    assert slow.issue_after_lookup_s == pytest.approx(1 * MS)
    assert step_s(slow, 0.5) == pytest.approx((6 + 10 + 1) / 1.5 * MS)
    # a copy that outlasts the window at depth 1 stalls: (S0 + F + L) / 2 > F
    long = _costs(main_ms=20, copy_ms=25, out_ms=2)  # forward (20 - 3) / 3 ms
    assert step_s(long, 1) == pytest.approx((20 + 25 + 17 / 3) / 2 * MS)
    assert step_s(long, 2) == pytest.approx(25 * MS)  # deeper: only the copy engine bounds it


def test_stage_costs_refuse_bad_values():
    with pytest.raises(ValueError, match="copy_s"):
        StageCosts(0, 0, 0, 0, 0, copy_s=-1.0)
    with pytest.raises(ValueError, match="forward_s"):
        StageCosts(0, float("nan"), 0, 0, 0, 0)
    with pytest.raises(ValueError, match="depth"):
        step_s(_costs(), -1)


# ------------------------------------------------------------------------------------------
# hardware profiles and TorchRec's cost rules


def test_profiles_are_named_systems_with_sources():
    names = [p.name for p in PROFILES]
    assert any(n.startswith("DGX H100") for n in names) and any(n.startswith("DGX H200") for n in names)
    assert any(n.startswith("GH200") for n in names)
    for p in PROFILES:
        assert p.sources and all("datasheet" in s for s in p.sources), p.name
        assert p.assumptions  # what no datasheet gives is said
    h100, gh200 = profile_named("DGX H100"), profile_named("GH200")
    assert (h100.host_link_gbps, h100.network_gbps, h100.gpus_per_node) == (64, 50, 8)  # PCIe Gen5, 400 Gb/s IB
    assert gh200.host_link_gbps == 450  # NVLink-C2C, each way
    with pytest.raises(ValueError, match="hardware profile 'TPU'"):
        profile_named("TPU")


def test_collectives_follow_torchrec_bandwidth_rule():
    h100 = profile_named("DGX H100")
    # inside a node: NVLink; across nodes: the NIC (TorchRec's BasicCommsBandwidths.get_bw)
    assert collective_bandwidth(h100, 8, "all_to_all") == pytest.approx(450e9)
    assert collective_bandwidth(h100, 16, "all_to_all") == pytest.approx(50e9)
    assert collective_bandwidth(h100, 16, "all_reduce") == pytest.approx(50e9 * 8)  # one NIC per GPU


def test_gpu_stage_costs_hand_checked():
    h100 = profile_named("DGX H100")
    shape = DLRMShape()
    ids = 4096 * 26
    c = gpu_stage_costs(h100, shape, 1, fetched_rows_per_id=0.25, written_back_rows_per_id=0.25, plan_s_per_id=1e-8)
    assert c.input_a2a_s == c.output_a2a_s == c.allreduce_s == 0.0  # one GPU: no collectives
    assert c.copy_s == pytest.approx(10e-6 + ids * 0.5 * (128 * 4 + 4) / 64e9)
    assert c.plan_s == pytest.approx(ids * 1e-8)
    assert c.backward_s == pytest.approx(2 * c.forward_s)  # TorchRec's BWD_COMPUTE_MULTIPLIER
    c16 = gpu_stage_costs(h100, shape, 16, 0.0, 0.0, 0.0)
    assert c16.copy_s == 0.0
    assert c16.output_a2a_s == pytest.approx(20e-6 + 15 / 16 * 4096 * 26 * 128 * 4 / 50e9)
    # the dense parameters all-reduced: bottom 13-512-256-128, top (128 + 27*26/2)-1024-1024-512-256-1
    assert shape.dense_param_bytes == 4 * sum(i * o + o for i, o in [(13, 512), (512, 256), (256, 128), (479, 1024),
                                                                      (1024, 1024), (1024, 512), (512, 256), (256, 1)])


# ------------------------------------------------------------------------------------------
# cache replay: counted rows, through the real store


@pytest.fixture(scope="module")
def tables():
    return zipf_id_stream(num_tables=2, rows_per_table=5000, batch_size=128, num_steps=16, alpha=1.05)


def test_replay_counts_reactive_copies_on_the_critical_path(tables):
    reactive = replay("zipf", tables, 0.05, 0, warmup=4)
    ahead = replay("zipf", tables, 0.05, 2, warmup=4)
    assert reactive.fetched_rows_per_id > 0
    assert reactive.fetched_rows_at_lookup_per_id == reactive.fetched_rows_per_id and reactive.mean_lead == 0
    assert ahead.fetched_rows_at_lookup_per_id == 0 and ahead.mean_lead == 2 and ahead.deferred_per_step == 0
    assert ahead.unique_rows_per_id == reactive.unique_rows_per_id  # same batches, same rows asked for
    assert 0 < reactive.hit_rate < 1
    # a cache that holds every row fetches nothing after warm-up, at any depth
    full = replay("zipf", tables, 1.0, 2, warmup=4)
    assert full.fetched_rows_per_id == 0 and full.hit_rate == 1.0


def test_replay_counts_deferred_and_overflow_rows(tables):
    rows_per_batch = min(len(np.unique(s)) for s in tables[0][1])
    # a cache smaller than one batch's rows: overflow, and every prefetch waits to its own step
    tiny = replay_table(tables[0][1], 5000, (rows_per_batch // 2) / 5000, 2, warmup=4)
    assert tiny["overflow"] > 0 and tiny["leads"] == 0 and tiny["deferred"] == tiny["steps"]
    assert tiny["fetched_at_lookup"] == tiny["fetched"]
    with pytest.raises(ValueError, match="cache_fraction"):
        replay_table(tables[0][1], 5000, 0.0, 1)
    with pytest.raises(ValueError, match="warmup"):
        replay_table(tables[0][1], 5000, 0.1, 1, warmup=16)


# ------------------------------------------------------------------------------------------
# validation on recorded runs, projection, files


def test_model_reproduces_the_recorded_cpu_runs_within_10_percent():
    runs = json.loads(FIXTURE.read_text())["validation_runs"]
    assert sorted(r["world_size"] for r in runs) == [1, 2]
    checks = validate(runs)
    assert {c["ranks"] for c in checks} == {1, 2}
    assert {c["depth"] for c in checks} >= {0, 1, 2}
    for c in checks:
        assert c["error"] == pytest.approx(c["modelled_step_ms"] / c["measured_step_ms"] - 1)
        assert abs(c["error"]) <= 0.10, c


def _small_study(tmp_path):
    settings = StudySettings(world_sizes=(1, 8, 64), cache_fractions=(0.05, 1.0), depths=(0, 1, 2),
                             shape=DLRMShape(batch_per_gpu=256), zipf_tables=2, zipf_rows=5000, criteo_tables=2,
                             criteo_batch=128, replay_steps=8, replay_warmup=2)
    runs = json.loads(FIXTURE.read_text())["validation_runs"]
    return settings, write_study(tmp_path / "study", runs, settings)


def test_projection_json_and_plot(tmp_path):
    settings, doc = _small_study(tmp_path)
    saved = json.loads((tmp_path / "study" / "projection.json").read_text())
    assert saved["validation"] and all(set(v) >= {"ranks", "measured_step_ms", "modelled_step_ms"}
                                       for v in saved["validation"])
    assert [p["name"] for p in saved["profiles"]] == [p.name for p in PROFILES]
    assert all("host_link_gbps" in p and p["sources"] for p in saved["profiles"])
    png = tmp_path / "study" / "projection.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and str(png) in doc["files"]
    rows = saved["projection"]
    assert len(rows) == len(PROFILES) * 2 * 3 * 2 * 3  # profiles x planning x scales x caches x depths
    for r in rows:  # every speed-up is the quotient of the two step times it compares
        reactive = next(x for x in rows if x["depth"] == 0 and all(
            x[k] == r[k] for k in ("profile", "planning", "world_size", "cache_fraction")))
        assert r["speedup_vs_reactive"] == pytest.approx(reactive["step_ms"] / r["step_ms"])
    # a cache that holds every row copies nothing: nothing to hide, proactive = reactive
    assert all(r["speedup_vs_reactive"] == pytest.approx(1.0) for r in rows
               if r["cache_fraction"] == 1.0 and r["planning"] == "device")
    for v in saved["verdicts"]:
        assert v["why"] and "paper" in v["vs_paper"]
        assert all(v["speedup_by_scale"][str(w)] > PAYS_ABOVE for w in v["pays_at"])


def test_verdicts_name_where_it_stops_paying_and_why():
    def row(world, depth, step, copy=1.0, lead=1.0):
        return {"profile": "p", "planning": "device", "cache_fraction": 0.05, "world_size": world, "depth": depth,
                "step_ms": step, "effective_depth": lead if depth else 0.0,
                "speedup_vs_reactive": None if depth == 0 else 10.0 / step,
                "stages_ms": {"input_a2a_s": 0.0, "forward_s": 5.0, "output_a2a_s": 1.0, "backward_s": 3.0,
                              "allreduce_s": 0.0, "copy_s": copy, "plan_s": 0.0}}

    rows = [row(1, 0, 10.0), row(1, 1, 8.0), row(8, 0, 10.0), row(8, 1, 9.9, copy=0.1)]
    (v,) = verdicts(rows)
    assert v["pays_at"] == [1] and v["stops_paying_at"] == 8
    assert "under 5%" in v["why"]
    assert v["speedup_by_scale"] == {1: pytest.approx(1.25), 8: pytest.approx(10 / 9.9)}
