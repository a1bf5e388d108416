"""The DLRM example end to end on 2 gloo ranks and a tiny generated Criteo-format data set.

One launch runs, on the same two ranks:

* A: two epochs uninterrupted, with ``prefetch=auto`` (reactive warm-up, then the chosen depth);
* B: the same config stopped at step 27 (mid-epoch), leaving a checkpoint;
* C: B resumed at a different prefetch depth, to the end;
* ``compare`` (reactive vs. depth 2, interleaved) for a few steps;
* a launch whose rank 1 got a different override (the config check must name it).

A's loss must go down and its held-out AUROC clearly beat 0.5; C must continue B
bit-identically to A (per-step losses, final parameters and optimizer state, evaluation).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from torchrec_proactive.app.autodepth import choose_depth
from torchrec_proactive.app.checkpoint import LATEST, MANIFEST, Checkpointer
from torchrec_proactive.app.resume import refuse_changes as check_compatible
from torchrec_proactive.launch import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS_PER_EPOCH = 18  # 3000 rows, 20% held out, 2 ranks x 64
STOP = 27


def _losses(run_dir: Path, rank: int) -> Dict[int, float]:
    out = {}
    for line in (run_dir / f"rank_{rank}" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "step":
            out[rec["step"]] = rec["loss"]  # a resumed run appends: later records win
    return out


def _tensors(obj: Any, prefix: str = "") -> Dict[str, torch.Tensor]:
    """Every tensor in a (nested) state dict, ShardedTensors by their local shards."""
    out: Dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{prefix}{k}/"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{prefix}{i}/"))
    elif hasattr(obj, "local_shards"):
        for i, s in enumerate(obj.local_shards()):
            out[f"{prefix}#{i}"] = s.tensor
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj
    return out


def _scenario(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    from torchrec_proactive.app.entry import rank_main
    from torchrec_proactive.app.env import ConfigMismatchError

    base = ["experiment=ci_tiny", f"data.root={root}/data", "link.bandwidth_gbps=0.2", "link.latency_us=500",
            # Adam: lazily created dense state and per-table step counters must survive resume
            "optimizer=adam", "optimizer.embedding_lr=0.02", "optimizer.dense_lr=0.005"]
    a = rank_main(rank, world_size, "train", base + [f"train.output_dir={root}/A", "prefetch=auto",
                                                     "prefetch.warmup_steps=4", "prefetch.max_depth=2"])
    b = rank_main(rank, world_size, "train", base + [f"train.output_dir={root}/B", f"train.max_steps={STOP}"])
    c = rank_main(rank, world_size, "train", base + [f"train.output_dir={root}/B", "train.resume=true",
                                                     "prefetch.depth=1"])
    cmp = rank_main(rank, world_size, "compare", base + [f"train.output_dir={root}/X", "train.max_steps=12",
                                                         "train.eval=false"])
    try:
        rank_main(rank, world_size, "train", base + [f"train.output_dir={root}/M"],
                  rank_overrides={1: ["optimizer.embedding_lr=0.07"]})
        mismatch = None
    except ConfigMismatchError as e:
        mismatch = str(e)

    ra, rc = Path(root) / "A", Path(root) / "B"
    la, lc = _losses(ra, rank), _losses(rc, rank)
    # Whole tensors (no template): every table and state entry as saved, on every rank.
    reader = Checkpointer(Path(root), rank, world_size, keep=2, log=logging.getLogger("test"))
    final_a = reader.load(Path(a["last_checkpoint"]), None, "cpu")
    final_c = reader.load(Path(c["last_checkpoint"]), None, "cpu")
    ta = _tensors({"model": final_a["model"], "optimizer": final_a["optimizer"]})
    tc = _tensors({"model": final_c["model"], "optimizer": final_c["optimizer"]})
    unequal = sorted(k for k in ta if k not in tc or not torch.equal(ta[k], tc[k]))
    return {
        "a": a, "b": b, "c": c, "compare": cmp, "mismatch": mismatch, "losses_a": la, "losses_c": lc,
        "num_tensors": len(ta), "same_keys": sorted(ta) == sorted(tc), "unequal": unequal,
        "position_c": final_c["position"],
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = tmp_path_factory.mktemp("dlrm")
    return run_ranks(_scenario, world_size=2, timeout_s=300, root=str(root))


def test_loss_goes_down_and_auroc_beats_chance(results: List[Dict[str, Any]]) -> None:
    for r in results:
        losses = [r["losses_a"][s] for s in sorted(r["losses_a"])]
        assert len(losses) == 2 * STEPS_PER_EPOCH
        first, last = sum(losses[:6]) / 6, sum(losses[-6:]) / 6
        assert last < first - 0.1, (first, last)
        evals = r["a"]["evals"]
        assert [e["step"] for e in evals] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
        assert evals[0]["auroc"] > 0.6, evals  # chance is 0.5
        assert evals[0]["samples"] == 512  # both ranks' held-out batches


def test_auto_prefetch_chose_a_depth(results: List[Dict[str, Any]]) -> None:
    choices = [r["a"]["depth_choice"] for r in results]
    assert choices[0] == choices[1], "every rank must run the same depth"
    # (the depth itself follows measured times, so only its bounds are deterministic)
    assert 1 <= choices[0]["depth"] <= 2, choices[0]
    assert results[0]["a"]["depth"] == choices[0]["depth"]


def test_resume_is_bit_identical(results: List[Dict[str, Any]]) -> None:
    for r in results:
        assert r["b"]["steps"] == STOP and r["c"]["steps"] == 2 * STEPS_PER_EPOCH
        assert r["c"]["resumed_from"].endswith(f"step_{STOP:08d}")
        assert r["position_c"] == {"step": 36, "epoch": 2, "batch_in_epoch": 0}
        # every step after the resume point reproduces the uninterrupted run exactly
        for step in range(STOP + 1, 2 * STEPS_PER_EPOCH + 1):
            assert r["losses_c"][step] == r["losses_a"][step], step
        assert r["same_keys"] and r["num_tensors"] > 30
        assert r["unequal"] == [], r["unequal"][:5]
        assert r["c"]["evals"][-1]["auroc"] == r["a"]["evals"][-1]["auroc"]
        assert r["c"]["evals"][-1]["logloss"] == r["a"]["evals"][-1]["logloss"]


def test_compare_reactive_vs_proactive(results: List[Dict[str, Any]]) -> None:
    from torchrec_proactive.app.compare import format_table

    result = results[0]["compare"]
    reactive, proactive = result["rows"]
    assert (reactive["depth"], proactive["depth"], reactive["steps"], proactive["steps"]) == (0, 2, 12, 12)
    assert result["identical_parameters"], "proactive fetching must not change a bit"
    # Counters, not times: reactively every missing row is copied at its lookup, on the
    # critical path; two batches ahead only the first batch of each pipeline fill is (the
    # loop drains the pipeline every segment; the counts are a function of the data alone).
    assert reactive["rows_fetched_per_step"] > 0
    assert reactive["rows_fetched_at_lookup_per_step"] == reactive["rows_fetched_per_step"]
    assert 0 < proactive["rows_fetched_at_lookup_per_step"] < proactive["rows_fetched_per_step"] / 5
    table = format_table(result)
    assert "emulated (0.2 GB/s, 500 us per fetch)" in table and "speed-up" in table


def test_config_mismatch_across_ranks_fails_clearly(results: List[Dict[str, Any]]) -> None:
    for r in results:
        msg = r["mismatch"]
        assert msg is not None, "a rank with a different config must fail"
        assert "rank 1" in msg and "optimizer.embedding_lr" in msg and "0.07" in msg, msg


def test_interrupted_checkpoint_keeps_the_previous_one(tmp_path: Path) -> None:
    import logging

    ck = Checkpointer(tmp_path, rank=0, world_size=1, keep=2, log=logging.getLogger("t"))
    good = tmp_path / "step_00000010"
    good.mkdir()
    (good / "rank_00000.pt").write_bytes(b"x")
    (good / MANIFEST).write_text("{}")
    (tmp_path / LATEST).write_text(good.name)
    # a later save died after writing a rank file, before its manifest (and LATEST) ...
    torn = tmp_path / "step_00000020"
    torn.mkdir()
    (torn / ".rank_00000.pt.123.partial").write_bytes(b"half")
    assert ck.latest() == good
    # ... or LATEST was pointed at it by hand: still only complete checkpoints count
    (tmp_path / LATEST).write_text(torn.name)
    assert ck.latest() == good and ck.complete() == [good]


def test_resume_refuses_a_changed_model() -> None:
    saved = {"model.embedding_dim": 8, "prefetch.depth": 2, "data.root": "/a"}
    check_compatible(saved, {"model.embedding_dim": 8, "prefetch.depth": 1, "data.root": "/b"}, "ckpt")
    with pytest.raises(ValueError, match=r"model.embedding_dim: checkpoint 8 vs now 16"):
        check_compatible(saved, {"model.embedding_dim": 16, "prefetch.depth": 2, "data.root": "/a"}, "ckpt")


def test_choose_depth() -> None:
    assert choose_depth(0.0, 0.02, max_depth=4, cache_limit=10).depth == 1
    assert choose_depth(0.005, 0.02, max_depth=4, cache_limit=10).depth == 1
    assert choose_depth(0.05, 0.02, max_depth=4, cache_limit=10).depth == 3
    capped = choose_depth(0.05, 0.02, max_depth=4, cache_limit=2)
    assert capped.depth == 2 and "cache" in capped.reason and "link is slower" in capped.reason
    assert choose_depth(1.0, 0.01, max_depth=4, cache_limit=64).depth == 4
