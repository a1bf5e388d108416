"""`torchrec-proactive bench --quick`: schema and internal consistency of its report."""

from __future__ import annotations

import json

import pytest

from torchrec_proactive.bench.report import REQUIRED_KEYS
from torchrec_proactive.bench.runner import main

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["--quick", "--json", str(out / "bench.json"), "--timeline", str(out / "timeline")]) == 0
    return json.loads((out / "bench.json").read_text()), out


def test_report_has_the_documented_keys(quick_report):
    report, _ = quick_report
    for key in REQUIRED_KEYS:
        assert key in report, key
    assert report["link"]["kind"] == "emulated"
    assert report["link"]["bandwidth_gbps"] > 0 and report["link"]["latency_us"] >= 0
    names = {c["name"] for c in report["configs"]}
    assert {"resident", "reactive", "depth_1", "depth_2", "depth_4"} <= names


def test_ratios_are_quotients_of_reported_rates(quick_report):
    report, _ = quick_report
    by_name = {c["name"]: c for c in report["configs"]}
    best = by_name[f"depth_{report['best_depth']}"]
    assert report["proactive_samples_per_s"] == pytest.approx(best["samples_per_s"])
    assert report["speedup_vs_reactive"] == pytest.approx(report["proactive_samples_per_s"] / report["reactive_samples_per_s"])
    assert report["fraction_of_resident"] == pytest.approx(report["proactive_samples_per_s"] / report["resident_samples_per_s"])
    assert report["stall_ms_reactive"] == pytest.approx(by_name["reactive"]["stall_ms_per_step"])
    for c in report["configs"]:
        if "error" not in c:
            assert c["samples_per_s"] == pytest.approx(2 * 256 / (c["step_ms_median"] / 1e3))
            assert c["step_ms_p90"] >= c["step_ms_median"]


def test_prefetching_takes_the_copies_off_the_critical_path(quick_report):
    # Counted rows, not times: reactive copies every missed row while its lookup waits; a
    # prefetch copies none there while the 5% cache has room for the batches in flight (at
    # depth 4 some prefetches wait for pins, and are still planned before their lookup).
    report, _ = quick_report
    by_name = {c["name"]: c for c in report["configs"]}
    reactive = by_name["reactive"]
    assert reactive["rows_fetched_per_step"] > 0
    assert reactive["rows_fetched_at_lookup_per_step"] == reactive["rows_fetched_per_step"]
    for k in (1, 2):
        assert by_name[f"depth_{k}"]["deferred_batches_per_step"] == 0
        # the counted effective depth (what the scaling model reads): every batch k lookups ahead
        assert by_name[f"depth_{k}"]["mean_prefetch_lead"] == k
    assert reactive["mean_prefetch_lead"] == 0 and by_name["resident"].get("mean_prefetch_lead") is None
    assert 0 < by_name["depth_4"]["mean_prefetch_lead"] <= 4
    for k in (1, 2, 4):
        c = by_name[f"depth_{k}"]
        assert c["overflow_rows_per_step"] == 0
        assert c["rows_fetched_at_lookup_per_step"] == 0
        assert c["rows_fetched_per_step"] > 0
        # same data, same cache: the same rows are asked for whatever the depth, and about as
        # many cross the link (deeper prefetch pins more slots, so eviction choices can differ)
        assert c["rows_requested_per_step"] == reactive["rows_requested_per_step"]
        assert c["rows_fetched_per_step"] == pytest.approx(reactive["rows_fetched_per_step"], rel=0.05)
        assert c["hit_rate"] == pytest.approx(1 - c["rows_fetched_per_step"] / c["rows_requested_per_step"])
    assert by_name["resident"].get("rows_fetched_at_lookup_per_step", 0) == 0
    # A 1% cache holds less than one batch: rows overflow to the host tier and every fetch
    # waits for its lookup, so the deepest depth copies as reactive does.
    small, small_reactive = by_name["cache1"], by_name["cache1_reactive"]
    assert small["overflow_rows_per_step"] > 0 and small["deferred_batches_per_step"] > 0
    assert small["rows_fetched_at_lookup_per_step"] == small["rows_fetched_per_step"]
    assert small_reactive["rows_fetched_at_lookup_per_step"] == small_reactive["rows_fetched_per_step"]
    assert small["mean_prefetch_lead"] == 0  # (nothing was fetched ahead)


def test_timeline_files_written(quick_report):
    report, out = quick_report
    png = out / "timeline" / "timeline.png"
    trace = json.loads((out / "timeline" / "timeline.trace.json").read_text())
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert any("fetch" in lane for lane in lanes) and any("compute" in lane for lane in lanes)


def test_auto_runs_the_depth_the_trainer_rule_picks(quick_report):
    report, _ = quick_report
    by_name = {c["name"]: c for c in report["configs"]}
    if "auto" in by_name:
        assert by_name["auto"]["chosen_depth"] in (1, 2, 4)
        assert report["auto_depth"] == by_name["auto"]["chosen_depth"]


def test_planning_cost_is_reported_as_wall_and_cpu_time(quick_report):
    # Presence and units only: a test asserts no measured time.
    report, _ = quick_report
    by_name = {c["name"]: c for c in report["configs"]}
    assert by_name["resident"].get("plan_ms_per_step", 0.0) == 0.0  # stock TorchRec plans nothing
    for k in (1, 2):
        c = by_name[f"depth_{k}"]
        assert isinstance(c["plan_ms_per_step"], float) and isinstance(c["plan_cpu_ms_per_step"], float)
        assert c["plan_ms_per_step"] >= 0 and c["plan_cpu_ms_per_step"] >= 0


def test_per_rank_bytes_per_step_are_counted_for_the_straggler_model(quick_report):
    # The bytes each rank moved in each measured step of the first round: what a synchronous
    # step waits for is the rank that moved the most. Counters: their sum over ranks and steps
    # is the configuration's bytes per step times its steps (every round moves the same rows).
    report, _ = quick_report
    for c in report["configs"]:
        if "error" in c or c.get("prefetch_depth") is None:
            continue
        per_rank = c["bytes_moved_by_rank_step"]
        steps = c["steps_measured"] // c["rounds"]
        assert len(per_rank) == report["world_size"] and all(len(r) == steps for r in per_rank), c["name"]
        assert sum(map(sum, per_rank)) / steps == pytest.approx(c["bytes_moved_per_step"]), c["name"]


def test_skewed_tables_differ_in_zipf_exponent():
    from torchrec_proactive.bench.workload import Workload

    assert Workload(num_tables=4).alphas() == [1.05] * 4
    skewed = Workload(num_tables=3, zipf_alpha=1.0, skew=0.5).alphas()
    assert skewed == pytest.approx([1.5, 1.0, 0.5])
    with pytest.raises(ValueError, match="skew"):
        Workload(skew=1.0)


def test_sequence_workload_adds_a_history_looked_up_per_id():
    """``--model sequence``: the DLRM's pooled features plus a history of ``history_length``
    ids per sample, looked up per id (an EmbeddingCollection) by the bench's model."""
    import torch

    from torchrec_proactive.bench.workload import HISTORY_FEATURE, Workload, bench_model

    w = Workload(num_tables=2, rows_per_table=500, embedding_dim=8, batch_size=16, model="sequence",
                 history_length=5, history_rows=300)
    assert w.ids_per_step() == 16 * (2 + 5)
    (batch,) = w.batches(1, rank=0)
    kjt = batch.sparse_features
    assert kjt.keys() == ["cat_0", "cat_1", HISTORY_FEATURE]
    assert kjt.length_per_key() == [16, 16, 80]
    history = kjt[HISTORY_FEATURE].values()
    assert int(history.min()) >= 0 and int(history.max()) < 300
    model = bench_model(w)
    assert [c.name for c in model.ec.embedding_configs()] == ["t_history"]
    loss, logits = model(batch)
    loss.backward()
    assert logits.shape == (16,) and model.ec.embeddings["t_history"].weight.grad is not None
    assert Workload().ids_per_step() == 512 * 8  # (the DLRM: one id per feature)
    with pytest.raises(ValueError, match="model must be one of"):
        Workload(model="hstu")
