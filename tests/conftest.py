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
