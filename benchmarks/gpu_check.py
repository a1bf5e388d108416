#!/usr/bin/env python3
"""GPU check for a lent CUDA machine (torch with CUDA; no TorchRec/FBGEMM needed).

Drives the project's own device-side store (``TieredTable`` with its ``DevicePlanner``: planning, lookup and
fused update on the GPU with no host synchronisation) and fetch engine (copy stream, pinned
staging) the way the TorchRec kernel does, and reports what a GPU user cares about:

1. ``bit_identical_across_depths``: parameters after the same batches at depths 0, 1, 2, 4
   and 8 are bitwise equal, every depth with the *same* cache - once with a cache that
   holds several batches and once with one so small that prefetches wait and rows overflow;
2. ``host_syncs_per_step``: synchronisations in the steady state (CUDA:
   ``torch.cuda.set_sync_debug_mode("warn")``, counted on every thread but the fetch
   worker's - autograd's device thread runs the backward there - from the end of the
   warm-up to the end of the last step, never in the flush and drain after the loop, which
   wait on purpose; CPU: the same steps on fake CUDA tensors under ``sync_detector``);
3. ``host_steps_ahead_of_gpu``: whole training steps the host enqueues while a 200 ms
   ``torch.cuda._sleep`` holds the compute stream (the check no event or thread wait can
   fool: with none, the host gets at least ``depth`` steps ahead); null on CPU;
4. ``gpu_stall_ms_per_step``: per depth, how long the compute stream sat waiting for rows,
   from CUDA events recorded where the stream asks for them, before the host blocks;
5. ``fetch_fraction_of_pinned_copy``: the engine's fetch (host gather from the pinned tier
   and host-to-device; ids drawn, uploaded and planned before the clock) vs a plain pinned
   copy of the same bytes;
6. ``compute_slowdown_while_fetching``: matmuls on the compute stream alone vs while the
   copy stream fetches, the fetches issued after the timed region starts (planned before
   it), so that their moves run during the matmuls; ``fetches_overlapped_matmuls`` says
   whether they did (no device-wide synchronize in between, which would drain it);
7. ``plan_ms_per_step_by_ids``: device planning time per step at 25k, 250k and 2M ids per
   rank (Zipf ids) on a warm cache big enough not to overflow (CUDA: 50M slots), from CUDA
   events; ``plan_ms_per_step_by_ids_in_flight`` the same with 2 batches in flight, and
   ``update_ms_per_step_by_ids`` the backward with the fused update (dim 128 on CUDA), from
   whole training steps at depth 2;
8. ``plan_launches_per_group_step``, ``update_launches_per_group_step`` and
   ``plan_ops_identical_across_cache_sizes``: kernel launches of one group's plan and of its
   backward with the fused update (row-wise Adagrad), and whether planning, lookup and update issue the same ops
   touching the same bytes at 1M and 10M slots (a counting dispatch mode over fake CUDA
   tensors, graph capture off: the same on any machine); ``update_bytes_per_group_step``
   at ``update_ids`` x ``dim`` (2M x 128), the plan's sizes landed;
9. ``per_table_bounds_ok``: an id past its own table (inside the group's row space) is
   counted on the device;
10. ``host_tier_bytes_ratio``: host bytes of the TorchRec path (``from_stock``) over table
   + optimizer state (null without TorchRec); ``plan_graph_cache_bytes``: device memory
   of the plan graphs' cache; ``move_grid_blocks_max``: the largest grid of a row move.
11. ``disk_bit_identical``: a table on disk (``TieredTable.on_disk``: device cache <- host
   cache <- an ``O_DIRECT`` file, planned on the host, moved by the copy stream's worker
   through pinned staging) trains bit-identically to the same table in host memory, at depths
   0, 1 and 2 (the last with its disk reads staged 4 batches ahead), with a device cache below
   one batch's rows (overflow) and a host cache far below the table; its disk counters and
   stall per step are reported beside.

Under 5 minutes on one H100/H200. ``--device cpu`` runs the same code paths on CPU (no
host-to-device link: its bandwidth and host-lead figures are null; its planning sizes stop
at 250k).
Run from the repository root:  python benchmarks/gpu_check.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import warnings
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchrec_proactive.fetch import FetchEngine, make_transport  # noqa: E402
from torchrec_proactive.fetch.lookahead import run_lookahead  # noqa: E402
from torchrec_proactive.store import (  # noqa: E402
    OptimizerConfig,
    OptimType,
    Segment,
    TieredTable,
    plan_device_batch,
    pooled_lookup,
)
from torchrec_proactive.store import lookup as lookup_module  # noqa: E402
from torchrec_proactive.store.row_moves import MOVE_STATS, reset_move_stats  # noqa: E402
from torchrec_proactive.store.sync_detector import HostSyncError, fake_cuda  # noqa: E402

DEPTHS = (0, 1, 2, 4, 8)


def device_table(*args: Any, **kwargs: Any) -> TieredTable:
    """A table planned on its device (what this check measures)."""
    return TieredTable(*args, planner="device", **kwargs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory() if device.type == "cuda" else t


def zipf_ids(rows: int, n: int, alpha: float, g: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=g, dtype=torch.float64)
    e = 1.0 - alpha
    x = torch.exp(torch.log1p(u * ((rows + 1.0) ** e - 1.0)) / e)
    return (x.floor().long() - 1).clamp_(0, rows - 1)


class SyncCounter:
    """Counts the CUDA sync warnings raised on every thread but the fetch worker's (whose job
    is to wait): the training thread's and autograd's device thread's, where CUDA runs the
    backward and its fused update. Only a hint: ``set_sync_debug_mode`` sees neither event nor
    thread waits, which ``host_steps_ahead_of_gpu`` measures."""

    WORKER = "proactive-fetch"

    def __init__(self, cuda: bool = True) -> None:
        self.count = 0
        self.cuda = cuda  # (False: warnings raised by the caller stand for CUDA's; tests)
        self._thread = threading.get_ident()

    def __enter__(self) -> "SyncCounter":
        self._old = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if "synchroniz" in str(message) and threading.current_thread().name != self.WORKER:
                self.count += 1

        warnings.showwarning = show
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.simplefilter("always")
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self._filters.__exit__(*exc)
        warnings.showwarning = self._old


def make_batches(steps: int, rows: int, bags: int, per_bag: int, dim: int, device: torch.device, seed: int) -> List[Any]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        values = zipf_ids(rows, bags * per_bag, 1.05, g).to(device)
        offsets = torch.arange(0, bags * per_bag + 1, per_bag).to(device)
        out.append((values, offsets, None, torch.randn(bags, dim, generator=g).to(device)))
    return out


def train(device: torch.device, init: torch.Tensor, slots: int, depth: int, batches: List[Any],
          on_step: Callable[[int], None] = lambda i: None) -> Dict[str, Any]:
    """The kernel's schedule on one grouped store: batch i + depth planned before batch i is used."""
    rows = init.shape[0]
    third = rows // 3
    segments = [Segment(f"t{i}", i * third, third if i < 2 else rows - 2 * third) for i in range(3)]
    table = device_table("t0+t1+t2", host_tensor(init.clone(), device),
                              OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05),
                              num_slots=slots, device=device, segments=segments)
    engine = FetchEngine(make_transport(device))
    anchor = torch.empty(0, device=device, requires_grad=True)

    def consume(i: int, tb: Any, batch: Any) -> None:
        pooled_lookup(tb, anchor).backward(batch[3])
        on_step(i)

    run_lookahead(table, engine, batches, depth, consume)
    engine.flush([table])
    engine.drain()
    sync(device)
    stall = getattr(engine.transport, "gpu_stall_s", engine.stats.stall_s)
    result = {"weight": table.host_weight.clone(), "state": table.host_state["momentum1"].clone(),
              "stall_ms_per_step": 1e3 * stall / len(batches), "overflow_rows": table.stats.overflow_rows,
              "host_syncs_of_overflow": table.planner.host_syncs, "deferrals": table.planner.deferrals}
    engine.close()
    return result


def exactness(device: torch.device, quick: bool) -> Dict[str, Any]:
    rows, dim, bags, per_bag = (200_000, 64, 2048, 4) if not quick else (50_000, 32, 512, 4)
    steps = 10 if not quick else 6
    init = torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))
    batches = make_batches(steps, rows, bags, per_bag, dim, device, seed=1)
    report: Dict[str, Any] = {}
    for label, slots in (("roomy", 9 * bags * per_bag), ("tiny", bags * per_bag // 8)):
        runs = {k: train(device, init, slots, k, batches) for k in DEPTHS}
        first = runs[DEPTHS[0]]
        report[label] = {
            "slots": slots,
            "bit_identical": all(torch.equal(r["weight"], first["weight"]) and torch.equal(r["state"], first["state"])
                                 for r in runs.values()),
            "overflow_rows": {k: r["overflow_rows"] for k, r in runs.items()},
            # (an overflow plan reads its sizes: one host read, at a batch's own lookup only)
            "overflow_plans": {k: r["host_syncs_of_overflow"] for k, r in runs.items()},
            "prefetch_deferrals": {k: r["deferrals"] for k, r in runs.items()},
            "gpu_stall_ms_per_step": {k: r["stall_ms_per_step"] for k, r in runs.items()},
        }
    report["bit_identical_across_depths"] = all(v["bit_identical"] for v in report.values() if isinstance(v, dict))
    return report


def host_syncs(device: torch.device, quick: bool) -> Dict[str, Any]:
    """Synchronisations of the training thread per steady-state step."""
    rows, dim, bags, per_bag, steps = 200_000, 64, 2048, 4, 12
    if device.type == "cpu":
        errors = 0
        with fake_cuda():
            table = device_table("t", torch.randn(rows, dim), OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD),
                                      num_slots=rows // 10, device="cuda")
            for _ in range(steps):
                ids = torch.randint(0, rows, (bags * per_bag,), device="cuda")
                try:
                    tb = plan_device_batch(table, ids, torch.arange(0, bags * per_bag + 1, per_bag, device="cuda"))
                    out = lookup_module.pool_group([tb], [None])[0]
                    lookup_module.update_group([tb], [None], [torch.ones_like(out)], [])
                except HostSyncError:
                    errors += 1
        return {"host_syncs_per_step": errors / steps, "how": "fake CUDA tensors under sync_detector"}
    counted = count_syncs(device, SyncCounter())
    return {**counted, "how": "torch.cuda.set_sync_debug_mode('warn') on every thread but the fetch worker"}


def count_syncs(device: torch.device, counter: SyncCounter, steps: int = 12, warm: int = 4) -> Dict[str, Any]:
    """Synchronisations ``counter`` sees per steady-state step of ``train`` at depth 2: from
    the end of step ``warm - 1`` to the end of the last step. The window closes there,
    before the flush and the drain that follow the loop: those wait on purpose (a drain
    reads every plan's sizes on the host), and no training step waits for them."""
    rows, dim, bags, per_bag = 200_000, 64, 2048, 4
    batches = make_batches(steps, rows, bags, per_bag, dim, device, seed=2)
    init = torch.randn(rows, dim)
    window = {"open": False, "closed_at_step": None}

    def on_step(i: int) -> None:
        if i == warm - 1:
            counter.__enter__()
            window["open"] = True
        elif i == steps - 1 and window["open"]:
            counter.__exit__(None, None, None)
            window["open"], window["closed_at_step"] = False, i

    try:
        train(device, init, 6 * bags * per_bag, 2, batches, on_step)
    finally:
        if window["open"]:
            counter.__exit__(None, None, None)
    return {"host_syncs_per_step": counter.count / (steps - warm), "steps_counted": steps - warm,
            "window_closed_before_flush": window["closed_at_step"] == steps - 1}


def bandwidth(device: torch.device, quick: bool) -> Dict[str, Any]:
    rows, dim = (2_000_000, 128) if device.type == "cuda" and not quick else (200_000, 64)
    fetch_rows = rows // 8
    host = host_tensor(torch.randn(rows, dim), device)
    nbytes = fetch_rows * dim * 4
    src = host_tensor(host[:fetch_rows].contiguous(), device)
    dst = torch.empty_like(src, device=device)

    def timed(fn: Callable[[], None], reps: int = 5) -> float:
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / reps

    plain = timed(lambda: dst.copy_(src, non_blocking=True))
    table = device_table("bw", host, OptimizerConfig(), num_slots=fetch_rows, device=device)
    engine = FetchEngine(make_transport(device))
    g = torch.Generator().manual_seed(3)
    reps = 5
    # The ids are drawn and uploaded, and each fetch planned, before its clock starts: the
    # figure is the engine's move alone (host gather from the pinned tier, copy, scatter).
    ids = [torch.randperm(rows, generator=g)[:fetch_rows].to(device) for _ in range(reps + 1)]
    offsets = torch.arange(fetch_rows + 1, device=device)
    times = []
    for rep_ids in ids:
        table.invalidate()
        tb = plan_device_batch(table, rep_ids, offsets)
        sync(device)
        t0 = time.perf_counter()
        engine.wait(engine.issue([tb.plan]))
        sync(device)
        times.append(time.perf_counter() - t0)
        table.release(tb.plan)
    gathered = sorted(times[1:])[len(times[1:]) // 2]
    engine.close()
    if device.type != "cuda":
        return {"fetch_fraction_of_pinned_copy": None, "note": "no host-to-device link on CPU"}
    return {"fetch_fraction_of_pinned_copy": plain / gathered, "plain_pinned_copy_gbps": nbytes / plain / 1e9,
            "engine_gather_h2d_gbps": nbytes / gathered / 1e9}


def interference(device: torch.device, quick: bool) -> Dict[str, Any]:
    """Matmuls on the compute stream alone, then again while the copy stream moves six
    tickets' rows. Everything a fetch needs but its moves (ids drawn and uploaded, plans
    made) is done before the clock; the fetches are issued *after* the timed region starts
    (``start.record()``), so their moves overlap the matmuls instead of finishing before
    them. The check says whether they did: ``fetches_issued_in_timed_region`` and, on CUDA,
    when the copy stream finished, from an event recorded behind the moves."""
    n = 8192 if device.type == "cuda" else 384
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    reps = 20 if device.type == "cuda" else 4

    def matmuls(during: Callable[[], Any] = lambda: None) -> Dict[str, Any]:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fetched = during()  # (enqueues the moves on the copy stream, behind start)
            for _ in range(reps):
                a @ b
            end.record()
            end.synchronize()  # only this stream's events: the copy stream keeps running
            out = {"ms": start.elapsed_time(end)}
            if fetched is not None:
                fetched.synchronize()
                out["fetch_done_ms_after_start"] = start.elapsed_time(fetched)
            return out
        t0 = time.perf_counter()
        during()
        for _ in range(reps):
            a @ b
        return {"ms": 1e3 * (time.perf_counter() - t0)}

    matmuls()
    alone = matmuls()["ms"]
    rows, dim = (2_000_000, 128) if device.type == "cuda" else (200_000, 64)
    table = device_table("if", host_tensor(torch.randn(rows, dim), device), OptimizerConfig(),
                              num_slots=rows // 2, device=device)
    engine = FetchEngine(make_transport(device))
    g = torch.Generator().manual_seed(4)
    plans = []
    for _ in range(6):  # (before the clock: ids drawn, uploaded and planned)
        ids = host_tensor(torch.randperm(rows, generator=g)[: rows // 16], device).to(device, non_blocking=True)
        plans.append(plan_device_batch(table, ids, torch.arange(ids.shape[0] + 1, device=device)).plan)
    sync(device)
    tickets: List[Any] = []

    def fetch() -> Any:
        for plan in plans:
            tickets.append(engine.issue([plan]))
        if device.type == "cuda":
            done = torch.cuda.Event(enable_timing=True)
            done.record(engine.transport.copy_stream)  # (behind every move just enqueued)
            return done
        return None

    together = matmuls(fetch)
    for ticket, plan in zip(tickets, plans):
        engine.wait(ticket)
        table.release(plan)
    engine.close()
    out = {"matmul_alone_ms": alone, "matmul_while_fetching_ms": together["ms"],
           "compute_slowdown_while_fetching": together["ms"] / alone - 1.0,
           "fetches_issued_in_timed_region": len(tickets), "tickets": len(plans)}
    if "fetch_done_ms_after_start" in together:
        out["fetch_done_ms_after_start"] = together["fetch_done_ms_after_start"]
        # The moves ran while the matmuls did (they ended inside the timed region).
        out["fetches_overlapped_matmuls"] = together["fetch_done_ms_after_start"] <= together["ms"]
    return out


class _Spans:
    """Durations of code spans on the device's timeline: CUDA events around each span
    (read once everything ran), or the host's clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: List[Any] = []
        self.ms: List[float] = []

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self._pending.append((start, end))
                return out
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.ms.append(1e3 * (time.perf_counter() - t0))
            return out
        return run

    def collect(self) -> List[float]:
        sync(self.device)
        self.ms.extend(start.elapsed_time(end) for start, end in self._pending)
        self._pending.clear()
        return self.ms


def _median(xs: List[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def steady_steps(device: torch.device, rows: int, dim: int, slots: int, n: int, depth: int, steps: int,
                 seed: int) -> Dict[str, Any]:
    """Training steps of ``n`` Zipf ids (one per bag) at ``depth`` batches in flight, with
    the fetch engine's moves, the lookup and the backward with the fused row-wise Adagrad:
    per step, the time of the plan (``k`` batches in flight: its victim window covers their
    pins too) and of the backward with the update, after ``depth + 2`` warm-up steps."""
    table = device_table("steps", host_tensor(torch.zeros(rows, dim), device),
                         OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01),
                         num_slots=slots, device=device)
    engine = FetchEngine(make_transport(device))
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(n + 1, device=device)
    batches = [(zipf_ids(rows, n, 1.05, g).to(device), offsets, None, None) for _ in range(steps)]
    grad = torch.ones(n, dim, device=device)
    anchor = torch.empty(0, device=device, requires_grad=True)
    plans, updates = _Spans(device), _Spans(device)
    table.plan_ids = plans.timed(table.plan_ids)  # type: ignore[method-assign]
    backward = updates.timed(lambda out: out.backward(grad))
    run_lookahead(table, engine, batches, depth, lambda i, tb, batch: backward(pooled_lookup(tb, anchor)))
    engine.drain()
    warm = depth + 2
    planner = table.planner
    out = {"plan_ms": _median(plans.collect()[warm:]), "update_ms": _median(updates.collect()[warm:]),
           "updates_on_unique_rows": planner.updates_unique, "updates_padded": planner.updates_padded,
           "plan_graph_cache_bytes": planner.graphs.memory_bytes(), "plan_graph_evictions": planner.graphs.evictions,
           "plan_graph_captures": planner.graphs.captures, "prefetch_deferrals": planner.deferrals,
           "unsized_in_flight_max": planner.unsized_in_flight_max, "overflow_plans": planner.overflow_plans}
    engine.close()
    return out


def planning(device: torch.device, quick: bool) -> Dict[str, Any]:
    """Device planning time per step by ids per rank, on a cache big enough that no batch
    overflows (an overflow plan reads its sizes on the host: another path), kept warm (no
    invalidation between steps: the steady state), from CUDA events; then whole steps at
    depth 2 (two batches in flight while each is planned), timing the plan and the backward
    with the fused update, the step's largest cost (``update_ms_per_step_by_ids``, dim 128
    on CUDA)."""
    sizes = [25_000, 250_000, 2_000_000] if device.type == "cuda" else [25_000, 250_000]
    if device.type == "cuda" and not quick:
        rows, slots, dim = 60_000_000, 50_000_000, 4  # the issue's target: 2M ids, a 50M-slot cache
    elif device.type == "cuda":
        rows, slots, dim = 8_000_000, 4_000_000, 4
    else:
        rows, slots, dim = 800_000, 400_000, 8
    table = device_table("plan", host_tensor(torch.zeros(rows, dim), device), OptimizerConfig(),
                              num_slots=slots, device=device)
    g = torch.Generator().manual_seed(5)
    out: Dict[str, float] = {}
    for n in sizes:
        batches = [zipf_ids(rows, n, 1.05, g).to(device) for _ in range(5)]
        times = []
        for ids in batches:
            sync(device)
            t0 = time.perf_counter()
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            assert table.planner.surely_fits(n), (n, slots)  # (no overflow: see the docstring)
            plan = table.plan_ids(ids)
            if device.type == "cuda":
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                times.append(1e3 * (time.perf_counter() - t0))
            table.release(plan)
        # (the first plan of a size runs eagerly and the second captures its graph on CUDA)
        out[str(n)] = sorted(times[2:])[len(times[2:]) // 2]
    depth = 2
    step_sizes = sizes if device.type == "cuda" else [25_000]
    step_rows, step_dim = ((20_000_000 if not quick else 4_000_000), 128) if device.type == "cuda" else (200_000, 8)
    in_flight: Dict[str, float] = {}
    update: Dict[str, float] = {}
    narrowed: Dict[str, Any] = {}
    graph_bytes = table.planner.graphs.memory_bytes()
    for n in step_sizes:
        r = steady_steps(device, step_rows, step_dim, min(step_rows, (depth + 2) * n), n, depth, 8, seed=7)
        in_flight[str(n)], update[str(n)] = r["plan_ms"], r["update_ms"]
        narrowed[str(n)] = {"unique_rows": r["updates_on_unique_rows"], "padded": r["updates_padded"],
                            "plan_graph_captures": r["plan_graph_captures"],
                            "plan_graph_evictions": r["plan_graph_evictions"],
                            "prefetch_deferrals": r["prefetch_deferrals"],
                            "unsized_in_flight_max": r["unsized_in_flight_max"], "overflow_plans": r["overflow_plans"]}
        graph_bytes = max(graph_bytes, r["plan_graph_cache_bytes"])
    return {"plan_ms_per_step_by_ids": out, "store_rows": rows, "cache_slots": slots,
            "plan_graph_captures": table.planner.graphs.captures, "plan_graph_replays": table.planner.graphs.replays,
            "plan_ms_per_step_by_ids_in_flight": in_flight, "in_flight_depth": depth,
            "update_ms_per_step_by_ids": update, "update_dim": step_dim, "update_optimizer": "exact_row_wise_adagrad",
            "updates_by_ids": narrowed, "plan_graph_cache_bytes": graph_bytes}


def _counted_steps(n: int, dim: int, rows: int, slots: int, optimizer: OptimType, steps: int = 3,
                   unique: Any = None) -> Any:
    """The phases of the last of ``steps`` steps (plan, lookup, update), counted on fake CUDA
    tensors through the planner, the lookup and the fused update. ``unique``: the batch's
    unique rows, handed to each plan before its backward as the copy of its sizes does on a
    GPU once it has landed (the steady state at depth >= 1); None: never (depth 0). Graph
    capture is off: a graph of fake tensors would replay nothing and count nothing (the
    planner's PlanGraphs also never captures fake tensors)."""
    from torchrec_proactive.store.cost_counter import CostCounter
    from torchrec_proactive.store.row_space import device_store_rows
    import numpy as np

    starts = np.array([0, rows // 2], dtype=np.int64)
    counter = CostCounter()
    with fake_cuda() as guard:
        with guard.setup():
            table = device_table("costs", torch.empty(rows, dim), OptimizerConfig(optimizer), num_slots=slots,
                                 device="cuda", segments=[Segment("a", 0, rows // 2),
                                                          Segment("b", rows // 2, rows - rows // 2)])
            table.planner.graphs.capture = False
            start_dev = torch.tensor(starts.tolist(), device="cuda")
            rows_dev = torch.tensor([rows // 2, rows - rows // 2], device="cuda")
        with counter:
            for _ in range(steps):
                counter.reset()
                values = torch.empty(n, dtype=torch.int64, device="cuda")
                offsets = torch.arange(0, n + 1, 2, device="cuda")
                with counter.phase("plan"):
                    ids = device_store_rows(values, offsets, n // 4, starts, start_dev, rows_dev)
                    tb = plan_device_batch(table, ids, offsets)
                with counter.phase("lookup"):
                    out = lookup_module.pool_group([tb], [None])[0]
                grad_out = torch.ones_like(out)  # (autograd's, before the backward runs)
                if unique is not None:
                    tb.plan.take_sizes((unique, unique, 0, 0))
                with counter.phase("update"):
                    lookup_module.update_group([tb], [None], [grad_out], [])
    return counter.phases, table


def plan_costs(device: torch.device, quick: bool) -> Dict[str, Any]:
    """Launches, ops and bytes per group per step, counted on fake CUDA tensors (any machine:
    nothing runs) through the planner, the lookup and the fused update, at 1M and 10M slots
    for the same ids: a plan's cost must follow its ids, never the cache. Then the update
    (the backward with the fused row-wise Adagrad) at 2M Zipf ids x 128, its plan's sizes
    landed (``update_bytes_per_group_step``) and not (``..._sizes_unknown``: depth 0)."""
    n, rows, dim = 8192, 20_000_000, 16
    runs = {slots: _counted_steps(n, dim, rows, slots, OptimType.EXACT_ROWWISE_ADAGRAD)[0]
            for slots in (1_000_000, 10_000_000)}
    small, large = runs[1_000_000], runs[10_000_000]
    update_ids, update_dim = 2_000_000, 128
    unique = int(torch.unique(zipf_ids(rows, update_ids, 1.05, torch.Generator().manual_seed(0))).numel())
    landed, _ = _counted_steps(update_ids, update_dim, rows, 5_000_000, OptimType.EXACT_ROWWISE_ADAGRAD,
                               unique=unique)
    unknown, _ = _counted_steps(update_ids, update_dim, rows, 5_000_000, OptimType.EXACT_ROWWISE_ADAGRAD)
    return {
        "plan_launches_per_group_step": small["plan"].launches,
        "update_launches_per_group_step": small["update"].launches,
        "plan_ops_identical_across_cache_sizes": all(small[k].key() == large[k].key() for k in small),
        "per_phase": {k: {"ops": v.ops, "launches": v.launches, "bytes": v.bytes,
                          "largest_temporary_bytes": v.largest_temporary} for k, v in small.items()},
        "ids_per_step": n,
        "update_bytes_per_group_step": landed["update"].bytes, "update_ids": update_ids, "dim": update_dim,
        "update_unique_rows": unique, "update_launches_at_update_ids": landed["update"].launches,
        "update_bytes_per_group_step_sizes_unknown": unknown["update"].bytes,
        "update_optimizer": OptimType.EXACT_ROWWISE_ADAGRAD.value,
        "how": "fake CUDA tensors under a counting dispatch mode (capture off), 1M vs 10M slots",
    }


def per_table_bounds(device: torch.device, quick: bool) -> Dict[str, Any]:
    """Stores [0,100) = A and [100,300) = B: id 150 of A (B's row 50 in the group's row space)
    is counted on the device and trains no row."""
    from torchrec_proactive.store.row_space import device_store_rows
    import numpy as np

    table = device_table("A+B", host_tensor(torch.zeros(300, 8), device), OptimizerConfig(), num_slots=300,
                              device=device, segments=[Segment("A", 0, 100), Segment("B", 100, 200)])
    starts = np.array([0, 100], dtype=np.int64)
    values = torch.tensor([150, 3, 5, 199], device=device)
    offsets = torch.arange(5, device=device)
    ids = device_store_rows(values, offsets, 2, starts, torch.tensor([0, 100], device=device),
                            torch.tensor([100, 200], device=device))
    tb = plan_device_batch(table, ids, offsets)
    table.release(tb.plan)
    # Polls never wait: on CUDA the first one queues the count's read-back and a later one,
    # once that copy has passed its event, returns it; on CPU the first one has it.
    counted = table.planner.bad_ids.poll()
    for _ in range(2):
        sync(device)
        counted += table.planner.bad_ids.poll()
    return {"bad_ids_counted": counted, "per_table_bounds_ok": counted == 1}


def host_tier(device: torch.device, quick: bool) -> Dict[str, Any]:
    """``host_tier_bytes_ratio``: host bytes the TorchRec path holds for a group's tier (the
    rows FBGEMM allocated + what ``from_stock`` allocates) over rows + optimizer state at
    their exact size, counted on fake CUDA tensors with FBGEMM's host-mapped memory
    modelled (``integration/host_tier_probe.py``); null where TorchRec is not installed."""
    try:
        from torchrec_proactive.integration.host_tier_probe import from_stock_host_bytes
    except ImportError as e:
        return {"host_tier_bytes_ratio": None, "note": f"needs TorchRec and FBGEMM ({e})"}
    r = from_stock_host_bytes("adam")
    return {k: v for k, v in r.items() if k != "how"} | {"how": r["how"]}


def disk_tier(device: torch.device, quick: bool) -> Dict[str, Any]:
    """``disk_bit_identical``: the same batches through a table on disk and through the same
    table in host memory (both planned on the host: a disk table's rows are read there), at
    depths 0, 1 and 2 (disk depth 4); every row's weight and state compared bitwise."""
    import tempfile

    from torchrec_proactive.store import disk_record_bytes

    rows, dim, bags, per_bag = (100_000, 64, 1024, 4) if not quick else (20_000, 32, 256, 4)
    steps = 12 if not quick else 8
    config = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
    init = torch.randn(rows, dim, generator=torch.Generator().manual_seed(7))
    batches = make_batches(steps, rows, bags, per_bag, dim, device, seed=8)
    slots = bags * per_bag // 2  # below one batch's rows: some overflow to the host tier
    host_rows = rows // 8

    def run(table: TieredTable, depth: int, disk_depth: Any = None) -> Dict[str, Any]:
        engine = FetchEngine(make_transport(device))
        anchor = torch.empty(0, device=device, requires_grad=True)
        t0 = time.perf_counter()
        run_lookahead(table, engine, batches, depth,
                      lambda i, tb, batch: pooled_lookup(tb, anchor).backward(batch[3]), disk_depth=disk_depth)
        engine.flush([table])
        engine.drain()
        sync(device)
        elapsed = time.perf_counter() - t0
        stall = getattr(engine.transport, "gpu_stall_s", engine.stats.stall_s)
        engine.close()
        # (the training's own disk traffic; the initial writes included, the read below not)
        disk = None if table.disk is None else {k: table.disk.stats()[k] for k in ("row_misses", "rows_written")}
        flat = [v.reshape(rows, -1) for v in table.read_host_rows(0, rows)]
        return {"values": flat, "ms_per_step": 1e3 * elapsed / steps, "stall_ms_per_step": 1e3 * stall / steps,
                "overflow_rows": table.stats.overflow_rows,
                "disk": disk}

    want = run(TieredTable("t", host_tensor(init.clone(), device), config, num_slots=slots, device=device), depth=1)
    report: Dict[str, Any] = {"rows": rows, "device_slots": slots, "host_cache_rows": host_rows, "by_depth": {}}
    same = True
    with tempfile.TemporaryDirectory(prefix="gpu-check-disk-") as directory:
        for depth, disk_depth in ((0, None), (1, None), (2, 4)):
            table = TieredTable.on_disk("t", rows, dim, config, num_slots=slots, directory=directory,
                                        host_cache_bytes=host_rows * disk_record_bytes(dim, config),
                                        initial_weight=init, device=device)
            try:
                got = run(table, depth, disk_depth)
                report["o_direct"] = bool(table.disk.file.o_direct)
            finally:
                table.close()
            ok = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got["values"], want["values"]))
            same = same and ok
            report["by_depth"][f"{depth}/{disk_depth or depth}"] = {
                "bit_identical": ok, "ms_per_step": got["ms_per_step"], "stall_ms_per_step": got["stall_ms_per_step"],
                "overflow_rows": got["overflow_rows"], **got["disk"]}
    report["host_memory_ms_per_step"] = want["ms_per_step"]
    report["disk_bit_identical"] = same
    return report


def host_lead(device: torch.device, quick: bool) -> Dict[str, Any]:
    """``host_steps_ahead_of_gpu``: a ~200 ms ``torch.cuda._sleep`` is queued on the compute
    stream, then the host runs whole training steps (plan, lookup, backward with the fused
    update, fetch issue); counted: the steps the host finished before the sleep ended. With
    no wait anywhere (threads, events, autograd's device thread) it gets ahead by more than
    the prefetch depth; any hidden synchronisation stops it at the sleep."""
    depth = 2
    if device.type != "cuda":
        return {"host_steps_ahead_of_gpu": None, "depth": depth, "note": "needs a GPU"}
    rows, dim, bags, per_bag = 400_000, 64, 2048, 4
    steps, warm = 24, 4
    batches = make_batches(steps, rows, bags, per_bag, dim, device, seed=6)
    init = torch.randn(rows, dim)
    props = torch.cuda.get_device_properties(device)
    clock_hz = float(getattr(props, "clock_rate", 1_980_000)) * 1e3  # (kHz; H200's boost clock if absent)
    marks: Dict[str, Any] = {"ahead": 0, "sleeping": None}

    def on_step(i: int) -> None:
        if i == warm:
            sync(device)
            torch.cuda._sleep(int(0.2 * clock_hz))
            marks["sleeping"] = torch.cuda.current_stream(device).record_event()
        elif marks["sleeping"] is not None and not marks["sleeping"].query():
            marks["ahead"] += 1

    train(device, init, 9 * bags * per_bag, depth, batches, on_step)
    return {"host_steps_ahead_of_gpu": marks["ahead"], "depth": depth, "steps_after_sleep": steps - warm - 1,
            "sleep_ms": 200}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the checks run; cpu is a dry run of the same code paths "
                        "(default: cuda when available, else cpu)")
    p.add_argument("--quick", action="store_true", help="smaller tables and fewer steps (default: off)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here (default: none)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: 'cuda' needs a CUDA device, and torch.cuda.is_available() is False here "
                "(use --device cpu for the dry run)")
    device = torch.device(args.device)
    t_start = time.perf_counter()
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    print(f"[gpu_check] {info}", flush=True)
    res: Dict[str, Any] = {"info": info}
    checks = (("exactness", exactness), ("syncs", host_syncs), ("bandwidth", bandwidth),
              ("interference", interference), ("planning", planning), ("plan_costs", plan_costs),
              ("bounds", per_table_bounds), ("host_tier", host_tier), ("host_lead", host_lead),
              ("disk_tier", disk_tier))
    reset_move_stats()
    for name, check in checks:
        res[name] = check(device, args.quick)
        print(f"[gpu_check] {name} {json.dumps(res[name], default=str)}", flush=True)
    ex = res["exactness"]
    summary = {
        "bit_identical_across_depths": ex["bit_identical_across_depths"],
        "host_syncs_per_step": res["syncs"]["host_syncs_per_step"],
        "gpu_stall_ms_per_step": ex["roomy"]["gpu_stall_ms_per_step"],
        "fetch_fraction_of_pinned_copy": res["bandwidth"]["fetch_fraction_of_pinned_copy"],
        "compute_slowdown_while_fetching": res["interference"]["compute_slowdown_while_fetching"],
        "plan_ms_per_step_by_ids": res["planning"]["plan_ms_per_step_by_ids"],
        "host_steps_ahead_of_gpu": res["host_lead"]["host_steps_ahead_of_gpu"],
        "plan_launches_per_group_step": res["plan_costs"]["plan_launches_per_group_step"],
        "update_launches_per_group_step": res["plan_costs"]["update_launches_per_group_step"],
        "plan_ops_identical_across_cache_sizes": res["plan_costs"]["plan_ops_identical_across_cache_sizes"],
        "per_table_bounds_ok": res["bounds"]["per_table_bounds_ok"],
        "update_bytes_per_group_step": res["plan_costs"]["update_bytes_per_group_step"],
        "update_ids": res["plan_costs"]["update_ids"],
        "dim": res["plan_costs"]["dim"],
        "update_ms_per_step_by_ids": res["planning"]["update_ms_per_step_by_ids"],
        "plan_ms_per_step_by_ids_in_flight": res["planning"]["plan_ms_per_step_by_ids_in_flight"],
        "host_tier_bytes_ratio": res["host_tier"]["host_tier_bytes_ratio"],
        "plan_graph_cache_bytes": res["planning"]["plan_graph_cache_bytes"],
        "move_grid_blocks_max": MOVE_STATS["grid_blocks_max"],
        "disk_bit_identical": res["disk_tier"]["disk_bit_identical"],
        "elapsed_s": time.perf_counter() - t_start,
    }
    res.update(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr, flush=True)
    print("\n| check | figure |\n|---|---|")
    print(f"| bit-identical across depths {DEPTHS} (same cache; roomy and tiny) | {summary['bit_identical_across_depths']} |")
    print(f"| host syncs per steady-state step ({res['syncs']['how']}) | {summary['host_syncs_per_step']:g} |")
    print(f"| GPU-timeline stall ms/step by depth | {summary['gpu_stall_ms_per_step']} |")
    frac = summary["fetch_fraction_of_pinned_copy"]
    print(f"| fetch / plain pinned copy | {'needs a GPU' if frac is None else f'{frac:.2f}'} |")
    print(f"| compute slow-down while fetching | {summary['compute_slowdown_while_fetching']:+.1%} |")
    print(f"| planning ms/step by ids per rank | {summary['plan_ms_per_step_by_ids']} |")
    lead = summary["host_steps_ahead_of_gpu"]
    print(f"| host steps ahead of a 200 ms GPU sleep (depth {res['host_lead']['depth']}) | "
          f"{'needs a GPU' if lead is None else lead} |")
    print(f"| planning launches per group per step (FBGEMM: ~10) | {summary['plan_launches_per_group_step']} |")
    print(f"| backward + fused update launches per group per step | {summary['update_launches_per_group_step']} |")
    print(f"| planning ops and bytes the same at 1M and 10M slots | {summary['plan_ops_identical_across_cache_sizes']} |")
    print(f"| id past its own table counted on the device | {summary['per_table_bounds_ok']} |")
    print(f"| update bytes per group step at {summary['update_ids']} ids x {summary['dim']} (sizes landed) | "
          f"{summary['update_bytes_per_group_step'] / 1e9:.2f} GB |")
    print(f"| backward + fused update ms/step by ids (depth {res['planning']['in_flight_depth']}) | "
          f"{summary['update_ms_per_step_by_ids']} |")
    print(f"| planning ms/step by ids, {res['planning']['in_flight_depth']} batches in flight | "
          f"{summary['plan_ms_per_step_by_ids_in_flight']} |")
    ratio = summary["host_tier_bytes_ratio"]
    print(f"| host bytes of the TorchRec path / (table + state) | {'needs TorchRec' if ratio is None else f'{ratio:.2f}'} |")
    print(f"| plan graph cache bytes | {summary['plan_graph_cache_bytes']} |")
    print(f"| largest row-move grid (blocks) | {summary['move_grid_blocks_max']} |")
    print(f"| table on disk bit-identical to host memory, depths 0/1/2 (disk 4) | {summary['disk_bit_identical']} |")
    print(f"| wall time | {summary['elapsed_s']:.0f} s |")
    ok = (summary["bit_identical_across_depths"] and summary["host_syncs_per_step"] == 0
          and summary["plan_ops_identical_across_cache_sizes"] and summary["per_table_bounds_ok"]
          and summary["disk_bit_identical"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
