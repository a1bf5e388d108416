"""The trainer app's checkpoints reshard: saved by 2 gloo ranks, loaded by 1 and by 2, every
table and every optimizer state entry (fused and dense) equals the saved one, row for row;
and nothing in the project unpickles with ``weights_only=False``."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from torchrec_proactive.launch import run_ranks

from . import checkpoint_worker

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer,sharding", [("sgd", "table_wise"), ("rowwise_adagrad", "row_wise")])
def test_saved_on_two_ranks_loads_on_one_and_on_two(tmp_path: Path, optimizer: str, sharding: str):
    saved = run_ranks(checkpoint_worker.save, world_size=2, root=str(tmp_path), optimizer=optimizer,
                      sharding=sharding)
    want = saved[0]["whole"]
    tables = [k for k in want if k.startswith("model.") and "embedding_bags" in k]
    fused = [k for k in want if k.startswith("optimizer.") and "embedding_bags" in k]
    assert len(tables) == 4 and len(want) > len(tables)
    if optimizer == "sgd":  # a stateless fused optimizer: empty entries, which dcp.load would trip on
        assert saved[0]["empty_entries"] > 0 and not fused
    else:
        assert len(fused) == 4
    for world_size in (1, 2):
        for res in run_ranks(checkpoint_worker.load, world_size=world_size, path=saved[0]["path"],
                             optimizer=optimizer, sharding=sharding):
            got = res["whole"]
            assert sorted(got) == sorted(want)
            unequal = [k for k in want if not np.array_equal(got[k], want[k])]
            assert not unequal, (world_size, unequal)
            assert res["position"] == {"step": 5}


@pytest.mark.multiprocess
def test_the_apps_run_saved_on_two_ranks_resumes_on_one_and_on_two(tmp_path: Path):
    """``torchrec-proactive train`` (Adam tables, Adam dense) saved by 2 ranks; the Trainer's
    own resume on 1 and on 2 ranks loads every table and state entry as saved."""
    saved = run_ranks(checkpoint_worker.app_run, world_size=2, timeout_s=600, root=str(tmp_path), out="R",
                      overrides=["train.max_steps=10"])
    want = saved[0]["whole"]
    assert saved[0]["summary"]["last_checkpoint"].endswith("step_00000010")
    assert any("embedding_bags" in k for k in want) and any(k.startswith("optimizer.") for k in want)
    for world_size in (1, 2):
        for res in run_ranks(checkpoint_worker.app_resume_loads, world_size=world_size, timeout_s=600,
                             root=str(tmp_path), out="R"):
            assert res["step"] == 10
            got = res["whole"]
            assert sorted(got) == sorted(want), (world_size, sorted(set(got) ^ set(want))[:5])
            unequal = [k for k in want if not np.array_equal(got[k], want[k])]
            assert not unequal, (world_size, unequal)


def test_a_tampered_metadata_pickle_is_refused(tmp_path: Path):
    """DCP's .metadata is a pickle: one that names anything but DCP's metadata classes is
    refused before it can run."""
    from torchrec_proactive.app.checkpoint import SafeFileSystemReader

    class Exploit:
        def __reduce__(self):
            return (Path.write_text, (tmp_path / "pwned", "x"))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(ValueError, match="refusing to load it"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_no_source_file_unpickles_with_weights_only_false():
    pattern = re.compile(r"weights_only\s*=\s*False")
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if ".venv" not in p.parts and p.name != Path(__file__).name and pattern.search(p.read_text())]
    assert not offenders, offenders
