"""Rank-side code of the planned-cache-size exactness test (importable by spawned ranks)."""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import numpy as np
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveTrainPipeline
from torchrec_proactive.cacheplan.curve import MissRatioCurve
from torchrec_proactive.cacheplan.planner import plan_cache_sizes
from torchrec_proactive.planning import build_plan, combined_optimizer, shard_model

from .exactness_worker import FUSED, LR, _params, _run
from .sparse_model import SparseModel, make_batch, make_tables


def _build(sharder, kernel, tables, seed_state, load_factors=None):
    torch.manual_seed(0)
    model = SparseModel(tables)
    plan = build_plan(model, sharder, "table_wise", kernel=kernel, cache_load_factor=load_factors)
    dmp = shard_model(model, sharder, plan, torch.device("cpu"))
    dmp.load_state_dict(copy.deepcopy(seed_state))
    return dmp, combined_optimizer(dmp, lambda params: torch.optim.SGD(params, lr=LR))


def planned_exactness(rank: int, world_size: int, depths: List[int], budget_bytes: int, steps: int = 8,
                      batch_size: int = 32, rows: int = 600) -> Dict[str, Any]:
    """Curves of the run's own global batches, the planner's per-table sizes (each table's
    budget in its group's one store), trained at every depth and by stock TorchRec."""
    tables = make_tables(4, rows=rows, dim=8, shared_feature=True)
    all_batches = [[make_batch(tables, batch_size, seed=1000 * r + i) for i in range(steps)] for r in range(world_size)]
    torch.manual_seed(123)
    seed_state = SparseModel(tables).state_dict()
    curves = {}
    for t in tables:
        ids = [np.concatenate([b.sparse_features[f].values().numpy() for b in step for f in t.feature_names])
               for step in zip(*all_batches)]
        curves[t.name] = MissRatioCurve.from_steps(ids, t.num_embeddings, depth=max(depths))
    fused = FUSED["rowwise_adagrad"]
    plan = plan_cache_sizes(SparseModel(tables), ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused)),
                            curves, budget_bytes, max(depths), world_size, batch_size=batch_size)
    lfs = plan.load_factors
    batches = all_batches[rank]
    dmp, opt = _build(EmbeddingBagCollectionSharder(fused_params=dict(fused)), "fused", tables, seed_state)
    ref_out = _run(TrainPipelineSparseDist(dmp, opt, torch.device("cpu")), batches)
    ref = _params(dmp)
    runs = {}
    for k in depths:
        sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), debug_checks=True)
        dmp, opt = _build(sharder, "fused_uvm_caching", tables, seed_state, load_factors=lfs)
        pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=k)
        out = _run(pipe, batches)
        dmp.module.ebc.check_invariants(expect_drained=True)
        runs[k] = {"out": out, "params": _params(dmp), "stats": pipe.stats(), "sizes": dmp.module.ebc.cache_sizes()}
    base = runs[depths[0]]
    return {
        "rank": rank, "load_factors": lfs, "sizes": {k: v["sizes"] for k, v in runs.items()},
        "stats": {k: v["stats"] for k, v in runs.items()},
        "bitwise_equal_across_depths": all(
            all(torch.equal(a, b) for a, b in zip(v["out"], base["out"]))
            and all(torch.equal(v["params"][n], base["params"][n]) for n in base["params"]) for v in runs.values()),
        "max_param_diff_vs_stock": max(float((base["params"][n] - ref[n]).abs().max()) for n in ref),
        "max_out_diff_vs_stock": max(float((a - b).abs().max()) for a, b in zip(base["out"], ref_out)),
        "same_keys_as_stock": sorted(ref) == sorted(base["params"]),
    }
