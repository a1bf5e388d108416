"""Rank-side benchmark: train every configuration on the same data and time it.

Configurations (same model init, same batches, same cache size):

* ``resident``   - stock TorchRec: ``EmbeddingBagCollectionSharder``, fused kernel, every row
                   in accelerator memory, ``TrainPipelineSparseDist``. The upper bound.
* ``reactive``   - our sharder at ``prefetch_depth=0``: cold rows fetched at lookup time.
* ``depth_k``    - our sharder, rows fetched ``k`` batches ahead.
* ``auto``       - the depth :func:`choose_depth` picks from the reactive measurements.
* ``cache100``   - our sharder with a 100% cache: the overhead of the store itself.

A step's time is the slowest rank's (collectives make ranks wait for each other).
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from ..app.autodepth import choose_depth
from ..fetch import LinkModel
from ..integration.pipeline import ProactiveTrainPipeline
from ..integration.sharder import ProactiveEmbeddingBagCollectionSharder
from ..planning import build_plan, combined_optimizer, shard_model
from ..store import CacheCapacityError
from .workload import DLRMTrainModel, Workload


@dataclass(frozen=True)
class BenchSettings:
    workload: Workload = field(default_factory=Workload)
    sharding: str = "table_wise"
    cache_load_factor: float = 0.05
    depths: Tuple[int, ...] = (1, 2, 4)
    warmup_steps: int = 8
    measure_steps: int = 24
    link_bandwidth_gbps: Optional[float] = None  # None: calibrate to target_fetch_fraction
    link_latency_us: float = 100.0
    target_fetch_fraction: float = 0.6  # cold fetch time / resident step time
    learning_rate: float = 0.05
    trace: bool = False
    include_auto: bool = True
    include_cache100: bool = True


def _fused() -> Dict[str, Any]:
    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}


def _build(settings: BenchSettings, sharder: Any, kernel: str, init_state: Dict[str, Any]):
    torch.manual_seed(0)
    model = DLRMTrainModel(settings.workload)
    plan = build_plan(model, sharder, settings.sharding, kernel=kernel)
    dmp = shard_model(model, sharder, plan, torch.device("cpu"))
    dmp.load_state_dict(copy.deepcopy(init_state))
    opt = combined_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=settings.learning_rate))
    return dmp, opt


def _max_over_ranks(values: List[float]) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sum_over_ranks(values: List[float]) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _train(pipeline: Any, batches: List[Any], warmup: int) -> Tuple[List[float], List[Dict[str, float]]]:
    """Per-step wall times and per-step cumulative stats (measured steps only)."""
    it = iter(batches)
    times: List[float] = []
    snaps: List[Dict[str, float]] = []
    step = 0
    while True:
        t0 = time.perf_counter()
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            snaps.append(dict(pipeline.stats()) if hasattr(pipeline, "prefetch_depth") else {})
        step += 1
    return times, snaps


def _summarize(name: str, settings: BenchSettings, times: List[float], snaps: List[Dict[str, float]],
               world_size: int, extra: Dict[str, Any]) -> Dict[str, Any]:
    step = _max_over_ranks(times)  # a synchronous job steps at its slowest rank's pace
    n = len(step)
    s = sorted(step)
    first, last = (snaps[0], snaps[-1]) if snaps else ({}, {})
    per_step = lambda key: (last.get(key, 0.0) - first.get(key, 0.0)) / max(n - 1, 1)  # noqa: E731
    local = [per_step("stall_s"), per_step("rows_fetched"), per_step("bytes_moved"),
             per_step("rows_written_back"), last.get("hits", 0.0) - first.get("hits", 0.0),
             last.get("rows_requested", 0.0) - first.get("rows_requested", 0.0)]
    stall, rows, nbytes, wb, hits, req = local
    stall = _max_over_ranks([stall])[0]
    rows, nbytes, wb, hits, req = _sum_over_ranks([rows, nbytes, wb, hits, req])
    median = statistics.median(step)
    return {
        "name": name,
        "steps_measured": n,
        "step_ms_median": 1e3 * median,
        "step_ms_p90": 1e3 * s[min(n - 1, int(round(0.9 * (n - 1))))],
        "samples_per_s": world_size * settings.workload.batch_size / median,
        "stall_ms_per_step": 1e3 * stall,
        "rows_fetched_per_step": rows,
        "bytes_moved_per_step": nbytes,
        "rows_written_back_per_step": wb,
        "hit_rate": hits / req if req else (1.0 if snaps else None),
        **extra,
    }


def _measure_comm(settings: BenchSettings, world_size: int, dense_param_bytes: int, reps: int = 10) -> Dict[str, float]:
    """Times the collectives of one step at their real sizes (input ids, pooled output, dense grads)."""
    w = settings.workload
    id_elems = max(1, w.batch_size * w.num_tables * w.ids_per_feature * 2)  # ids + lengths, int64
    out_elems = max(1, w.batch_size * w.num_tables * w.embedding_dim)
    res: Dict[str, float] = {}
    for key, elems, dtype in (("input_a2a_s", id_elems, torch.int64), ("output_a2a_s", out_elems, torch.float32)):
        n = elems - elems % world_size
        src, dst = torch.zeros(n, dtype=dtype), torch.empty(n, dtype=dtype)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_to_all_single(dst, src)
        res[key] = (time.perf_counter() - t0) / reps
    grads = torch.zeros(max(1, dense_param_bytes // 4))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(grads)
    res["allreduce_s"] = (time.perf_counter() - t0) / reps
    return {k: v for k, v in zip(res, _max_over_ranks(list(res.values())))}


def bench_rank(rank: int, world_size: int, settings: BenchSettings) -> Dict[str, Any]:
    """Runs every configuration on this rank; returns the (rank-agreed) results and traces."""
    w = settings.workload
    batches = w.batches(settings.warmup_steps + settings.measure_steps, rank)
    torch.manual_seed(1234)
    init_state = DLRMTrainModel(w).state_dict()
    dense_bytes = sum(p.numel() * 4 for n, p in DLRMTrainModel(w).named_parameters() if "embedding_bags" not in n)
    results: Dict[str, Dict[str, Any]] = {}
    traces: Dict[str, List[Dict[str, Any]]] = {}

    def run(name: str, sharder: Any, kernel: str, depth: Optional[int], extra: Dict[str, Any]) -> Dict[str, Any]:
        dmp, opt = _build(settings, sharder, kernel, init_state)
        if depth is None:
            pipe: Any = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
        else:
            pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth, trace=settings.trace)
        times, snaps = _train(pipe, batches, settings.warmup_steps)
        if depth is not None:
            dmp.module.model.sparse_arch.embedding_bag_collection.check_invariants(expect_drained=True)
            if settings.trace:
                traces[name] = list(pipe.tracer.events)
        results[name] = _summarize(name, settings, times, snaps, world_size, {"prefetch_depth": depth, **extra})
        return results[name]

    def proactive(link: Optional[LinkModel], load_factor: Optional[float] = None) -> ProactiveEmbeddingBagCollectionSharder:
        return ProactiveEmbeddingBagCollectionSharder(
            fused_params=_fused(), cache_load_factor=load_factor or settings.cache_load_factor, link=link
        )

    resident = run("resident", EmbeddingBagCollectionSharder(fused_params=_fused()), "fused", None, {})

    bandwidth = settings.link_bandwidth_gbps
    if bandwidth is None:
        # Calibrate the emulated link: cold fetches cost `target_fetch_fraction` of a
        # resident step (the paper's regime). Measured with an instantaneous link.
        probe = run("calibration", proactive(None), "fused_uvm_caching", 0, {})
        fetch_target_s = settings.target_fetch_fraction * resident["step_ms_median"] / 1e3
        per_rank_bytes = probe["bytes_moved_per_step"] / world_size
        bandwidth = max(per_rank_bytes / max(fetch_target_s - settings.link_latency_us * 1e-6, 1e-6) / 1e9, 1e-4)
        results.pop("calibration")
    link = LinkModel(bandwidth_gbps=float(bandwidth), latency_us=settings.link_latency_us)

    reactive = run("reactive", proactive(link), "fused_uvm_caching", 0, {})
    for k in settings.depths:
        try:
            run(f"depth_{k}", proactive(link), "fused_uvm_caching", k, {})
        except CacheCapacityError as e:
            results[f"depth_{k}"] = {"name": f"depth_{k}", "prefetch_depth": k, "error": str(e)}
    if settings.include_auto:
        # The trainer's prefetch=auto rule, fed with this run's reactive measurements and
        # snapped to the smallest measured depth that is at least as deep.
        stall_s = reactive["stall_ms_per_step"] / 1e3
        want = choose_depth(stall_s, reactive["step_ms_median"] / 1e3 - stall_s, max(settings.depths), max(settings.depths)).depth
        k = min((d for d in settings.depths if d >= want), default=max(settings.depths))
        if "error" not in results.get(f"depth_{k}", {}):
            run("auto", proactive(link), "fused_uvm_caching", k, {"chosen_depth": k})
    if settings.include_cache100:
        run("cache100", proactive(link, load_factor=1.0), "fused_uvm_caching", 2, {"cache_load_factor": 1.0})

    comm = _measure_comm(settings, world_size, dense_bytes) if world_size > 1 else {
        "input_a2a_s": 0.0, "output_a2a_s": 0.0, "allreduce_s": 0.0}
    return {
        "rank": rank,
        "results": results,
        "link": {"kind": "emulated", "bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us,
                 "calibrated": settings.link_bandwidth_gbps is None,
                 "target_fetch_fraction": settings.target_fetch_fraction},
        "comm": comm,
        "dense_param_bytes": dense_bytes,
        "traces": traces,
        "settings": {**asdict(settings), "workload": asdict(w)},
    }
