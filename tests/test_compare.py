"""``compare`` (the main job) gives a verdict the way the bench does (issue 41, item 4).

Its speed-up comes with an interval, ``1.23x [1.10-1.37]``, and a verdict (beyond noise or
not) from interleaved rounds; where each arm's step time went is reported per measured phase,
from the same steps as the table; the run's files are named. The figures are timed, so the
tests assert formats, counts and the arithmetic that ties them together, never a speed-up.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_cli import cli

INTERVAL = re.compile(r"(\d+\.\d\d)x \[(\d+\.\d\d)-(\d+\.\d\d)\]")


def _round(steps, ms, stall_ms, fwd_ms, bwd_ms, opt_ms, plan_ms=0.5):
    """One arm's round as compare measures it: seconds summed over the round, mean over ranks."""
    return {"steps": steps, "clock_s": steps * ms / 1e3, "stall_s": steps * stall_ms / 1e3,
            "plan_s": steps * plan_ms / 1e3, "forward_s": steps * fwd_ms / 1e3, "backward_s": steps * bwd_ms / 1e3,
            "optimizer_s": steps * opt_ms / 1e3}


def _assembled(rounds: int, tmp_path: Path):
    from torchrec_proactive.app.compare import assemble

    drift = [1.0, 1.1, 0.9, 1.2, 1.05, 0.95, 1.0, 1.15, 0.85, 1.1, 1.0, 0.9][:rounds]
    reactive = [_round(10, 100 * d, 19.0, 60 * d, 25 * d, 1.0) for d in drift]
    proactive = [_round(10, 80 * d * (1.02 if i % 2 else 0.98), 2.0, 45 * d, 26 * d, 1.0) for i, d in enumerate(drift)]
    rows = [{"mode": "reactive", "depth": 0, "steps": 10 * rounds + 5, "rows_fetched_per_step": 100.0,
             "rows_fetched_at_lookup_per_step": 100.0, "hit_rate": 0.6, "mb_moved_per_step": 1.8, "loss": 0.5},
            {"mode": "proactive", "depth": 2, "steps": 10 * rounds + 5, "rows_fetched_per_step": 100.0,
             "rows_fetched_at_lookup_per_step": 9.0, "hit_rate": 0.6, "mb_moved_per_step": 1.8, "loss": 0.5}]
    for name in ("compare.log", "compare.json"):  # what a run leaves in its directory
        (tmp_path / name).write_text("")
    for arm in ("reactive", "proactive"):
        (tmp_path / arm / "rank_0").mkdir(parents=True, exist_ok=True)
    return assemble(rows, {"reactive": reactive, "proactive": proactive}, warmup_steps=5, world_size=2,
                    batch_size=512, link="emulated (0.1 GB/s, 200 us per fetch)", identical_parameters=True,
                    output_dir=str(tmp_path), cache_slots={"reactive": {"t0": 30}, "proactive": {"t0": 30}})


def test_the_speedup_has_an_interval_and_a_verdict(tmp_path):
    from torchrec_proactive.app.compare import format_table

    result = _assembled(12, tmp_path)
    text = format_table(result)
    (line,) = [ln for ln in text.splitlines() if ln.startswith("speed-up")]
    value, lo, hi = map(float, INTERVAL.search(line).groups())
    assert lo <= value <= hi and lo < hi, line
    speed = result["speedup"]
    assert speed["paired_rounds"] == 12 and speed["interval"] is not None
    verdict = "within noise" if speed["within_noise"] else "beyond noise"
    assert verdict in line, line
    # the table's rates are the rounds' (the same steps): its ratio is the one printed
    reactive, proactive = result["rows"]
    assert f"{proactive['samples_per_s'] / reactive['samples_per_s']:.2f}x [" in line
    assert reactive["measured_steps"] == proactive["measured_steps"] == 120
    assert "12 interleaved rounds" in text and "final parameters bit-identical: yes" in text


def test_too_few_rounds_claim_no_interval_and_no_verdict(tmp_path):
    from torchrec_proactive.app.compare import format_table

    text = format_table(_assembled(3, tmp_path))
    (line,) = [ln for ln in text.splitlines() if ln.startswith("speed-up")]
    assert not INTERVAL.search(line) and "noise" not in line.replace("no verdict", ""), line
    assert "3 paired rounds" in line and "at least 6" in line, line


def test_where_the_step_time_went_adds_up(tmp_path):
    from torchrec_proactive.app.compare import format_table

    result = _assembled(12, tmp_path)
    phases = result["phases"]
    for arm in ("reactive", "proactive"):
        p = phases[arm]
        # every phase is measured or the measured step less the measured phases: no invented figures
        assert p["rest_ms"] == pytest.approx(p["step_ms"] - p["forward_ms"] - p["backward_ms"] - p["optimizer_ms"])
        assert p["step_ms"] == pytest.approx(result["rows"][0 if arm == "reactive" else 1]["step_ms"])
    assert phases["reactive"]["stall_ms"] == pytest.approx(19.0) and phases["proactive"]["stall_ms"] == pytest.approx(2.0)
    text = format_table(result)
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("where the step time went"))
    table = "\n".join(lines[head:head + 10])
    for phase in ("step", "forward", "waiting for rows (stall)", "planning", "backward", "optimizer", "rest"):
        assert phase in table, table
    # the step's change, phase by phase: the stall is not the only term
    (why,) = [ln for ln in lines if ln.startswith("step change")]
    d = {k: phases["proactive"][f"{k}_ms"] - phases["reactive"][f"{k}_ms"]
         for k in ("step", "stall", "forward", "backward", "optimizer", "rest")}
    assert f"{d['step']:+.2f}" in why and f"stall {d['stall']:+.2f}" in why
    assert f"forward beyond the stall {d['forward'] - d['stall']:+.2f}" in why, why
    assert f"backward {d['backward']:+.2f}" in why and f"rest {d['rest']:+.2f}" in why, why
    assert "host time" not in text  # (on CPU the timers are the phases' time)
    assert "host time" in format_table({**result, "device": "cuda"})


def test_the_runs_files_are_named(tmp_path):
    from torchrec_proactive.app.compare import format_table

    text = format_table(_assembled(12, tmp_path))
    (files,) = [ln for ln in text.splitlines() if ln.startswith("files:")]
    assert str(tmp_path) in files and "compare.json" in files and "compare.log" in files, files
    assert "reactive/" in files and "proactive/" in files, files


@pytest.mark.multiprocess
def test_compare_run_prints_interval_phases_and_files(ci_tiny_compare) -> None:
    # ci_tiny on 1 rank: 75 steps, 7 steps of warm-up, then 7 rounds of ~10 steps
    run, out = ci_tiny_compare.run, ci_tiny_compare.out
    (line,) = [ln for ln in run.out.splitlines() if ln.startswith("speed-up")]
    assert INTERVAL.search(line) and ("beyond noise" in line or "within noise" in line), run
    assert "final parameters bit-identical: yes" in run.out, run
    assert "where the step time went" in run.out and "step change" in run.out, run
    doc = json.loads((out / "compare.json").read_text())
    assert f"files: {out}" in run.out, run
    # the rounds cover the table's steps exactly, and each arm ran every round
    steps = [r["steps"] for r in doc["rounds"]["reactive"]]
    assert steps == [r["steps"] for r in doc["rounds"]["proactive"]] and len(steps) == doc["speedup"]["paired_rounds"]
    assert sum(steps) == doc["rows"][0]["measured_steps"] == doc["rows"][1]["measured_steps"]
    assert doc["warmup_steps"] + sum(steps) == doc["rows"][0]["steps"]
    # one cache size for both arms (sized for the proactive depth)
    assert doc["cache_slots"]["reactive"] == doc["cache_slots"]["proactive"] and doc["cache_slots"]["reactive"]
    for arm in ("reactive", "proactive"):
        p = doc["phases"][arm]
        assert p["forward_ms"] > 0 and p["backward_ms"] > 0
        assert p["rest_ms"] == pytest.approx(p["step_ms"] - p["forward_ms"] - p["backward_ms"] - p["optimizer_ms"])
    # counters, not times: reactive fetches every row at lookup, proactive only after drains
    reactive, proactive = doc["rows"]
    assert reactive["rows_fetched_at_lookup_per_step"] == reactive["rows_fetched_per_step"] > 0
    assert proactive["rows_fetched_at_lookup_per_step"] < proactive["rows_fetched_per_step"]
