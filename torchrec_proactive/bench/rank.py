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
import gc
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from ..app.autodepth import choose_depth
from ..fetch import LinkModel
from ..integration.pipeline import ProactiveTrainPipeline
from ..integration.sharded_module import ProactiveShardedModule
from ..integration.sharder import ProactiveEmbeddingBagCollectionSharder, ProactiveEmbeddingCollectionSharder
from ..planning import build_plan, combined_optimizer, shard_model
from ..store import CacheCapacityError
from .workload import Workload, bench_model


@dataclass(frozen=True)
class BenchSettings:
    workload: Workload = field(default_factory=Workload)
    sharding: str = "table_wise"
    cache_load_factor: float = 0.05
    depths: Tuple[int, ...] = (1, 2, 4, 8)
    warmup_steps: int = 8
    measure_steps: int = 32  # per round: many short rounds, judged on per-round ratios (noise.py)
    link_bandwidth_gbps: Optional[float] = None  # None: calibrate to target_fetch_fraction
    link_latency_us: float = 100.0
    target_fetch_fraction: float = 0.6  # cold fetch time / resident step time
    learning_rate: float = 0.05
    trace: bool = False
    include_auto: bool = True
    include_cache100: bool = True
    # A cache of 1% of the rows (smaller than what k + 1 batches need): reactive and the
    # deepest depth, to show that proactive is never slower than reactive at the same cache.
    include_cache1: bool = True
    small_cache_load_factor: float = 0.01
    rounds: int = 12  # every configuration runs once per round, in rotated order


def _fused() -> Dict[str, Any]:
    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}


def _build(settings: BenchSettings, sharder: Any, kernel: str, init_state: Dict[str, Any]):
    torch.manual_seed(0)
    model = bench_model(settings.workload)
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


@dataclass
class Measurement:
    """One timed segment of one configuration: per-step wall times (after warm-up) and the
    change of the pipeline's cumulative statistics over those steps."""

    times: List[float]
    deltas: Dict[str, float]
    #: bytes this rank moved (fetches + write-backs) during each measured step: the per-rank
    #: load whose maximum over ranks a synchronous step waits for (stragglers)
    step_bytes: List[float] = field(default_factory=list)


def _train(pipeline: Any, batches: List[Any], warmup: int) -> Measurement:
    it = iter(batches)
    times: List[float] = []
    # (rows_fetched_at_lookup: rows copied while their lookup waited, on the critical path)
    stats = pipeline.stats if hasattr(pipeline, "prefetch_depth") else (lambda: {})
    start: Dict[str, float] = {}
    step_bytes: List[float] = []
    last = 0.0
    step = 0
    while True:
        t0 = time.perf_counter()
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            moved = stats().get("bytes_moved", 0.0)  # (outside the timed span)
            step_bytes.append(moved - last)
            last = moved
        step += 1
        if step == warmup:
            start = stats()
            last = start.get("bytes_moved", 0.0)
    end = stats()
    return Measurement(times, {k: end.get(k, 0.0) - start.get(k, 0.0) for k in end if k != "hit_rate"}, step_bytes)


def _per_rank(values: List[float]) -> List[List[float]]:
    """Every rank's ``values`` (same length on every rank), rank by rank."""
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [x.tolist() for x in out]


def _summarize(name: str, settings: BenchSettings, runs: List[Measurement], world_size: int,
               extra: Dict[str, Any]) -> Dict[str, Any]:
    """Medians over every measured step of every round; per-step counters averaged."""
    times = [t for m in runs for t in m.times]
    step = _max_over_ranks(times)  # a synchronous job steps at its slowest rank's pace
    n = len(step)
    s = sorted(step)
    total = {k: sum(m.deltas.get(k, 0.0) for m in runs) for k in runs[0].deltas}
    stall = _max_over_ranks([total.get("stall_s", 0.0) / n])[0]
    rows, nbytes, wb, hits, req, deferred, overflow, at_lookup, leads, batches = _sum_over_ranks(
        [total.get(k, 0.0) for k in ("rows_fetched", "bytes_moved", "rows_written_back", "hits", "rows_requested",
                                     "deferred_batches", "overflow_rows", "rows_fetched_at_lookup",
                                     "prefetch_lead_lookups", "batches")]
    )
    # Planning per step on the slowest rank: wall time, and the planning thread's CPU time.
    plan_s, plan_cpu_s = _max_over_ranks([total.get("plan_s", 0.0) / n, total.get("plan_cpu_s", 0.0) / n])
    median = statistics.median(step)
    # Reporting hook (bench runner's noise estimate): the slowest-rank step times, per round.
    per_round, i = [], 0
    for m in runs:
        per_round.append([1e3 * t for t in step[i:i + len(m.times)]])
        i += len(m.times)
    return {
        "name": name,
        "steps_measured": n,
        "rounds": len(runs),
        "step_ms_median": 1e3 * median,
        "step_ms_p90": 1e3 * s[min(n - 1, int(round(0.9 * (n - 1))))],
        "samples_per_s": world_size * settings.workload.batch_size / median,
        "ids_per_step": world_size * settings.workload.ids_per_step(),
        "stall_ms_per_step": 1e3 * stall,
        "rows_fetched_per_step": rows / n,
        # copied while the lookup waited (critical path): all of reactive's, none of a
        # prefetch that was planned ahead
        "rows_fetched_at_lookup_per_step": at_lookup / n,
        "rows_requested_per_step": req / n,
        "bytes_moved_per_step": nbytes / n,
        "rows_written_back_per_step": wb / n,
        "plan_ms_per_step": 1e3 * plan_s,
        "plan_cpu_ms_per_step": 1e3 * plan_cpu_s,
        "deferred_batches_per_step": deferred / n,
        # counted: how many lookups ahead each batch's fetch was issued, mean over batches
        # (k at depth k while the cache holds k + 1 batches; 0 reactive; None: no store)
        "mean_prefetch_lead": leads / batches if batches else None,
        "overflow_rows_per_step": overflow / n,
        "hit_rate": hits / req if req else (1.0 if total else None),
        "step_ms_per_round": per_round,
        # the first round's bytes moved per step, per rank (counters: data, cache and depth only)
        "bytes_moved_by_rank_step": _per_rank(runs[0].step_bytes) if runs[0].step_bytes else [],
        **extra,
    }


def _measure_comm(settings: BenchSettings, world_size: int, dense_param_bytes: int, reps: int = 10) -> Dict[str, float]:
    """Times the collectives of one step at their real sizes (input ids, pooled output, dense grads)."""
    w = settings.workload
    id_elems = max(1, w.ids_per_step() * 2)  # ids + lengths, int64
    # pooled rows, plus one row per history id (a sequence lookup's output is per id)
    out_elems = max(1, (w.batch_size * w.num_tables + w.ids_per_step() - w.batch_size * w.num_tables * w.ids_per_feature)
                    * w.embedding_dim)
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


#: ``progress(stage, name, round_index)``: stage ``"start"`` / ``"end"`` of one measurement;
#: ``round_index`` is None for the link calibration runs. Reporting only (the runner's bar).
ProgressHook = Callable[[str, str, Optional[int]], None]


def bench_rank(rank: int, world_size: int, settings: BenchSettings,
               progress: Optional[ProgressHook] = None) -> Dict[str, Any]:
    """Runs every configuration on this rank; returns the (rank-agreed) results and traces."""
    # The store says once per module when the cache is too small; here that is the point of
    # the small-cache configurations, and the table reports the counts.
    warnings.filterwarnings("ignore", message=r".*device cache.*", category=UserWarning)
    w = settings.workload
    batches = w.batches(settings.warmup_steps + settings.measure_steps, rank)
    torch.manual_seed(1234)
    init_state = bench_model(w).state_dict()
    dense_bytes = sum(p.numel() * 4 for n, p in bench_model(w).named_parameters()
                      if "embedding_bags" not in n and "embeddings." not in n)
    results: Dict[str, Dict[str, Any]] = {}
    traces: Dict[str, List[Dict[str, Any]]] = {}
    bookkeeping: Dict[str, float] = {}  # store bookkeeping bytes / host-tier bytes, per config

    def measure(name: str, sharder: Any, kernel: str, depth: Optional[int],
                round_index: Optional[int] = None) -> Measurement:
        if progress is not None:
            progress("start", name, round_index)
        # TorchRec's modules and pipelines hold reference cycles (stock and ours alike), so a
        # finished run's model is freed only by a full collection; without one, a default run
        # (120 models) grew each rank by ~200 MB per run until the OOM killer stopped it.
        # Collected here, outside every timed span.
        gc.collect()
        dmp, opt = _build(settings, sharder, kernel, init_state)
        if depth is None:
            pipe: Any = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
        else:
            pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth,
                                          trace=settings.trace and name not in traces)
        m = _train(pipe, batches, settings.warmup_steps)
        if depth is not None:
            modules = [mod for mod in dmp.modules() if isinstance(mod, ProactiveShardedModule)]
            for module in modules:
                module.check_invariants(expect_drained=True)
            stores = [t for module in modules for t in module.named_tables().values()]
            host = sum(t.host_tier_bytes() for t in stores)
            bookkeeping[name] = sum(t.bookkeeping_bytes() for t in stores) / host if host else 0.0
            if pipe.tracer.enabled:
                traces[name] = list(pipe.tracer.events)
        if progress is not None:
            progress("end", name, round_index)
        return m

    sequence = w.model == "sequence"  # (then one sharder per collection type)

    def proactive(link: Optional[LinkModel], load_factor: Optional[float] = None) -> Any:
        options = dict(fused_params=_fused(), cache_load_factor=load_factor or settings.cache_load_factor, link=link)
        pooled = ProactiveEmbeddingBagCollectionSharder(**options)
        return [ProactiveEmbeddingCollectionSharder(**options), pooled] if sequence else pooled

    def resident_sharder() -> Any:
        pooled = EmbeddingBagCollectionSharder(fused_params=_fused())
        return [EmbeddingCollectionSharder(fused_params=_fused()), pooled] if sequence else pooled

    bandwidth = settings.link_bandwidth_gbps
    if bandwidth is None:
        # Calibrate the emulated link: cold fetches cost `target_fetch_fraction` of a
        # resident step (the paper's regime). Measured with an instantaneous link.
        resident = _summarize("resident", settings, [measure("resident", resident_sharder(), "fused", None)], world_size, {})
        probe = _summarize("calibration", settings, [measure("calibration", proactive(None), "fused_uvm_caching", 0)],
                           world_size, {})
        fetch_target_s = settings.target_fetch_fraction * resident["step_ms_median"] / 1e3
        per_rank_bytes = probe["bytes_moved_per_step"] / world_size
        bandwidth = max(per_rank_bytes / max(fetch_target_s - settings.link_latency_us * 1e-6, 1e-6) / 1e9, 1e-4)
    link = LinkModel(bandwidth_gbps=float(bandwidth), latency_us=settings.link_latency_us)

    # name -> (sharder factory, kernel, depth, extra fields)
    configs: Dict[str, Tuple[Any, str, Optional[int], Dict[str, Any]]] = {
        "resident": (resident_sharder, "fused", None, {}),
        "reactive": (lambda: proactive(link), "fused_uvm_caching", 0, {}),
        **{f"depth_{k}": (lambda: proactive(link), "fused_uvm_caching", k, {}) for k in settings.depths},
    }
    if settings.include_cache100:
        configs["cache100"] = (lambda: proactive(link, load_factor=1.0), "fused_uvm_caching", 2, {"cache_load_factor": 1.0})
    if settings.include_cache1:
        small = settings.small_cache_load_factor
        extra = {"cache_load_factor": small}
        configs["cache1_reactive"] = (lambda: proactive(link, load_factor=small), "fused_uvm_caching", 0, extra)
        configs["cache1"] = (lambda: proactive(link, load_factor=small), "fused_uvm_caching", max(settings.depths), extra)
    runs: Dict[str, List[Measurement]] = {}
    failed: Dict[str, str] = {}
    for r in range(settings.rounds):
        names = list(configs)
        names = names[r % len(names):] + names[: r % len(names)]  # rotate: no config always runs first
        for name in names:
            if name in failed:
                continue
            factory, kernel, depth, _ = configs[name]
            try:
                runs.setdefault(name, []).append(measure(name, factory(), kernel, depth, r))
            except CacheCapacityError as e:
                failed[name] = str(e)
        if r == 0 and settings.include_auto and "reactive" in runs:
            # The trainer's prefetch=auto rule, fed with this run's reactive measurements and
            # snapped to the smallest measured depth that is at least as deep.
            reactive = _summarize("reactive", settings, runs["reactive"], world_size, {})
            stall_s = reactive["stall_ms_per_step"] / 1e3
            want = choose_depth(stall_s, reactive["step_ms_median"] / 1e3 - stall_s, max(settings.depths),
                                max(settings.depths)).depth
            k = min((d for d in settings.depths if d >= want and f"depth_{d}" not in failed), default=None)
            if k is not None:
                configs["auto"] = (lambda: proactive(link), "fused_uvm_caching", k, {"chosen_depth": k})
                runs["auto"] = [measure("auto", proactive(link), "fused_uvm_caching", k, 0)]
    for name, (_, _, depth, extra) in configs.items():
        if name in failed:
            results[name] = {"name": name, "prefetch_depth": depth, "error": failed[name]}
        elif name in runs:
            if name in bookkeeping:
                extra = {**extra, "bookkeeping_fraction_of_host_tier": _max_over_ranks([bookkeeping[name]])[0]}
            results[name] = _summarize(name, settings, runs[name], world_size, {"prefetch_depth": depth, **extra})

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
