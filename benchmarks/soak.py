#!/usr/bin/env python3
"""Soak test: thousands of steps with a small cache and a high miss rate, on 2 gloo ranks.

Checks, and prints as a table: resident memory stays flat (no growth of staging buffers,
queues or pins), pins return to 0 at drain, and the host tier at the end equals a resident
run (bit-identical to the plugin with a 100% cache at depth 0, and within fp32 tolerance
of stock TorchRec).

    python benchmarks/soak.py --steps 5000        # long version, by hand
    python benchmarks/soak.py --steps 300         # what CI runs (tests/test_soak.py)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any, Dict, Iterator, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def soak_rank(rank: int, world_size: int, steps: int, depth: int, load_factor: float) -> Dict[str, Any]:
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from tests.exactness_worker import _params as params
    from tests.sparse_model import SparseModel, make_batch, make_tables
    from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveTrainPipeline
    from torchrec_proactive.planning import build_plan, combined_optimizer, shard_model

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.02}
    tables = make_tables(4, rows=20_000, dim=16)
    torch.manual_seed(7)
    seed_state = SparseModel(tables).state_dict()

    def batches() -> Iterator[Any]:
        for i in range(steps):  # generated on the fly: the soak itself must not hold them
            yield make_batch(tables, 64, seed=rank * 1_000_003 + i, zipf=0.8)  # flat-ish: many misses

    def build(sharder, kernel):
        torch.manual_seed(0)
        model = SparseModel(tables)
        dmp = shard_model(model, sharder, build_plan(model, sharder, "row_wise", kernel=kernel), torch.device("cpu"))
        dmp.load_state_dict(copy.deepcopy(seed_state))
        return dmp, combined_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=0.02))

    def train(pipe, sample_every: int) -> List[float]:
        it, rss, n = batches(), [], 0
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                return rss
            n += 1
            if n % sample_every == 0:
                rss.append(_rss_mb())

    t0 = time.perf_counter()
    dmp, opt = build(ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), cache_load_factor=load_factor), "fused_uvm_caching")
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth)
    rss = train(pipe, max(steps // 10, 1))
    ebc = dmp.module.ebc
    ebc.check_invariants(expect_drained=True)
    stats = pipe.stats()
    soak_s = time.perf_counter() - t0
    pins = sum(int(t.pins.sum()) for t in ebc.named_tables().values())
    leftovers = {"engine_in_flight": ebc.fetch_engine.in_flight, "records": len(ebc.proactive_stats.records),
                 "unfinished": sum(not f.released for f in ebc._consumed), "pipeline_batches": len(pipe.batches)}
    ours = params(dmp)
    # Resident references on the same batches.
    res_dmp, res_opt = build(ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), cache_load_factor=1.0), "fused_uvm_caching")
    train(ProactiveTrainPipeline(res_dmp, res_opt, torch.device("cpu"), prefetch_depth=0), steps + 1)
    stock, stock_opt = build(EmbeddingBagCollectionSharder(fused_params=dict(fused)), "fused")
    train(TrainPipelineSparseDist(stock, stock_opt, torch.device("cpu")), steps + 1)
    resident, stock_p = params(res_dmp), params(stock)
    warm = rss[len(rss) // 5] if rss else float("nan")
    return {
        "rank": rank,
        "steps": steps,
        "soak_s": soak_s,
        "hit_rate": stats.get("hit_rate"),
        "rows_fetched": stats.get("rows_fetched"),
        "rows_written_back": stats.get("rows_written_back"),
        "rss_mb_after_warmup": warm,
        "rss_mb_end": rss[-1] if rss else float("nan"),
        "rss_growth_mb": (rss[-1] - warm) if rss else float("nan"),
        "pins_at_drain": pins,
        **leftovers,
        "bitwise_equal_to_resident": all(torch.equal(ours[k], resident[k]) for k in ours),
        "max_diff_vs_stock": max(float((ours[k] - stock_p[k]).abs().max()) for k in ours),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--cache-load-factor", type=float, default=0.1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from torchrec_proactive.launch import run_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_ranks(soak_rank, world_size=2, timeout_s=4 * 3600, steps=args.steps, depth=args.depth,
                        load_factor=args.cache_load_factor)
    keys = [k for k in results[0] if k != "rank"]
    print(f"{'':<28}" + "".join(f"{'rank ' + str(r['rank']):>16}" for r in results))
    for k in keys:
        cells = "".join(f"{(f'{r[k]:.4g}' if isinstance(r[k], float) else str(r[k])):>16}" for r in results)
        print(f"{k:<28}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    ok = all(r["pins_at_drain"] == 0 and r["bitwise_equal_to_resident"] and r["max_diff_vs_stock"] < 1e-3 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
