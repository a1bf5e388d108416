"""Rank-side code of the ``key_value`` tests (issue 42): a table planned the way TorchRec
offloads tables to SSD - compute kernel ``key_value`` with ``KeyValueParams`` - served by the
proactive sharder from the three-tier store (device cache <- DRAM host cache <- a file).

Each check builds the job the TorchRec way (tests/dropin_worker.py's helpers) and returns
plain observations; tests/test_key_value.py asserts on them.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import CacheParams, KeyValueParams, ShardingEnv, ShardingPlan

from torchrec_proactive import ProactiveTrainPipeline

from .dropin_worker import (
    DEV,
    LR,
    RW_ADAGRAD,
    batches,
    build,
    fresh,
    max_diff,
    module_plan,
    optimizer_for,
    out_diff,
    params,
    pipeline_for,
    seed_model,
    sharder_for,
    tables,
    train,
)

OPTIMIZERS = {
    "rowwise_adagrad": RW_ADAGRAD,
    "adam": {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.01, "eps": 1e-8},
    "sgd": {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
}


def _files(directory: str) -> List[str]:
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs)


def build_key_value(configs, sharding: str, fused: Dict[str, Any], world_size: int, directory: str,
                    host_cache_rows: int, seed_state=None, load_factor: float = 0.2):
    """The plugin with every table planned ``key_value`` under ``directory``: a device cache
    of ``load_factor`` and a host cache of ``host_cache_rows`` rows per table."""
    row_bytes = 4 * configs[0].embedding_dim * (3 if fused["optimizer"] == EmbOptimType.ADAM else 1) + 8
    sharder = sharder_for("ours", fused, host_cache_bytes={c.name: host_cache_rows * row_bytes for c in configs})
    model = fresh(configs)
    plan = module_plan(model.sparse, sharding, "key_value", sharder, world_size)
    for ps in plan.values():
        ps.key_value_params = KeyValueParams(ssd_storage_directory=directory)
        ps.cache_params = CacheParams(load_factor=load_factor)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), device=DEV,
                                   plan=ShardingPlan({"sparse": plan}), sharders=[sharder])
    if seed_state is not None:
        dmp.load_state_dict(copy.deepcopy(seed_state))
    return dmp, optimizer_for(dmp)


def check_against_stock(rank: int, world_size: int, sharding: str, optim: str, directory: str) -> Dict[str, Any]:
    """Stock TorchRec (``fused``, every row resident; for Adam, which FBGEMM's CPU kernels
    lack, the plugin with every row in DRAM) and ``key_value`` tables with caches far
    smaller than the tables at both levels, from the same initial state (loaded into the
    plugin through its state dict: written to the files), trained on the same batches at
    depth 2 and at depth 0. Parameters and outputs against stock; the two depths bit for bit;
    the files present while the model lives and gone after ``close``."""
    fused = OPTIMIZERS[optim]
    configs = tables(2, rows=400, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 10, rank, size=16)
    # FBGEMM's CPU kernels have no Adam: there the reference is the plugin with every row in DRAM.
    side = "ours" if optim == "adam" else "stock"
    stock, stock_opt = build(side, fresh(configs), sharding, fused, world_size, seed_state=seed)
    want = train(pipeline_for(side, stock, stock_opt), data)
    out: Dict[str, Any] = {}
    finals = {}
    # (prefetch depth, disk depth): the disk hop at the plan, and 3 batches further ahead
    for depth, disk_depth in ((2, 2), (0, 0), (1, 4)):
        name = f"depth{depth}_disk{disk_depth}"
        where = os.path.join(directory, name)
        dmp, opt = build_key_value(configs, sharding, fused, world_size, where, host_cache_rows=150, seed_state=seed)
        pipe = ProactiveTrainPipeline(dmp, opt, DEV, prefetch_depth=depth, disk_depth=disk_depth)
        got = train(pipe, data)
        finals[name] = params(dmp)
        sparse = dmp.module.sparse
        disk = [t.disk.stats() for t in sparse.named_tables().values()]
        stats = sparse.proactive_stats.snapshot()
        out[name] = {
            "param_diff": max_diff(params(stock), finals[name]),
            "out_diff": out_diff([o[1] for o in want], [o[1] for o in got]),
            "rows_read": sum(s["rows_read"] for s in disk),
            "rows_written": sum(s["rows_written"] for s in disk),
            "stage_rows_read": sum(s["stage_rows_read"] for s in disk),
            "plan_rows_hit": sum(s["plan_rows_hit"] for s in disk),
            "staged_batches": stats["staged_batches"],
            # what a user reads (table_stats) is the disk tier's own count
            "table_stats_rows_read": sum(t.get("disk_rows_read", 0) for t in sparse.table_stats().values()),
            "host_cache_rows": sorted(t["host_cache_rows"] for t in sparse.table_stats().values()),
            "files_while_alive": len(_files(where)),
        }
        sparse.close()
        dist.barrier()
        out[name]["files_after_close"] = len(_files(where))
    first = finals["depth0_disk0"]
    out["depths_bit_identical"] = all(torch.equal(f[k], first[k]) for f in finals.values() for k in first)
    return out


def check_load_mid_pipeline(rank: int, world_size: int, directory: str) -> bool:
    """A state dict taken and loaded back while batches are in flight (depth 2: their rows
    planned, fetched, pinned) applies whole to tables on disk: the run ends bit-identical to
    the same at depth 0."""
    configs = tables(2, rows=400, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 12, rank, size=16)
    finals = {}
    for depth in (2, 0):
        dmp, opt = build_key_value(configs, "table_wise", RW_ADAGRAD, world_size, os.path.join(directory, f"d{depth}"),
                                   host_cache_rows=150, seed_state=seed)
        pipe = ProactiveTrainPipeline(dmp, opt, DEV, prefetch_depth=depth)
        it = iter(data)
        for _ in range(4):
            pipe.progress(it)
        snapshot = copy.deepcopy(dmp.state_dict())  # plain tensors of the live values
        for _ in range(3):
            pipe.progress(it)
        dmp.load_state_dict(snapshot)  # with batches in flight at depth 2
        train(pipe, it)
        finals[depth] = params(dmp)
        dmp.module.sparse.close()
    return all(torch.equal(finals[2][k], finals[0][k]) for k in finals[0])
