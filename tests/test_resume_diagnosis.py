"""A resume that changes how a table's columns are split, with row-wise optimizer state.

Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD) keeps one state value per row *of each
column shard*: the running sum of the mean squared gradient over that shard's columns. A
table saved with its columns whole (table-wise, row-wise) and resumed column-wise - or
column-wise on another number of ranks - would need the per-shard values, which the saved
whole-row value does not hold. Stock TorchRec fails there too (a size mismatch in DCP); the
product must say what it is - the table, the optimizer, the change, exit 2 - before anything
loads, never call the intact checkpoint damaged nor advise deleting it. Adam (per-element
state) reshards to column-wise exactly, and keeps doing so.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from torchrec_proactive.launch import run_ranks

from . import checkpoint_worker
from .test_cli import TINY, assert_user_error, cli, cli_here

pytestmark = pytest.mark.multiprocess


def _snapshot(directory: Path):
    return {str(p.relative_to(directory)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.endswith(".log")}


def _says_what_it_is(message: str, table: str) -> None:
    assert "\n" not in message, message
    for words in (f"table {table!r}", "row-wise", "column shard", "sharding.type"):
        assert words in message, (words, message)
    for wrong in ("damaged", "delete"):
        assert wrong not in message, (wrong, message)


def test_column_relayout_of_row_wise_state_is_refused_by_the_ranks_and_adam_reshards(tmp_path: Path):
    """The rank-side check (what runs under torchrun, or with sharding.type=auto, where the
    launcher cannot know the plan): 2 ranks save table-wise, 2 ranks load column-wise."""
    # (one launch: the saves, then the loads, with a snapshot of the files after each)
    ranks = run_ranks(checkpoint_worker.save_then_load_each, world_size=2, root=str(tmp_path),
                      optimizers=["rowwise_adagrad", "adam"], save_sharding="table_wise", load_sharding="column_wise")
    saved = [r["saved"] for r in ranks]
    before, after = ranks[0]["snapshots"]
    assert before and after == before == _snapshot(tmp_path)
    for res in (r["loaded"] for r in ranks):
        refused = res["rowwise_adagrad"].get("refused")
        assert refused is not None, "the row-wise state was loaded into column shards"
        _says_what_it_is(refused, "t0")
        assert "whole" in refused and "2 column shards" in refused, refused
        # Adam: every table and state entry as saved, now in column shards
        want, got = saved[0]["adam"]["whole"], res["adam"]["whole"]
        assert sorted(got) == sorted(want)
        state = [k for k in want if k.startswith("optimizer.") and ".t0." in k]
        assert len(state) == 2 and all(want[k].ndim == 2 for k in state), sorted(want)  # per element
        unequal = [k for k in want if not np.array_equal(got[k], want[k])]
        assert not unequal, unequal


def test_the_cli_refuses_a_column_wise_resume_of_row_wise_adagrad_before_launch(tmp_path: Path):
    """The app's path: a 1-rank table-wise run (row-wise Adagrad, the default optimizer),
    resumed column-wise on 2 ranks, is refused in one line, exit 2, writing nothing; what
    keeps the columns as saved passes the launcher's check, and the same checkpoint resumes
    with a sharding that keeps them whole."""
    from torchrec_proactive.app.compose import compose_config
    from torchrec_proactive.app.preflight import check_resume

    data, out = tmp_path / "data", tmp_path / "run"
    args = [*TINY, f"data.root={data}", f"train.output_dir={out}"]
    first = cli("train", *args, "train.max_steps=4")
    assert first.rc == 0, first
    before = _snapshot(out)
    refused = cli_here("train", "--nproc", "2", *args, "train.resume=true", "sharding.type=column_wise")
    line = assert_user_error(refused, "step_00000004", "optimizer.embedding='rowwise_adagrad'",
                             "sharding.type='table_wise'", "sharding.type='column_wise' on 2 rank(s)")
    _says_what_it_is(line, "t_cat_0")
    assert _snapshot(out) == before
    # the launcher's prediction: column_wise on 1 rank is one column shard (whole); row_wise
    # keeps the columns whole; auto is left to the ranks, which see the plan
    for sharding, world_size in (("column_wise", 1), ("row_wise", 2), ("table_row_wise", 2), ("auto", 2)):
        check_resume(compose_config([*args, "train.resume=true", f"sharding.type={sharding}"]),
                     world_size=world_size)
    more = cli("train", *args, "train.resume=true", "sharding.type=row_wise")
    assert more.rc == 0, more
    assert more.result()["steps"] == 6 and more.result()["resumed_from"].endswith("step_00000004"), more
