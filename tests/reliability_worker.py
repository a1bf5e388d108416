"""Rank-side code of the reliability tests: bad input, faults, recovery."""

from __future__ import annotations

import copy
import os
import signal
from typing import Any, Dict, List, Optional

import torch
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from torchrec_proactive import ProactiveTrainPipeline

from .exactness_worker import _params, _run
from .pipeline_worker import FUSED, _proactive
from .sparse_model import SparseModel, make_batch, make_tables


def _with_ids(batch: Batch, feature: str, position: int, value: int) -> Batch:
    kjt = batch.sparse_features
    values = kjt.values().clone()
    start = int(kjt.offset_per_key()[kjt.keys().index(feature)])
    values[start + position] = value
    new = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    return Batch(dense_features=batch.dense_features, sparse_features=new, labels=batch.labels)


def _empty_for(tables, batch_size: int, seed: int) -> Batch:
    b = make_batch(tables, batch_size, seed=seed)
    keys = b.sparse_features.keys()
    kjt = KeyedJaggedTensor(keys=keys, values=torch.zeros(0, dtype=torch.int64),
                            lengths=torch.zeros(len(keys) * batch_size, dtype=torch.int64))
    return Batch(dense_features=b.dense_features, sparse_features=kjt, labels=b.labels)


def bad_ids(rank: int, world_size: int, sharding: str, value: int, only_rank: Optional[int] = None) -> Dict[str, Any]:
    """A bad id in batch 3 (on every rank, or only on ``only_rank``)."""
    tables = make_tables(3, rows=300, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), sharding=sharding, cache_load_factor=1.0)
    batches = [make_batch(tables, 8, seed=rank * 10 + i) for i in range(6)]
    if only_rank is None or rank == only_rank:
        batches[3] = _with_ids(batches[3], "f1", 2, value)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=1)
    it = iter(batches)
    done = 0
    try:
        while True:
            pipe.progress(it)
            done += 1
    except StopIteration:
        return {"error": None, "done": done}
    except Exception as e:  # noqa: BLE001 - reported to the test
        if only_rank is not None:
            raise  # the other rank is already inside a collective: the job must fail
        before = {k: v.clone() for k, v in _params(dmp).items()}
        pipe.reset()
        dmp.module.ebc.check_invariants(expect_drained=True)
        # Training continues on good batches after the refusal.
        more = _run(pipe, [make_batch(tables, 8, seed=100 + rank * 10 + i) for i in range(3)])
        dmp.module.ebc.check_invariants(expect_drained=True)
        return {"error": f"{type(e).__name__}: {e}", "done": done, "continued": len(more),
                "params_intact": all(torch.isfinite(v).all() for v in before.values())}


def recovery_is_exact(rank: int, world_size: int) -> Dict[str, Any]:
    """A refused batch (NaN dense features) is skipped; the run equals one that never saw it."""
    tables = make_tables(3, rows=300, dim=8)
    seed_state = SparseModel(tables).state_dict()
    good = [make_batch(tables, 8, seed=rank * 10 + i) for i in range(8)]
    poisoned = list(good[:4]) + [copy.copy(good[4])] + list(good[5:])
    poisoned[4] = Batch(dense_features=torch.full_like(good[4].dense_features, float("nan")),
                        sparse_features=good[4].sparse_features, labels=good[4].labels)
    dmp, opt = _proactive(tables, seed_state, cache_load_factor=0.5)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    it = iter(poisoned)
    trained: List[int] = []
    error = None
    # with depth 2 the pipeline holds batches N..N+3; the NaN batch (index 4) is refused on enqueue
    try:
        while True:
            pipe.progress(it)
            trained.append(len(trained))
    except StopIteration:
        pass
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    n_before = len(trained)
    pipe.reset()  # in-flight batches are dropped, not half-trained
    rest = list(it)
    _run(pipe, rest)
    # Reference: exactly the batches that were trained, in order, never seeing the bad one.
    ref, ref_opt = _proactive(tables, seed_state, cache_load_factor=0.5)
    _run(ProactiveTrainPipeline(ref, ref_opt, torch.device("cpu"), prefetch_depth=2), good[:n_before] + rest)
    ours, theirs = _params(dmp), _params(ref)
    return {"error": error, "trained_before": n_before, "rest": len(rest),
            "equal": all(torch.equal(ours[k], theirs[k]) for k in ours)}


def empty_batches(rank: int, world_size: int) -> Dict[str, Any]:
    """Fully empty batches, and a rank that gets no ids at all, train like stock TorchRec."""
    tables = make_tables(3, rows=300, dim=8)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_batch(tables, 8, seed=rank * 10 + i) for i in range(6)]
    batches[2] = _empty_for(tables, 8, seed=50)  # empty everywhere
    if rank == 1:
        batches = [_empty_for(tables, 8, seed=60 + i) if i % 2 else b for i, b in enumerate(batches)]
    dmp, opt = _proactive(tables, seed_state, sharding="row_wise", cache_load_factor=0.5)
    out = _run(ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2), batches)
    dmp.module.ebc.check_invariants(expect_drained=True)
    from torchrec_proactive.planning import build_plan, combined_optimizer, shard_model

    sharder = EmbeddingBagCollectionSharder(fused_params=dict(FUSED))
    torch.manual_seed(0)
    model = SparseModel(tables)
    stock = shard_model(model, sharder, build_plan(model, sharder, "row_wise", kernel="fused"), torch.device("cpu"))
    stock.load_state_dict(copy.deepcopy(seed_state))
    sopt = combined_optimizer(stock, lambda p: torch.optim.SGD(p, lr=0.05))
    ref = _run(TrainPipelineSparseDist(stock, sopt, torch.device("cpu")), batches)
    a, b = _params(dmp), _params(stock)
    return {"n": len(out), "max_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
            "out_diff": max(float((x - y).abs().max()) for x, y in zip(out, ref))}


def capacity_too_small(rank: int, world_size: int) -> Dict[str, Any]:
    """A cache far smaller than depth + 1 batches (and than one batch) still trains, exactly."""
    import warnings

    tables = make_tables(2, rows=1000, dim=8)
    init = SparseModel(tables).state_dict()
    batches = [make_batch(tables, 16, seed=rank * 10 + i, zipf=0.5) for i in range(8)]
    runs = {}
    for depth in (0, 4):
        dmp, opt = _proactive(tables, copy.deepcopy(init), sharding="table_wise", num_slots={"t0": 20, "t1": 20})
        pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _run(pipe, batches)
        runs[depth] = (out, _params(dmp), pipe.stats(), [str(w.message) for w in caught])
    (out0, p0, stats0, _), (out4, p4, stats4, warned) = runs[0], runs[4]
    # the same batches at depth 4 with room for every row: nothing waits
    dmp, opt = _proactive(tables, copy.deepcopy(init), sharding="table_wise", cache_load_factor=1.0)
    roomy = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=4)
    _run(roomy, batches)
    return {
        "n": len(out4),
        "bitwise": all(torch.equal(a, b) for a, b in zip(out0, out4)) and all(torch.equal(p0[k], p4[k]) for k in p0),
        "deferred": stats4["deferred_batches"], "overflow": stats4["overflow_rows"],
        "warnings": [w for w in warned if "served from the host tier" in w],
        "leads": {"depth0": stats0["prefetch_lead_lookups"], "small_cache_depth4": stats4["prefetch_lead_lookups"],
                  "roomy_depth4": roomy.stats()["prefetch_lead_lookups"], "batches": stats4["batches"],
                  "roomy_deferred": roomy.stats()["deferred_batches"]},
    }


def mismatched_depths(rank: int, world_size: int) -> Dict[str, Any]:
    tables = make_tables(2, rows=200, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=1.0)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=1 + rank)
    _run(pipe, [make_batch(tables, 8, seed=i) for i in range(4)])
    return {}


def dies_mid_training(rank: int, world_size: int, victim: int = 1, sigkill: bool = False) -> Dict[str, Any]:
    tables = make_tables(2, rows=200, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=1.0)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    it = iter([make_batch(tables, 8, seed=rank * 100 + i) for i in range(50)])
    for step in range(50):
        if rank == victim and step == 5:
            if sigkill:  # as the out-of-memory killer would
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)  # the rank vanishes mid-training
        pipe.progress(it)
    return {}


def dataloader_fails(rank: int, world_size: int) -> Dict[str, Any]:
    tables = make_tables(2, rows=200, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=0.6)
    batches = [make_batch(tables, 8, seed=rank * 10 + i) for i in range(10)]

    def loader():
        for i, b in enumerate(batches):
            if i == 4:
                raise RuntimeError("dataloader worker crashed")
            yield b

    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    it = loader()
    error = None
    try:
        while True:
            pipe.progress(it)
    except RuntimeError as e:
        error = str(e)
    except StopIteration:
        pass
    pipe.reset()
    dmp.module.ebc.check_invariants(expect_drained=True)
    pins = sum(t.pinned_slots() for t in dmp.module.ebc.named_tables().values())
    return {"error": error, "pins": pins}
