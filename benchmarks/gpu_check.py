#!/usr/bin/env python3
"""GPU check for a lent CUDA machine (torch with CUDA; no TorchRec/FBGEMM needed).

Exercises the project's own store and fetch engine on CUDA streams with pinned staging:

1. exactness: a tiered table on CUDA trained with prefetch depth k equals the same table on
   CPU (and a resident reference) within fp32 tolerance;
2. bandwidth: cold-row gather + host-to-device through the fetch engine vs a plain pinned
   copy of the same number of bytes;
3. interference: slowdown of MLP matmuls on the compute stream while the copy stream fetches;
4. stall: a synthetic training loop (lookup + MLP + fused update) at depth 0 vs depth k.

Sized to finish in well under 5 minutes on one H100/H200; prints a short table last.
Run from the repository root:  python benchmarks/gpu_check.py [--quick] [--json out.json]
(``--device cpu`` runs the same code paths on CPU, for a dry run without a GPU; it has no
host-to-device link, so its bandwidth rows say "needs a GPU" instead of a figure.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchrec_proactive.bench.runner import HelpFormatter, int_at_least  # noqa: E402  (stdlib only)
from torchrec_proactive.fetch import FetchEngine, make_transport  # noqa: E402
from torchrec_proactive.fetch.lookahead import run_lookahead  # noqa: E402
from torchrec_proactive.store import (  # noqa: E402
    OptimizerConfig,
    OptimType,
    Segment,
    TieredTable,
    pooled_lookup,
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_tensor(shape, device: torch.device, generator=None) -> torch.Tensor:
    t = torch.randn(*shape, generator=generator)
    return t.pin_memory() if device.type == "cuda" else t


def zipf_ids(rows: int, n: int, alpha: float, g: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=g, dtype=torch.float64)
    e = 1.0 - alpha
    x = torch.exp(torch.log1p(u * ((rows + 1.0) ** e - 1.0)) / e)
    return (x.floor().long() - 1).clamp_(0, rows - 1)


def check_exactness(device: torch.device, steps: int) -> Dict[str, Any]:
    cfg = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
    rows, dim, bags, per_bag = 200_000, 64, 2048, 4
    g = torch.Generator().manual_seed(0)
    init = torch.randn(rows, dim, generator=g)
    batches = []
    for _ in range(steps):
        values = zipf_ids(rows, bags * per_bag, 1.05, g)
        batches.append((values, torch.arange(0, bags * per_bag + 1, per_bag), None, torch.randn(bags, dim, generator=g)))
    results = {}
    for name, dev, depth in (("cpu_depth0", torch.device("cpu"), 0), (f"{device.type}_depth2", device, 2)):
        host = init.clone().pin_memory() if dev.type == "cuda" else init.clone()
        # One grouped store over three tables' rows (one TorchRec group), as the kernel builds it.
        third = rows // 3
        segments = [Segment(f"t{i}", i * third, third if i < 2 else rows - 2 * third) for i in range(3)]
        table = TieredTable("t0+t1+t2", host, cfg, num_slots=40_000, device=dev, segments=segments)
        engine = FetchEngine(make_transport(dev))
        anchor = torch.empty(0, device=dev, requires_grad=True)
        outs = run_loop(table, engine, anchor, batches, depth, dev)
        engine.flush([table])  # through the copy stream, behind every ticket
        sync(dev)
        engine.close()
        results[name] = (outs, table.host_weight.clone())
    (a_out, a_w), (b_out, b_w) = results.values()
    out_diff = max(float((x - y).abs().max()) for x, y in zip(a_out, b_out))
    w_diff = float((a_w - b_w).abs().max())
    return {"max_output_diff": out_diff, "max_weight_diff": w_diff, "ok": out_diff < 1e-4 and w_diff < 1e-4}


def run_loop(table, engine, anchor, batches, depth, dev, mlp=None) -> List[torch.Tensor]:
    outs = []

    def consume(i, tb, batch):
        grad = batch[3]
        out = pooled_lookup(tb, anchor)
        if mlp is not None:
            mlp(out).square().mean().backward()
        else:
            out.backward(grad.to(dev, non_blocking=True))
        outs.append(out.detach().cpu() if mlp is None else out.detach())

    run_lookahead(table, engine, batches, depth, consume)
    return outs


def bandwidth(device: torch.device, rows: int = 2_000_000, dim: int = 128, fetch_rows: int = 262_144, reps: int = 10) -> Dict[str, float]:
    cfg = OptimizerConfig(OptimType.EXACT_SGD)
    host = host_tensor((rows, dim), device)
    g = torch.Generator().manual_seed(1)
    nbytes = fetch_rows * dim * 4
    # Plain pinned copy of the same bytes (contiguous, no gather): the link's ceiling.
    src = host[:fetch_rows].contiguous()
    src = src.pin_memory() if device.type == "cuda" else src
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    sync(device)
    plain = reps * nbytes / (time.perf_counter() - t0) / 1e9
    # Cold rows through the engine: random rows, host gather into pinned staging, H2D, scatter.
    table = TieredTable("bw", host, cfg, num_slots=fetch_rows, device=device)
    engine = FetchEngine(make_transport(device))
    times = []
    for r in range(reps + 1):
        table.invalidate()
        rows_needed = torch.randperm(rows, generator=g)[:fetch_rows].sort().values
        plan = table.plan(rows_needed)
        sync(device)
        t0 = time.perf_counter()
        engine.wait(engine.issue([plan]))
        sync(device)
        if r:
            times.append(time.perf_counter() - t0)
        table.release(plan)
    engine.close()
    gathered = nbytes / statistics.median(times) / 1e9
    if device.type != "cuda":
        # No host-to-device link: both copies stayed in host memory. Not an H2D figure.
        return {"h2d_measured": False, "plain_pinned_copy_gbps": None, "engine_gather_h2d_gbps": None, "ratio": None,
                "host_copy_gbps": plain, "engine_gather_host_gbps": gathered}
    return {"h2d_measured": True, "plain_pinned_copy_gbps": plain, "engine_gather_h2d_gbps": gathered,
            "ratio": gathered / plain}


def interference(device: torch.device, reps: int = 30) -> Dict[str, float]:
    n = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def matmuls() -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        return time.perf_counter() - t0

    matmuls()
    alone = matmuls()
    cfg = OptimizerConfig(OptimType.EXACT_SGD)
    rows, dim = 2_000_000, 128
    table = TieredTable("if", host_tensor((rows, dim), device), cfg, num_slots=rows // 2, device=device)
    engine = FetchEngine(make_transport(device))
    g = torch.Generator().manual_seed(2)
    tickets = []
    for _ in range(8):
        plan = table.plan(torch.randperm(rows, generator=g)[: rows // 16].sort().values)
        tickets.append((engine.issue([plan]), plan))
    together = matmuls()
    for ticket, plan in tickets:
        engine.wait(ticket)
        table.release(plan)
    engine.close()
    return {"matmul_alone_ms": 1e3 * alone, "matmul_while_fetching_ms": 1e3 * together, "slowdown": together / alone}


def stall(device: torch.device, steps: int, depth: int, rows: int, dim: int, bags: int, per_bag: int,
          width: int) -> Dict[str, float]:
    """Synthetic training loop (lookup + MLP + fused update): step and stall at depth 0 vs k."""
    cfg = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01)
    g = torch.Generator().manual_seed(3)
    batches = [(zipf_ids(rows, bags * per_bag, 0.9, g), torch.arange(0, bags * per_bag + 1, per_bag), None, None)
               for _ in range(steps)]
    mlp = torch.nn.Sequential(torch.nn.Linear(dim, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                              torch.nn.ReLU(), torch.nn.Linear(width, 1)).to(device)
    out: Dict[str, float] = {}
    host = host_tensor((rows, dim), device)
    warm = min(3, steps - 1)
    for k in (0, depth):
        table = TieredTable("s", host, cfg, num_slots=(k + 1) * bags * per_bag + rows // 20, device=device)
        engine = FetchEngine(make_transport(device))
        anchor = torch.empty(0, device=device, requires_grad=True)
        run_loop(table, engine, anchor, batches[:warm], k, device, mlp=mlp)
        engine.drain()
        sync(device)
        engine.stats.stall_s = 0.0
        t0 = time.perf_counter()
        run_loop(table, engine, anchor, batches[warm:], k, device, mlp=mlp)
        engine.drain()
        sync(device)
        n = steps - warm
        out[f"depth{k}_step_ms"] = 1e3 * (time.perf_counter() - t0) / n
        out[f"depth{k}_stall_ms"] = 1e3 * engine.stats.stall_s / n
        engine.close()
    out["speedup"] = out["depth0_step_ms"] / out[f"depth{depth}_step_ms"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the checks run; cpu is a dry run of the same code paths")
    p.add_argument("--quick", action="store_true", help="smaller tables and fewer steps")
    p.add_argument("--depth", type=int_at_least(1), default=2, help="prefetch depth k of the stall check (vs depth 0)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here; default: none")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: 'cuda' needs a CUDA device, and torch.cuda.is_available() is False here "
                "(use --device cpu for the dry run)")
    device = torch.device(args.device)
    t_start = time.perf_counter()
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    print(f"[gpu_check] {info}", flush=True)
    steps = 8 if args.quick else 30
    res: Dict[str, Any] = {"info": info}
    res["exactness"] = check_exactness(device, steps=6 if args.quick else 12)
    print(f"[gpu_check] exactness {res['exactness']}", flush=True)
    small = args.quick or device.type != "cuda"
    res["bandwidth"] = bandwidth(device, rows=200_000 if small else 2_000_000, fetch_rows=32_768 if small else 262_144)
    print(f"[gpu_check] bandwidth {res['bandwidth']}", flush=True)
    res["interference"] = interference(device, reps=5 if small else 30)
    print(f"[gpu_check] interference {res['interference']}", flush=True)
    if small:  # the CPU dry run keeps the same code path on a smaller table
        res["stall"] = stall(device, steps, args.depth, rows=200_000, dim=64, bags=1024, per_bag=4, width=256)
    else:
        res["stall"] = stall(device, steps, args.depth, rows=4_000_000, dim=128, bags=8192, per_bag=8, width=2048)
    res["elapsed_s"] = time.perf_counter() - t_start
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr, flush=True)
    b, i, s = res["bandwidth"], res["interference"], res["stall"]
    print("\n| check | figure |\n|---|---|")
    print(f"| exactness ({device.type} depth 2 vs CPU depth 0) | max diff {res['exactness']['max_weight_diff']:.2e} -> {'OK' if res['exactness']['ok'] else 'FAIL'} |")
    if b["h2d_measured"]:
        print(f"| plain pinned H2D copy | {b['plain_pinned_copy_gbps']:.1f} GB/s |")
        print(f"| cold-row gather + H2D (engine) | {b['engine_gather_h2d_gbps']:.1f} GB/s ({b['ratio']:.0%} of plain) |")
    else:
        print(f"| plain pinned H2D copy | needs a GPU (a {device.type} dry run has no host-to-device link) |")
        print("| cold-row gather + H2D (engine) | needs a GPU (the engine's gather path ran, host to host only) |")
    print(f"| matmul slowdown while fetching | {i['slowdown']:.2f}x |")
    print(f"| step depth 0 / depth {args.depth} | {s['depth0_step_ms']:.1f} / {s[f'depth{args.depth}_step_ms']:.1f} ms -> {s['speedup']:.2f}x |")
    print(f"| stall depth 0 / depth {args.depth} | {s['depth0_stall_ms']:.2f} / {s[f'depth{args.depth}_stall_ms']:.2f} ms/step |")
    print(f"| wall time | {res['elapsed_s']:.0f} s |")
    return 0 if res["exactness"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
