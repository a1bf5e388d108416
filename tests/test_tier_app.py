"""Issue 42 in the app: ``tier=ssd`` (Hydra group ``tier``: ``dram``, the default, or ``ssd``)
trains the proactive tables from files under ``tier.dir``, and ``compare`` stays exact."""

from __future__ import annotations

import os
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
def test_a_host_cache_too_small_for_the_depths_names_tier_host_cache_mb(tmp_path: Path) -> None:
    """A host cache that cannot hold the rows of the batches in flight: one line in config
    words, exit 2 (not the store's parameter names, not a traceback)."""
    run = cli("train", "--nproc", "1", "experiment=ci_tiny", "tier=ssd", f"tier.dir={tmp_path / 'nvme'}",
              "tier.host_cache_mb=0.0005", "train.eval=false", "train.max_steps=4",
              f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'o'}")
    assert run.rc == 2, run
    (line,) = [ln for ln in run.err.splitlines() if "error" in ln.lower() and "tier.host_cache_mb" in ln]
    assert "tier.host_cache_mb=0.0005 is too small" in line and "raise tier.host_cache_mb" in line, line
    assert "Traceback" not in run.err, run


def test_tier_disk_depth_needs_tier_ssd(tmp_path: Path) -> None:
    run = cli_here("train", "--nproc", "1", "experiment=ci_tiny", "tier.disk_depth=4",
                   f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'o'}")
    assert run.rc == 2 and "tier.disk_depth" in run.err and "tier=ssd" in run.err, run
