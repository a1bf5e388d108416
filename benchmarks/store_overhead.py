#!/usr/bin/env python3
"""Lookup overhead of the tiered store with a 100% cache vs ``F.embedding_bag`` on a resident table.

Both sides run in one process on the same batches, interleaved, so the ratio is robust to
machine noise. Two figures:

* ``forward``: plan (unique + row->slot) + pooled lookup through the cache, vs one
  ``F.embedding_bag`` call on the full table;
* ``train step``: the above + backward with the fused row-wise Adagrad update, vs
  ``F.embedding_bag`` + autograd + the same update applied to the gradient's rows.

    python benchmarks/store_overhead.py [--rows 1000000 --dim 64 --bags 4096 --per-bag 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchrec_proactive.fetch import FetchEngine  # noqa: E402
from torchrec_proactive.store import (  # noqa: E402
    OptimizerConfig,
    OptimType,
    TieredTable,
    apply_row_update,
    plan_table_batch,
    pooled_lookup,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bags", type=int, default=4096)
    p.add_argument("--per-bag", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    cfg = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01)
    weight = torch.randn(args.rows, args.dim, generator=g)
    momentum = torch.zeros(args.rows)
    table = TieredTable("t", weight.clone(), cfg, num_slots=args.rows)  # 100% cache
    engine = FetchEngine()
    anchor = torch.empty(0, requires_grad=True)
    n = args.bags * args.per_bag
    offsets = torch.arange(0, n + 1, args.per_bag)
    batches = [torch.randint(0, args.rows, (n,), generator=g) for _ in range(args.reps)]
    grad = torch.randn(args.bags, args.dim, generator=g)

    def resident_fwd(v):
        return F.embedding_bag(v, weight, offsets, mode="sum", include_last_offset=True)

    def store_fwd(v):
        tb = plan_table_batch(table, v, offsets)
        engine.wait(engine.issue([tb.plan]))
        with torch.no_grad():
            return pooled_lookup(tb, anchor)

    def resident_step(v):
        w = weight.detach().requires_grad_(True)
        F.embedding_bag(v, w, offsets, mode="sum", include_last_offset=True, sparse=True).backward(grad)
        g_rows = w.grad.coalesce()
        rows, row_grads = g_rows.indices()[0], g_rows.values()
        with torch.no_grad():
            wr, st = weight[rows], {"momentum1": momentum[rows]}
            apply_row_update(cfg, wr, row_grads, st, 1)
            weight[rows] = wr
            momentum[rows] = st["momentum1"]

    planned = {}

    def store_lookup_only(v):
        # the lookup itself, the batch already planned (as in the pipeline, where planning
        # happens at prefetch time)
        with torch.no_grad():
            return pooled_lookup(planned[id(v)], anchor)

    def store_step(v):
        tb = plan_table_batch(table, v, offsets)
        engine.wait(engine.issue([tb.plan]))
        pooled_lookup(tb, anchor).backward(grad)

    results = {}
    cases = {
        "lookup": (resident_fwd, store_lookup_only),
        "plan+lookup": (resident_fwd, store_fwd),
        "train step": (resident_step, store_step),
    }
    for name, (a, b) in cases.items():
        if name == "lookup":
            for v in batches:
                tbatch = plan_table_batch(table, v, offsets)
                engine.wait(engine.issue([tbatch.plan]))
                planned[id(v)] = tbatch
        ta, tb_ = [], []
        for v in batches:  # interleaved: both sides see the same machine state
            t0 = time.perf_counter()
            a(v)
            ta.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b(v)
            tb_.append(time.perf_counter() - t0)
        ra, rb = statistics.median(ta[3:]), statistics.median(tb_[3:])
        results[name] = (ra, rb)
        print(f"{name:<11} resident {1e3 * ra:7.2f} ms   store (100% cache) {1e3 * rb:7.2f} ms   ratio {rb / ra:.2f}x")
    table.check_invariants(expect_drained=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
