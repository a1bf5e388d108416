"""Issue 42 in the app: ``tier=ssd`` (Hydra group ``tier``: ``dram``, the default, or ``ssd``)
trains the proactive tables from files under ``tier.dir``, and ``compare`` stays exact."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.test_cli import cli, cli_here


def test_an_uncreatable_tier_dir_is_one_line_and_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run = cli_here("train", "--nproc", "1", "experiment=ci_tiny", "tier=ssd", f"tier.dir={blocker / 'tier'}",
                   f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'out'}")
    assert run.rc == 2, run
    lines = [ln for ln in run.err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "tier.dir=" in lines[0] and str(blocker) in lines[0], run
    assert "Traceback" not in run.err, run


def test_tier_ssd_needs_a_proactive_kernel(tmp_path: Path) -> None:
    run = cli_here("train", "--nproc", "1", "experiment=ci_tiny", "tier=ssd", "sharding.kernel=fused", "prefetch=off",
                   f"tier.dir={tmp_path / 't'}", f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'o'}")
    assert run.rc == 2 and "tier.kind" in run.err and "sharding.kernel" in run.err, run


@pytest.mark.multiprocess
def test_compare_on_ssd_is_bit_identical_and_leaves_no_files(tmp_path: Path) -> None:
    tier = tmp_path / "nvme"
    # host caches of 16 KiB per table shard: a few hundred rows of tables up to 1000 rows
    run = cli("compare", "--nproc", "2", "experiment=ci_tiny", "tier=ssd", f"tier.dir={tier}",
              "tier.host_cache_mb=0.016", "tier.disk_depth=4", "train.epochs=1", "train.eval=false",
              f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'cmp'}", timeout=600)
    assert run.rc == 0, run
    assert "final parameters bit-identical: yes" in run.out, run
    assert "on disk" in run.err, run  # the sharder says which tables are on disk
    # and the table says so too (a user trial: stdout never mentioned the tier)
    assert (f"tier: tables on disk (tier=ssd) under {tier}, host cache 0.016 MiB per table shard, disk reads "
            f"queued 4 batch(es) ahead in the proactive arm") in run.out, run.out
    left = [os.path.join(r, f) for r, _, fs in os.walk(tier) for f in fs]
    assert left == [], left


@pytest.mark.multiprocess
def test_a_run_on_ssd_resumes_with_another_host_cache(tmp_path: Path) -> None:
    """Checkpoints of tables on disk stream through the tiers (DCP, a chunk of rows at a
    time); a resume with another host cache size continues exactly where the run stopped."""
    import json

    from concurrent.futures import ThreadPoolExecutor

    def common(run: str) -> list:
        return ["--nproc", "1", "experiment=ci_tiny", "tier=ssd", f"tier.dir={tmp_path / run / 'nvme'}",
                "train.eval=false", f"data.root={tmp_path / run / 'data'}", f"train.output_dir={tmp_path / run / 'out'}"]

    # The uninterrupted run needs nothing of the other: it runs beside it, each on its own core
    # (1 rank each; its own data.root and tier.dir, the same generated data set).
    with ThreadPoolExecutor(1) as beside:
        later = beside.submit(cli, "train", *common("b"), "train.epochs=2", "tier.host_cache_mb=0.016")
        first = cli("train", *common("a"), "train.epochs=1", "tier.host_cache_mb=0.016")
        assert first.rc == 0, first
        resumed = cli("train", *common("a"), "train.epochs=2", "train.resume=true", "tier.host_cache_mb=0.05")
        assert resumed.rc == 0 and "resumed from" in resumed.err, resumed
        straight = later.result()
    assert straight.rc == 0, straight
    a, b = (json.loads((tmp_path / d / "out" / "result.json").read_text()) for d in ("a", "b"))
    assert a["steps"] == b["steps"] and a["train_loss"] == b["train_loss"], (a, b)


@pytest.mark.multiprocess
def test_a_host_cache_below_one_batch_trains_and_says_to_raise_tier_host_cache_mb(tmp_path: Path) -> None:
    """A host cache smaller than one batch's rows: the run trains (each such batch moved
    through the host cache a chunk at a time, exact: tests/test_host_cache_overflow.py), and
    says so once, in config words, and again in the fall-back warning's advice - which names
    the host cache, not the device cache's load factor. It used to stop with exit 2."""
    run = cli("train", "--nproc", "1", "experiment=ci_tiny", "tier=ssd", f"tier.dir={tmp_path / 'nvme'}",
              "tier.host_cache_mb=0.0005", "train.eval=false", "train.max_steps=4",
              f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'o'}")
    assert run.rc == 0, run
    lines = run.err.splitlines()
    # The size to set is per table shard (the store's figure is its group's, 26 tables here;
    # a user trial set the group's figure on every table).
    (chunked,) = [ln for ln in lines if "moved through the host cache a chunk at a time" in ln]
    group_bytes = int(re.search(r"give the host cache at least \d+ rows \((\d+) bytes\)", chunked).group(1))
    each = f"{group_bytes / 26 / 2**20:.3g}"
    assert chunked.endswith(f"raise tier.host_cache_mb (now 0.0005) to at least {each} per table shard, "
                            f"26 tables in this group (leave headroom: batches vary)"), chunked
    (deferred,) = [ln for ln in lines if "waits for cache room" in ln]
    assert "Nothing changed" not in deferred and "raise tier.host_cache_mb (now 0.0005) to at least" in deferred
    assert "move through the host cache a chunk at a time" in deferred, deferred
    # The fall-back advice names the host cache, and no lower depth: one batch alone outgrew it.
    (fell,) = [ln for ln in lines if "fell back to fetching at lookup" in ln]
    assert "raise tier.host_cache_mb (now 0.0005): " in fell and "alone outgrew a host cache" in fell, fell
    assert "cache.load_factor" not in fell and "prefetch.depth" not in fell and "Traceback" not in run.err, run
    assert "batches through a host cache too small for them" in run.err


def test_tier_disk_depth_needs_tier_ssd(tmp_path: Path) -> None:
    run = cli_here("train", "--nproc", "1", "experiment=ci_tiny", "tier.disk_depth=4",
                   f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'o'}")
    assert run.rc == 2 and "tier.disk_depth" in run.err and "tier=ssd" in run.err, run


@pytest.mark.multiprocess
def test_host_caches_planned_from_the_data_train_exactly(tmp_path: Path) -> None:
    """``tier.host_budget_mb``: each rank's tables on disk share the budget, split by their
    miss-ratio curves at the disk depth (logged per rank); the run stays bit-identical to
    depth 0, and each planned size is what the store was given."""
    run = cli("compare", "--nproc", "2", "experiment=ci_tiny", "tier=ssd", f"tier.dir={tmp_path / 'nvme'}",
              "tier.host_budget_mb=0.2", "tier.disk_depth=2", "train.epochs=1", "train.eval=false",
              f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'cmp'}", timeout=600)
    assert run.rc == 0, run
    assert "final parameters bit-identical: yes" in run.out, run
    plans = [ln for ln in run.err.splitlines() if "host cache plan:" in ln]
    # each rank's tables, its own budget (logged by rank 0, which plans for every rank)
    assert {re.search(r"\] rank (\d+) host cache plan", ln).group(1) for ln in plans} == {"0", "1"}, plans
    # both arms (reactive, proactive) get the same host caches: planned once each, alike
    bodies = [ln.split("] ", 1)[1] for ln in plans]  # (without the time stamp)
    assert len(bodies) == 4 and bodies[:2] == bodies[2:], plans
    table_rows = {t: int(n) for t, n in re.findall(r"(t_cat_\d+) \d+/(\d+)", run.err)}
    planned = {t: int(n) for ln in plans for t, n in re.findall(r"(t_cat_\d+) (\d+) rows \(", ln)}
    assert set(planned) == set(table_rows), plans
    # a budget below the tables' rows: some tables whole, some cut, by their curves
    assert any(planned[t] < table_rows[t] for t in planned) and any(planned[t] == table_rows[t] for t in planned)
    for ln in plans:
        used, given = map(int, re.search(r"plan: (\d+) of (\d+) bytes", ln).groups())
        assert given == int(0.2 * 2**20) and used <= given, ln


def test_a_host_budget_below_the_pinned_rows_names_tier_host_budget_mb(tmp_path: Path) -> None:
    run = cli("train", "--nproc", "1", "experiment=ci_tiny", "tier=ssd", f"tier.dir={tmp_path / 'nvme'}",
              "tier.host_budget_mb=0.001", "train.eval=false", "train.max_steps=4",
              f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'o'}")
    assert run.rc == 2, run
    (line,) = [ln for ln in run.err.splitlines() if "tier.host_budget_mb=0.001 is too small" in ln]
    assert "rank 0" in line and "raise tier.host_budget_mb to at least" in line and "tier.disk_depth" in line, line
    assert " MiB (" in line and " bytes" not in line, line  # (in the key's unit)
    assert "Traceback" not in run.err, run


def test_tier_host_budget_mb_needs_tier_ssd_and_whole_tables(tmp_path: Path) -> None:
    common = [f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'o'}"]
    run = cli_here("train", "--nproc", "1", "experiment=ci_tiny", "tier.host_budget_mb=1", *common)
    assert run.rc == 2 and "tier.host_budget_mb" in run.err and "tier=ssd" in run.err, run
    run = cli_here("train", "--nproc", "1", "experiment=ci_tiny", "tier=ssd", f"tier.dir={tmp_path / 't'}",
                   "tier.host_budget_mb=1", "sharding=row_wise", *common)
    assert run.rc == 2 and "tier.host_budget_mb" in run.err and "'row_wise'" in run.err, run
