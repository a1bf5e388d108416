#!/usr/bin/env python3
"""Soak test: thousands of steps with a small cache and a high miss rate, on 2 gloo ranks.

Checks, and prints as a table: resident memory stays flat (no growth of staging buffers,
queues or pins), pins return to 0 at drain, and the host tier at the end equals a resident
run (bit-identical to the plugin with a 100% cache at depth 0, and within fp32 tolerance
of stock TorchRec).

    python benchmarks/soak.py --steps 5000        # long version, by hand
    python benchmarks/soak.py --steps 400         # what CI runs (tests/test_soak.py)

The last line is the verdict, ``soak: PASS ...`` or ``soak: FAIL: <each failed check>``; the
exit code is 0 on PASS, 1 on FAIL (2 for a usage error). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any, Dict, Iterator, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchrec_proactive.bench.runner import (  # noqa: E402  (stdlib-only at import)
    HelpFormatter,
    float_above,
    float_in,
    int_at_least,
    quiet_third_party,
)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def soak_rank(rank: int, world_size: int, steps: int, depth: int, load_factor: float) -> Dict[str, Any]:
    quiet_third_party()
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

    bar: Optional[Any] = None
    if rank == 0:  # one bar for the soak and its two reference runs, on stderr
        from tqdm import tqdm

        bar = tqdm(total=3 * steps, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    warm_steps = max(steps // 5, 1)  # steady state starts here (the cache is full, preload done)
    warm_stats: Dict[str, float] = {}

    def train(pipe, sample_every: int, what: str) -> List[float]:
        if bar is not None:
            bar.set_description(f"soak: {what}")
        it, rss, n = batches(), [], 0
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                return rss
            n += 1
            if bar is not None:
                bar.update(1)
            if n == warm_steps and pipe is soaked:
                warm_stats.update(pipe.stats())
            if n % sample_every == 0:
                rss.append(_rss_mb())

    t0 = time.perf_counter()
    dmp, opt = build(ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), cache_load_factor=load_factor), "fused_uvm_caching")
    pipe = soaked = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth)
    rss = train(pipe, max(steps // 10, 1), f"depth {depth}, cache {load_factor:g}")
    ebc = dmp.module.ebc
    ebc.check_invariants(expect_drained=True)
    stats = pipe.stats()
    soak_s = time.perf_counter() - t0
    pins = sum(t.pinned_slots() for t in ebc.named_tables().values())
    leftovers = {"engine_in_flight": ebc.fetch_engine.in_flight, "records": len(ebc.proactive_stats.records),
                 "unfinished": sum(not f.released for f in ebc._consumed), "pipeline_batches": len(pipe.batches)}
    ours = params(dmp)
    # Resident references on the same batches.
    res_dmp, res_opt = build(ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), cache_load_factor=1.0), "fused_uvm_caching")
    train(ProactiveTrainPipeline(res_dmp, res_opt, torch.device("cpu"), prefetch_depth=0), steps + 1,
          "resident reference (100% cache)")
    stock, stock_opt = build(EmbeddingBagCollectionSharder(fused_params=dict(fused)), "fused")
    train(TrainPipelineSparseDist(stock, stock_opt, torch.device("cpu")), steps + 1, "stock TorchRec reference")
    if bar is not None:
        bar.close()
    resident, stock_p = params(res_dmp), params(stock)
    warm = rss[len(rss) // 5] if rss else float("nan")
    return {
        "rank": rank,
        "steps": steps,
        "soak_s": soak_s,
        "hit_rate": stats.get("hit_rate"),
        "rows_fetched": stats.get("rows_fetched"),
        # misses in steady state, after the first fifth of the steps (preload and warm-up excluded)
        "rows_fetched_after_warmup": stats.get("rows_fetched", 0) - warm_stats.get("rows_fetched", 0),
        "steps_after_warmup": steps - warm_steps,
        "rows_written_back": stats.get("rows_written_back"),
        "rss_mb_after_warmup": warm,
        "rss_mb_end": rss[-1] if rss else float("nan"),
        "rss_growth_mb": (rss[-1] - warm) if rss else float("nan"),
        "pins_at_drain": pins,
        **leftovers,
        "bitwise_equal_to_resident": all(torch.equal(ours[k], resident[k]) for k in ours),
        "max_diff_vs_stock": max(float((ours[k] - stock_p[k]).abs().max()) for k in ours),
    }


def failed_checks(results: List[Dict[str, Any]], max_rss_growth_mb: float, stock_tolerance: float) -> List[str]:
    """Every check the soak makes, per rank: the failures (empty list: PASS)."""
    out = []
    for r in results:
        checks = [
            (r["rows_fetched_after_warmup"] >= r["steps_after_warmup"],
             f"rows_fetched_after_warmup {r['rows_fetched_after_warmup']} < {r['steps_after_warmup']} steps: the "
             f"soak (nearly) never missed the cache in steady state, so it tested no fetch"),
            (r["hit_rate"] is not None and 0.0 <= r["hit_rate"] <= 1.0, f"hit_rate {r['hit_rate']} outside [0, 1]"),
            (r["pins_at_drain"] == 0, f"pins_at_drain {r['pins_at_drain']} != 0"),
            (r["engine_in_flight"] == 0, f"engine_in_flight {r['engine_in_flight']} != 0"),
            (r["unfinished"] == 0, f"unfinished {r['unfinished']} != 0"),
            (r["records"] == 0, f"records {r['records']} != 0"),
            (r["pipeline_batches"] == 0, f"pipeline_batches {r['pipeline_batches']} != 0"),
            (r["rss_growth_mb"] <= max_rss_growth_mb,
             f"rss_growth_mb {r['rss_growth_mb']:.1f} > {max_rss_growth_mb:g} (--max-rss-growth-mb)"),
            (r["bitwise_equal_to_resident"], "bitwise_equal_to_resident is False"),
            (r["max_diff_vs_stock"] < stock_tolerance,
             f"max_diff_vs_stock {r['max_diff_vs_stock']:.3g} >= {stock_tolerance:g} (--stock-tolerance)"),
        ]
        out += [f"rank {r['rank']} {msg}" for ok, msg in checks if not ok]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int_at_least(1), default=5000, help="training steps of the soak")
    p.add_argument("--depth", type=int_at_least(0), default=2, help="prefetch depth of the soaked pipeline")
    p.add_argument("--cache-load-factor", type=float_in(0.0, 1.0), default=0.1,
                   help="device cache size as a fraction of each table's rows (small: many misses)")
    p.add_argument("--max-rss-growth-mb", type=float_above(0.0), default=32.0,
                   help="FAIL when resident memory grows more than this after warm-up")
    p.add_argument("--stock-tolerance", type=float_above(0.0), default=1e-4,
                   help="FAIL when the parameters differ from stock TorchRec by this much or more")
    p.add_argument("--json", default=None, metavar="PATH", help="write the per-rank results here; default: none")
    args = p.parse_args()
    quiet_third_party()
    from torchrec_proactive.launch import RankFailure, run_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        results = run_ranks(soak_rank, world_size=2, timeout_s=4 * 3600, steps=args.steps, depth=args.depth,
                            load_factor=args.cache_load_factor)
    except RankFailure as e:
        print(f"soak: FAIL: {getattr(e, 'user_message', None) or e}", flush=True)
        return 1
    keys = [k for k in results[0] if k != "rank"]
    print(f"{'':<28}" + "".join(f"{'rank ' + str(r['rank']):>16}" for r in results))
    for k in keys:
        cells = "".join(f"{(f'{r[k]:.4g}' if isinstance(r[k], float) else str(r[k])):>16}" for r in results)
        print(f"{k:<28}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr, flush=True)
    failed = failed_checks(results, args.max_rss_growth_mb, args.stock_tolerance)
    if failed:
        print(f"soak: FAIL: {'; '.join(failed)}", flush=True)
        return 1
    print(f"soak: PASS ({args.steps} steps on {len(results)} ranks: memory flat, nothing left pinned or in flight, "
          f"bit-identical to a resident run, within {args.stock_tolerance:g} of stock TorchRec)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
