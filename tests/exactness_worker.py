"""Rank-side code of the multi-process exactness tests (importable by spawned ranks)."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveTrainPipeline
from torchrec_proactive.planning import build_plan, combined_optimizer, shard_model

from .sparse_model import SparseModel, make_batch, make_tables

LR = 0.05
FUSED = {
    "sgd": {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
    "rowwise_adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8},
    "adagrad": {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR, "eps": 1e-8},
    "adam": {"optimizer": EmbOptimType.ADAM, "learning_rate": LR, "eps": 1e-8},
}


def _build(sharder, sharding, kernel, tables, seed_state, weighted: bool = False):
    torch.manual_seed(0)
    model = SparseModel(tables, weighted=weighted)
    plan = build_plan(model, sharder, sharding, kernel=kernel)
    dmp = shard_model(model, sharder, plan, torch.device("cpu"))
    dmp.load_state_dict(copy.deepcopy(seed_state))  # loading consumes the dict
    opt = combined_optimizer(dmp, lambda params: torch.optim.SGD(params, lr=LR))
    return dmp, opt


def _run(pipeline, batches) -> List[torch.Tensor]:
    it = iter(batches)
    out = []
    while True:
        try:
            out.append(pipeline.progress(it))
        except StopIteration:
            return out


def _params(dmp) -> Dict[str, torch.Tensor]:
    sd = dmp.state_dict()
    out = {}
    for k, v in sd.items():
        if hasattr(v, "local_shards"):
            for i, s in enumerate(v.local_shards()):
                out[f"{k}#{i}"] = s.tensor.detach().clone()
        else:
            out[k] = v.detach().clone()
    return out


def train_and_compare(rank: int, world_size: int, sharding: Any, optimizer: str, depths: List[int],
                      cache_load_factor: float, steps: int = 6, batch_size: int = 32, rows: int = 600,
                      policy: str = "lru", compare_stock: bool = True, weighted: bool = False) -> Dict[str, Any]:
    tables = make_tables(4, rows=rows, dim=8, shared_feature=True)
    torch.manual_seed(123)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_batch(tables, batch_size, seed=1000 * rank + i, weighted=weighted) for i in range(steps)]
    fused = FUSED[optimizer]
    result: Dict[str, Any] = {"rank": rank}
    ref_out = ref_params = None
    if compare_stock:
        stock = EmbeddingBagCollectionSharder(fused_params=dict(fused))
        dmp, opt = _build(stock, sharding, "fused", tables, seed_state)
        ref_out = _run(TrainPipelineSparseDist(dmp, opt, torch.device("cpu")), batches)
        ref_params = _params(dmp)
    per_depth = {}
    for k in depths:
        sharder = ProactiveEmbeddingBagCollectionSharder(
            fused_params=dict(fused), cache_load_factor=cache_load_factor, eviction_policy=policy, debug_checks=True
        )
        dmp, opt = _build(sharder, sharding, "fused_uvm_caching", tables, seed_state)
        pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=k)
        out = _run(pipe, batches)
        params = _params(dmp)
        ebc = dmp.module.ebc
        ebc.check_invariants(expect_drained=True)
        per_depth[k] = {"out": out, "params": params, "stats": pipe.stats()}
    result["n_out"] = {k: len(v["out"]) for k, v in per_depth.items()}
    base = per_depth[depths[0]]
    result["bitwise_equal_across_depths"] = all(
        all(torch.equal(a, b) for a, b in zip(v["out"], base["out"]))
        and all(torch.equal(v["params"][n], base["params"][n]) for n in base["params"])
        for v in per_depth.values()
    )
    if compare_stock:
        result["max_out_diff_vs_stock"] = max(float((a - b).abs().max()) for a, b in zip(base["out"], ref_out))
        result["max_param_diff_vs_stock"] = max(float((base["params"][n] - ref_params[n]).abs().max()) for n in ref_params)
        result["same_keys_as_stock"] = sorted(ref_params) == sorted(base["params"])
    result["stats"] = {k: v["stats"] for k, v in per_depth.items()}
    return result


def _tiny_slots(tables, all_batches, depth: int) -> Dict[str, int]:
    """(depth + 1) x the largest number of distinct rows one global batch asks of each table."""
    need = {}
    for t in tables:
        worst = 0
        for step_batches in zip(*all_batches):
            ids = torch.cat([b.sparse_features[f].values() for b in step_batches for f in t.feature_names])
            worst = max(worst, int(torch.unique(ids).numel()))
        need[t.name] = max(1, (depth + 1) * worst)
    return need


def matrix(rank: int, world_size: int, sharding: Any, optimizers: List[str], depths: List[int],
           caches: List[str], steps: int = 5, batch_size: int = 16, rows: int = 2000,
           one_id_per_bag: bool = False, weighted: bool = False, pooling: str = "sum",
           planner: str = "auto") -> Dict[str, Any]:
    """Every optimizer x cache size x depth against stock TorchRec (where it runs on CPU)."""
    tables = make_tables(4, rows=rows, dim=8, shared_feature=True, pooling=PoolingType[pooling.upper()])
    torch.manual_seed(123)
    seed_state = SparseModel(tables, weighted=weighted).state_dict()
    all_batches = [[make_batch(tables, batch_size, seed=1000 * r + i, max_len=3, weighted=weighted,
                               one_id_per_bag=one_id_per_bag) for i in range(steps)]
                   for r in range(world_size)]
    batches = all_batches[rank]
    report: Dict[str, Any] = {"rank": rank, "runs": {}}
    for optimizer in optimizers:
        fused = FUSED[optimizer]
        ref = None
        if optimizer != "adam":  # FBGEMM's CPU TBE has no Adam: stock TorchRec cannot run it here
            dmp, opt = _build(EmbeddingBagCollectionSharder(fused_params=dict(fused)), sharding, "fused", tables,
                              seed_state, weighted)
            ref = (_run(TrainPipelineSparseDist(dmp, opt, torch.device("cpu")), batches), _params(dmp))
        first = None
        for cache in caches:
            for k in depths:
                if isinstance(cache, float):  # a load factor, however small: any cache size trains
                    options = {"cache_load_factor": cache}
                elif cache == "tiny":
                    options = {"num_slots": _tiny_slots(tables, all_batches, k)}
                elif cache == "per_table":  # each table its own budget in its group's store, as small as fits
                    options = {"num_slots": _tiny_slots(tables, all_batches, k), "table_budgets": "per_table"}
                elif cache == "per_table_uneven":  # the first table's budget below one batch (it overflows)
                    tiny = _tiny_slots(tables, all_batches, k)
                    first_table = tables[0].name
                    options = {"num_slots": {n: (max(1, v // (2 * (k + 1))) if n == first_table else max(v, rows // 10))
                                             for n, v in tiny.items()}, "table_budgets": "per_table"}
                elif cache == "10pct":
                    tiny = _tiny_slots(tables, all_batches, k)
                    options = {"num_slots": {n: max(v, rows // 10) for n, v in tiny.items()}}
                else:
                    options = {"cache_load_factor": 1.0}
                sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), debug_checks=True,
                                                                 planner=planner, **options)
                dmp, opt = _build(sharder, sharding, "fused_uvm_caching", tables, seed_state, weighted)
                pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=k)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = _run(pipe, batches)
                params = _params(dmp)
                dmp.module.ebc.check_invariants(expect_drained=True)
                stats = pipe.stats()
                run = {"n_out": len(out), "hit_rate": stats.get("hit_rate", 1.0),
                       "deferred_batches": stats.get("deferred_batches", 0), "overflow_rows": stats.get("overflow_rows", 0),
                       "cache_warnings": [str(w.message) for w in caught if "device cache" in str(w.message)]}
                if first is None:
                    first = (out, params)
                run["bitwise_equal_to_first"] = all(torch.equal(a, b) for a, b in zip(out, first[0])) and all(
                    torch.equal(params[n], first[1][n]) for n in first[1]
                )
                if ref is not None:
                    run["max_out_diff_vs_stock"] = max(float((a - b).abs().max()) for a, b in zip(out, ref[0]))
                    run["max_param_diff_vs_stock"] = max(float((params[n] - ref[1][n]).abs().max()) for n in ref[1])
                    run["same_keys_as_stock"] = sorted(params) == sorted(ref[1])
                report["runs"][f"{optimizer}/{cache}/k{k}"] = run
    return report


def planner_auto(rank: int, world_size: int) -> Dict[str, Any]:
    """TorchRec's planner ("auto") on CPU with our sharder: cached tables, same math as stock."""
    tables = make_tables(4, rows=600, dim=8)
    torch.manual_seed(123)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_batch(tables, 16, seed=1000 * rank + i) for i in range(5)]
    fused = FUSED["rowwise_adagrad"]
    stock_dmp, stock_opt = _build(EmbeddingBagCollectionSharder(fused_params=dict(fused)), "auto", "fused", tables, seed_state)
    ref = _run(TrainPipelineSparseDist(stock_dmp, stock_opt, torch.device("cpu")), batches)
    sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), cache_load_factor=0.5, debug_checks=True)
    dmp, opt = _build(sharder, "auto", "fused_uvm_caching", tables, seed_state)
    kernels = sorted({ps.compute_kernel for ps in dmp.plan.plan["ebc"].values()})
    out = _run(ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2), batches)
    a, b = _params(dmp), _params(stock_dmp)
    return {"kernels": kernels, "n_proactive_kernels": len(dmp.module.ebc.proactive_kernels),
            "max_param_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
            "max_out_diff": max(float((x - y).abs().max()) for x, y in zip(out, ref))}


def weighted_features(rank: int, world_size: int, sharding: str) -> Dict[str, Any]:
    """Per-sample weights (a weighted EBC) through the plugin equal stock TorchRec."""
    tables = make_tables(3, rows=500, dim=8)
    torch.manual_seed(9)
    seed_state = SparseModel(tables, weighted=True).state_dict()
    batches = [make_batch(tables, 16, seed=1000 * rank + i, weighted=True) for i in range(5)]
    fused = FUSED["rowwise_adagrad"]

    def build(sharder, kernel):
        torch.manual_seed(0)
        model = SparseModel(tables, weighted=True)
        dmp = shard_model(model, sharder, build_plan(model, sharder, sharding, kernel=kernel), torch.device("cpu"))
        dmp.load_state_dict(copy.deepcopy(seed_state))
        return dmp, combined_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=LR))

    stock, sopt = build(EmbeddingBagCollectionSharder(fused_params=dict(fused)), "fused")
    ref = _run(TrainPipelineSparseDist(stock, sopt, torch.device("cpu")), batches)
    dmp, opt = build(ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), cache_load_factor=0.5), "fused_uvm_caching")
    out = _run(ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2), batches)
    a, b = _params(dmp), _params(stock)
    return {"max_param_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
            "max_out_diff": max(float((x - y).abs().max()) for x, y in zip(out, ref)), "n": len(out)}


def vbe_and_compare(rank: int, world_size: int, sharding: Any, depths: List[int], optimizer: str = "rowwise_adagrad",
                    load_factor: float = 0.2, steps: int = 6) -> Dict[str, Any]:
    """Variable batch per feature (VBE, with ``inverse_indices``): stock TorchRec against the
    proactive sharder at each depth, on the same batches."""
    from .sparse_model import make_vbe_batch

    tables = make_tables(4, rows=400, dim=8, shared_feature=True)
    torch.manual_seed(123)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_vbe_batch(tables, 12, seed=1000 * rank + i) for i in range(steps)]
    fused = FUSED[optimizer]
    dmp, opt = _build(EmbeddingBagCollectionSharder(fused_params=dict(fused)), sharding, "fused", tables, seed_state)
    ref_out = _run(TrainPipelineSparseDist(dmp, opt, torch.device("cpu")), batches)
    ref_params = _params(dmp)
    runs = {}
    for k in depths:
        sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), cache_load_factor=load_factor,
                                                         debug_checks=True)
        dmp, opt = _build(sharder, sharding, "fused_uvm_caching", tables, seed_state)
        pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=k)
        out = _run(pipe, batches)
        dmp.module.ebc.check_invariants(expect_drained=True)
        runs[k] = {"out": out, "params": _params(dmp), "stats": pipe.stats()}
    base = runs[depths[0]]
    return {
        "n_out": len(base["out"]),
        "rows_requested": {k: r["stats"]["rows_requested"] for k, r in runs.items()},
        "hit_rate": {k: r["stats"]["hit_rate"] for k, r in runs.items()},
        "bitwise_equal_across_depths": all(
            all(torch.equal(a[1], b[1]) for a, b in zip(r["out"], base["out"]))
            and all(torch.equal(r["params"][n], base["params"][n]) for n in base["params"]) for r in runs.values()),
        "same_keys_as_stock": sorted(ref_params) == sorted(base["params"]),
        "max_param_diff_vs_stock": max(float((base["params"][n] - ref_params[n]).abs().max()) for n in ref_params),
        "max_out_diff_vs_stock": max(float((a[1] - b[1]).abs().max()) for a, b in zip(base["out"], ref_out)),
    }
