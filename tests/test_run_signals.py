"""A run says when prefetching fell back to reactive fetching (issue 41, item 2).

The signals - rows fetched at their lookup, prefetches that waited for cache room
(deferred batches), rows served from the host tier - were only in ``metrics.jsonl``. They are
in the final summary line, the ``TrainResult`` (and ``<run dir>/result.json``), a WARNING
when more than 5% of a run's rows were fetched at lookup because prefetches waited, and the
sharder says which tables it tiered, with their cache sizes, at WARNING level. Counters
only, never times.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from tests.test_cli import cli


@pytest.mark.multiprocess
def test_a_run_that_fell_back_to_reactive_says_so(tmp_path: Path) -> None:
    # one shared cache of 10% of each table's rows (fit_depth off) holds about one batch of
    # ci_tiny's 26 tables, not the 3 that depth 2 pins: every prefetch waits until its lookup
    out = tmp_path / "run"
    run = cli("train", "--nproc", "1", "experiment=ci_tiny", "train.max_steps=10", "train.eval=false",
              "cache.fit_depth=false", "cache.load_factor=0.1", f"data.root={tmp_path / 'data'}",
              f"train.output_dir={out}")
    assert run.rc == 0, run
    result = json.loads((out / "result.json").read_text())
    assert result == run.result()  # the run directory's copy of the result line
    fetched, at_lookup = result["rows_fetched_per_step"], result["rows_fetched_at_lookup_per_step"]
    assert result["deferred_batches"] > 0 and fetched > 0 and at_lookup > 0.05 * fetched, result
    assert result["overflow_rows_per_step"] == 0.0, result

    warned = [line for line in run.err.splitlines() if "prefetching fell back to fetching at lookup" in line]
    assert len(warned) == 1, run  # once
    assert f"{result['deferred_batches']} prefetch(es) waited for cache room" in warned[0]
    for setting in ("cache.load_factor (now 0.1)", "cache.fit_depth=true (now false)", "prefetch.depth (now 2)"):
        assert setting in warned[0], warned[0]
    assert "warning: prefetching fell back" in warned[0]  # (found by grepping for "warning")
    done = next(line for line in run.err.splitlines() if "] done: " in line)
    assert f"{at_lookup:.1f} of them at lookup" in done and f"{result['deferred_batches']} deferred batches" in done
    assert "FELL BACK TO REACTIVE" in done and result["fell_back"] is True, (done, result)

    # the sharder's summary: once, at WARNING (in the run's log), every table with its cache
    tiered = [line for line in run.err.splitlines() if "table(s) are proactive" in line]
    assert len(tiered) == 1 and "26 of 26 table(s)" in tiered[0], run
    shown = {name: int(slots) for name, slots, _ in re.findall(r"(t_cat_\d+) (\d+)/(\d+)", tiered[0])}
    assert shown == result["cache_slots"] and len(shown) == 26, (shown, result["cache_slots"])
    assert "table(s) are proactive" in (out / "rank_0" / "train.log").read_text()


def test_sharder_names_the_tables_it_tiers_with_their_caches_at_warning_level(caplog) -> None:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder
    from torchrec_proactive.planning import build_plan

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"f{i}"])
              for i, rows in enumerate((1000, 40))]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = ProactiveEmbeddingBagCollectionSharder(cache_load_factor=0.25, num_slots={"t1": 64})
    plan = build_plan(ebc, sharder, {"t0": "table_wise", "t1": "table_wise"}, world_size=1, local_size=1)
    with caplog.at_level(logging.WARNING, logger="torchrec_proactive.integration.sharder"):
        assert sharder.announce(plan.plan[""], sharder.options) == 2  # type: ignore[arg-type]
    records = [r for r in caplog.records if "table(s) are proactive" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    # t0: 25% of 1000 rows; t1: num_slots wins, at most its 40 rows (as the kernels size them)
    assert "t0 250/1000, t1 40/40" in records[0].getMessage(), records[0].getMessage()


def test_train_result_carries_the_signals() -> None:
    from dataclasses import fields

    from torchrec_proactive.app.result import TrainResult

    steady = {"samples_per_s": 10.0, "stall_ms_per_step": 1.0, "hit_rate": 0.5, "rows_fetched_per_step": 8.0,
              "rows_fetched_at_lookup_per_step": 8.0, "deferred_batches": 3, "overflow_rows_per_step": 0.5}
    r = TrainResult.from_summary({"steps": 4, "depth": 2, "steady": steady, "cache_slots": {"t": 7}})
    assert (r.rows_fetched_per_step, r.rows_fetched_at_lookup_per_step, r.deferred_batches,
            r.overflow_rows_per_step, r.cache_slots) == (8.0, 8.0, 3, 0.5, {"t": 7})
    names = [f.name for f in fields(TrainResult)]
    assert list(json.loads(r.to_json())) == names
    from torchrec_proactive.app.loop import fell_back

    assert fell_back(steady, 2) and not fell_back(steady, 0)  # (depth 0 is reactive by choice)
    assert not fell_back({**steady, "deferred_batches": 0, "overflow_rows_per_step": 0.0}, 2)  # (drains only)
    # a summary saved before these counters existed (a resumed run's checkpoint) gives nulls
    old = TrainResult.from_summary({"steps": 4, "depth": 2, "steady": {"hit_rate": 0.5}})
    assert old.rows_fetched_per_step is None and old.deferred_batches is None and old.cache_slots == {}
