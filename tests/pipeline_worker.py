"""Rank-side code for pipeline behaviour tests: ordering, drain, eval, state-dict interop."""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveTrainPipeline
from torchrec_proactive.fetch import LinkModel
from torchrec_proactive.planning import build_plan, combined_optimizer, shard_model

from .exactness_worker import LR, _params, _run
from .sparse_model import SparseModel, make_batch, make_tables

FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR}


def _proactive(tables, seed_state, sharding="row_wise", **sharder_kwargs):
    sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(FUSED), debug_checks=True, **sharder_kwargs)
    torch.manual_seed(0)
    model = SparseModel(tables)
    dmp = shard_model(model, sharder, build_plan(model, sharder, sharding), torch.device("cpu"))
    dmp.load_state_dict(copy.deepcopy(seed_state))
    return dmp, combined_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=LR))


def ordering(rank: int, world_size: int, depth: int, steps: int = 8) -> Dict[str, Any]:
    tables = make_tables(3, rows=3000, dim=8)
    seed_state = SparseModel(tables).state_dict()
    dmp, opt = _proactive(tables, seed_state, cache_load_factor=0.5,
                          link=LinkModel(bandwidth_gbps=0.02, latency_us=2000))
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth, trace=True)
    _run(pipe, [make_batch(tables, 32, seed=100 * rank + i) for i in range(steps)])
    records = [
        {"index": r.index, "issued": r.fetch_issued_at, "completed": r.fetch_completed_at,
         "lookup": r.lookup_started_at + r.stall_s, "stall": r.stall_s, "fetched": r.rows_fetched}
        for r in dmp.module.ebc.proactive_stats.records
    ]
    fwd = {e["batch"]: (e["start_s"], e["end_s"]) for e in pipe.tracer.events if str(e["name"]).startswith("fwd")}
    return {"records": records, "fwd": fwd, "events": pipe.tracer.events, "stats": pipe.stats()}


def drain(rank: int, world_size: int, num_batches: int, depth: int) -> Dict[str, Any]:
    tables = make_tables(2, rows=500, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=1.0)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth)
    outs = _run(pipe, [make_batch(tables, 8, seed=rank * 10 + i) for i in range(num_batches)])
    dmp.module.ebc.check_invariants(expect_drained=True)
    # A second epoch through the same pipeline works after draining.
    outs2 = _run(pipe, [make_batch(tables, 8, seed=rank * 10 + i) for i in range(num_batches)])
    dmp.module.ebc.check_invariants(expect_drained=True)
    return {"n": len(outs), "n2": len(outs2)}


def eval_and_stop_early(rank: int, world_size: int) -> Dict[str, Any]:
    """No-grad evaluation and an abandoned (reset) pipeline leak no pins."""
    tables = make_tables(2, rows=500, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=0.6)
    ebc = dmp.module.ebc
    batches = [make_batch(tables, 8, seed=rank * 10 + i) for i in range(6)]
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    it = iter(batches)
    pipe.progress(it)
    pipe.progress(it)  # stop with batches still in flight
    pipe.reset()
    ebc.check_invariants(expect_drained=True)
    dmp.eval()
    before = {k: v.clone() for k, v in _params(dmp).items()}
    eval_outs = _run(pipe, batches)
    ebc.check_invariants(expect_drained=True)
    unchanged = all(torch.equal(before[k], v) for k, v in _params(dmp).items())
    # A plain forward outside the pipeline (reactive at depth 0) also releases its pins.
    pipe.detach()
    ebc.set_prefetch_depth(0)
    with torch.no_grad():
        dmp(batches[0])
    ebc.check_invariants(expect_drained=True)
    return {"eval_n": len(eval_outs), "unchanged": unchanged}


def state_dict_interop(rank: int, world_size: int, sharding: str) -> Dict[str, Any]:
    tables = make_tables(3, rows=400, dim=8)
    torch.manual_seed(5)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_batch(tables, 16, seed=rank * 10 + i) for i in range(4)]
    # Train with the plugin (small cache, so dirty rows sit in the cache at the end).
    dmp, opt = _proactive(tables, seed_state, sharding=sharding, cache_load_factor=0.5)
    _run(ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2), batches)
    trained = dmp.state_dict()
    # ... load into stock TorchRec (fused kernel, all rows resident).
    stock_sharder = EmbeddingBagCollectionSharder(fused_params=dict(FUSED))
    torch.manual_seed(0)
    model = SparseModel(tables)
    stock = shard_model(model, stock_sharder, build_plan(model, stock_sharder, sharding, kernel="fused"), torch.device("cpu"))
    stock.load_state_dict(copy.deepcopy(trained))
    stock_params, ours = _params(stock), _params(dmp)
    to_stock = sorted(stock_params) == sorted(ours) and all(torch.equal(stock_params[k], ours[k]) for k in ours)
    shapes_match = all(stock_params[k].shape == ours[k].shape for k in ours)
    # ... and stock -> plugin: the loaded weights must be what the cache serves next.
    dmp2, _ = _proactive(tables, seed_state, sharding=sharding, cache_load_factor=0.5)
    dmp2.load_state_dict(copy.deepcopy(stock.state_dict()))
    dmp2.eval()
    stock.eval()
    with torch.no_grad():
        a = dmp2(batches[0])[1]
        b = stock(batches[0])[1]
    return {"to_stock": to_stock, "shapes_match": shapes_match, "from_stock_pred_diff": float((a - b).abs().max())}


def checkpoint_resume(rank: int, world_size: int, optimizer: str) -> Dict[str, Any]:
    """Model + optimizer state_dicts mid-training resume bit-identically (cache of 60%)."""
    from .exactness_worker import FUSED as ALL_FUSED

    tables = make_tables(3, rows=400, dim=8)
    torch.manual_seed(3)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_batch(tables, 16, seed=rank * 10 + i) for i in range(7)]

    def build():
        sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(ALL_FUSED[optimizer]), cache_load_factor=0.6)
        torch.manual_seed(0)
        model = SparseModel(tables)
        dmp = shard_model(model, sharder, build_plan(model, sharder, "row_wise"), torch.device("cpu"))
        dmp.load_state_dict(copy.deepcopy(seed_state))
        return dmp, combined_optimizer(dmp, lambda p: torch.optim.Adagrad(p, lr=LR))

    dmp, opt = build()
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    _run(pipe, batches[:4])
    saved_model = copy.deepcopy(dmp.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    cont = _run(pipe, batches[4:])
    final = _params(dmp)

    dmp2, opt2 = build()
    dmp2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    opt2.set_optimizer_step(4)  # TorchRec/FBGEMM keep the step counter out of the state dict
    resumed = _run(ProactiveTrainPipeline(dmp2, opt2, torch.device("cpu"), prefetch_depth=1), batches[4:])
    final2 = _params(dmp2)
    return {
        "outputs_equal": all(torch.equal(a, b) for a, b in zip(cont, resumed)),
        "params_equal": all(torch.equal(final[k], final2[k]) for k in final),
        "state_keys": sorted(k for st in saved_opt["state"].values() for k in st)[:4],
    }


def deferred_batches_prepare_once(rank: int, world_size: int) -> Dict[str, Any]:
    """A prefetch that waits for pins is retried on the store only: its ids -> rows work
    (prepare_batch) runs once per batch and kernel, however many plans it takes."""
    tables = make_tables(2, rows=400, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=0.1)
    ebc = dmp.module.ebc
    calls = {"prepare": 0, "plan": 0}
    for kernel in ebc._proactive_kernels:  # count the calls of the real methods
        def counted(name, fn):
            def call(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return call
        kernel.prepare_batch = counted("prepare", kernel.prepare_batch)
        kernel.plan_prepared = counted("plan", kernel.plan_prepared)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=4)
    steps = 8
    _run(pipe, [make_batch(tables, 16, seed=rank * 10 + i) for i in range(steps)])
    ebc.check_invariants(expect_drained=True)
    return {"calls": calls, "kernels": len(ebc._proactive_kernels), "steps": steps, "stats": pipe.stats()}
