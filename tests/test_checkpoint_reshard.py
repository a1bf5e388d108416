"""The trainer app's checkpoints reshard: saved by 2 gloo ranks, loaded by 1 and by 2, every
table and every optimizer state entry (fused and dense) equals the saved one, row for row;
and nothing in the project unpickles with ``weights_only=False``."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest


from . import checkpoint_worker
from .cases_worker import call, launch_cases, ok

ROOT = Path(__file__).resolve().parents[1]


# (optimizer, sharding, model): "sequence" has sequence tables (an EmbeddingCollection)
# beside pooled ones.
RESHARD = [("sgd", "table_wise", "sparse"), ("rowwise_adagrad", "row_wise", "sparse"),
           ("rowwise_adagrad", "row_wise", "sequence")]


APP_RUN = dict(fn=checkpoint_worker.app_run, out="R", overrides=["train.max_steps=10"])
DAMAGED_RUN = dict(fn=checkpoint_worker.app_run, out="D", overrides=["train.max_steps=6", "train.checkpoint_every=3"])


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Every rank-side case of this module in three launches (starting ranks costs more than
    a case): the RESHARD cases and the app's run (key "app") saved by 2 ranks in one launch,
    then loaded by 1 rank and by 2 (one launch each, with the app's resumes); the 1-rank
    launch also makes test_a_damaged_or_altered_checkpoint_is_refused_in_one_line's run
    (key "damaged")."""
    root = tmp_path_factory.mktemp("reshard")
    app = dict(root=str(root / "app"))
    saved = launch_cases(call, [*RESHARD, "app"], [
        *(dict(fn=checkpoint_worker.save, root=str(root / f"{optimizer}-{sharding}-{model}"), optimizer=optimizer,
               sharding=sharding, model=model) for optimizer, sharding, model in RESHARD),
        {**APP_RUN, **app}])
    good = [case for case in RESHARD if "error" not in saved[case][0]]
    loaded = {}
    for world_size in (1, 2):
        keys = [*good, "app", *(["damaged"] if world_size == 1 else [])]
        loaded[world_size] = launch_cases(call, keys, [
            *(dict(fn=checkpoint_worker.load, path=saved[case][0]["ok"]["path"], optimizer=case[0],
                   sharding=case[1], model=case[2]) for case in good),
            dict(fn=checkpoint_worker.app_resume_loads, out="R", **app),
            *([{**DAMAGED_RUN, "root": str(root / "damaged")}] if world_size == 1 else [])], world_size=world_size)
    return saved, loaded


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer,sharding,model", RESHARD)
def test_saved_on_two_ranks_loads_on_one_and_on_two(resharded, optimizer: str, sharding: str, model: str):
    saved, loaded = resharded
    saved = ok(saved[(optimizer, sharding, model)])
    want = saved[0]["whole"]
    # (sequence tables' keys: "ec.embeddings.<table>.weight"; pooled: "...embedding_bags...")
    tables = [k for k in want if k.startswith("model.") and ("embedding_bags" in k or "embeddings." in k)]
    fused = [k for k in want if k.startswith("optimizer.") and ("embedding_bags" in k or "embeddings." in k)]
    assert len(tables) == 4 and len(want) > len(tables)
    if optimizer == "sgd":  # a stateless fused optimizer: empty entries, which dcp.load would trip on
        assert saved[0]["empty_entries"] > 0 and not fused
    else:
        assert len(fused) == 4
    for world_size in (1, 2):
        for res in ok(loaded[world_size][(optimizer, sharding, model)]):
            got = res["whole"]
            assert sorted(got) == sorted(want)
            unequal = [k for k in want if not np.array_equal(got[k], want[k])]
            assert not unequal, (world_size, unequal)
            assert res["position"] == {"step": 5}


@pytest.mark.multiprocess
def test_the_apps_run_saved_on_two_ranks_resumes_on_one_and_on_two(resharded):
    """``torchrec-proactive train`` (Adam tables, Adam dense) saved by 2 ranks; the Trainer's
    own resume on 1 and on 2 ranks loads every table and state entry as saved."""
    saved, loaded = resharded  # (APP_RUN on 2 ranks, then app_resume_loads on 1 and on 2)
    saved = ok(saved["app"])
    want = saved[0]["whole"]
    assert saved[0]["summary"]["last_checkpoint"].endswith("step_00000010")
    assert any("embedding_bags" in k for k in want) and any(k.startswith("optimizer.") for k in want)
    for world_size in (1, 2):
        for res in ok(loaded[world_size]["app"]):
            # The same point of the epoch in samples: 10 steps of 2 ranks are 20 steps of 1.
            assert res["step"] == 10 * 2 // world_size
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


def test_a_position_moves_to_another_world_size_in_samples():
    from torchrec_proactive.app.loop import Position, rescale_position

    # 2 ranks, 18 steps an epoch; 1 rank: 36. Step 20 = epoch 1, batch 2 -> 4 batches of 1 rank.
    assert rescale_position(Position(20, 1, 2), 2, 1, 36) == Position(36 + 4, 1, 4)
    assert rescale_position(Position(40, 1, 4), 1, 2, 18) == Position(18 + 2, 1, 2)
    assert rescale_position(Position(41, 1, 5), 1, 2, 18) == Position(18 + 2, 1, 2)  # (rounded down)
    assert rescale_position(Position(36, 2, 0), 2, 1, 36) == Position(72, 2, 0)


def test_a_position_that_rescales_to_the_end_of_an_epoch_starts_the_next_one():
    """37 batches an epoch on 1 rank, 18 on 2: batch 36 of 1 rank is all 18 of 2, so the
    resumed run stands at the start of epoch 1 (it was clamped to epoch 0, batch 18, and the
    loop then asked the spent loader for a batch)."""
    from torchrec_proactive.app.loop import Position, rescale_position

    assert rescale_position(Position(36, 0, 36), 1, 2, 18) == Position(18, 1, 0)
    assert rescale_position(Position(37 + 36, 1, 36), 1, 2, 18) == Position(36, 2, 0)
    assert rescale_position(Position(35, 0, 35), 1, 2, 18) == Position(17, 0, 17)


@pytest.mark.multiprocess
def test_a_damaged_or_altered_checkpoint_is_refused_in_one_line(resharded):
    """A truncated tensor file or a manifest whose step was changed: a CheckpointError (one
    line, exit 2 at the CLI) naming the checkpoint and the intact ones left."""
    import json

    from torchrec_proactive.app.checkpoint import Checkpointer
    from torchrec_proactive.app.errors import CheckpointError, UserError

    _, loaded = resharded
    res = ok(loaded[1]["damaged"])[0]  # (DAMAGED_RUN on 1 rank: its own run, for this test only)
    directory = Path(res["summary"]["last_checkpoint"]).parent
    ckpt = Checkpointer(directory, rank=0, world_size=1, keep=3, log=__import__("logging").getLogger("t"))
    last = ckpt.latest()
    assert last is not None and last.name == "step_00000006"
    manifest = json.loads((last / "MANIFEST.json").read_text())
    manifest["position"]["step"] = 99999
    (last / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="MANIFEST.json: was changed or damaged after the save"):
        ckpt.manifest(last)
    # ... and re-sealed, it is still refused: the step must be the directory's
    from torchrec_proactive.app.checkpoint import seal

    manifest["seal"] = seal(manifest)
    (last / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="says step 99999, the directory says step_00000006"):
        ckpt.manifest(last)
    earlier = ckpt.complete()[0]
    data = next(earlier.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{earlier.name}/{data.name}: 100 bytes, \d+ when it was saved") as info:
        ckpt.load(earlier, None)
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)
