"""Fixtures shared across test modules."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest


class CompareRun(NamedTuple):
    run: "object"  # tests.test_cli.Run
    start: Path  # the directory the user ran it from
    out: Path  # its run directory (given relative to ``start``)


@pytest.fixture(scope="session")
def ci_tiny_compare(tmp_path_factory: pytest.TempPathFactory) -> CompareRun:
    """One ``compare --nproc 1 experiment=ci_tiny train.eval=false`` run as a user starts it
    from a directory of their own, with a relative ``train.output_dir``: its whole length
    (75 steps: warm-up and the rounds an interval needs). Several modules read what it
    printed and wrote (each such run cost ~16 s, most of it the rank's imports)."""
    from tests.test_cli import cli

    start = tmp_path_factory.mktemp("ci_tiny_compare")
    run = cli("compare", "--nproc", "1", "experiment=ci_tiny", "train.eval=false",
              f"data.root={start / 'data'}", "train.output_dir=runs/x", cwd=start)
    assert run.rc == 0, run
    return CompareRun(run, start, start / "runs" / "x")


@pytest.fixture(scope="session")
def inplace_and_stale_launches(tmp_path_factory: pytest.TempPathFactory):
    """test_inplace_and_pins' and test_stale_writes' rank-side checks in one launch of 1 rank
    and one of 2 for both modules (each module's ``run_checks`` of its checks is a case,
    inplace's first): starting ranks costs more than either module's checks.
    ``{(module, world_size): per-rank run_checks results}``."""
    from tests import inplace_worker, stale_writes_worker
    from tests.cases_worker import call, launch_cases, ok
    from tests.test_inplace_and_pins import _checks as inplace_checks
    from tests.test_stale_writes import _checks as stale_checks

    out = {}
    for world_size, sharding, stale_sharding in ((2, "row_wise", "row_wise"), (1, "table_wise_rank0", "table_wise_rank0")):
        tmp = tmp_path_factory.mktemp(f"dcp{world_size}")
        keys = [("inplace", world_size), ("stale", world_size)]
        runs = launch_cases(call, keys, [
            dict(fn=inplace_worker.run_checks, checks=inplace_checks(tmp, world_size, sharding)),
            dict(fn=stale_writes_worker.run_checks, checks=stale_checks(stale_sharding))], world_size=world_size,
            timeout_s=540)
        out.update({key: ok(runs[key]) for key in keys})
    return out
