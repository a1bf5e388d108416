"""The workloads owners run, the tables a planner would tier, and their steady-state cache traffic.

Workloads (:data:`WORKLOADS`), each with its sources:

* ``dcnv2_multi_hot``: MLPerf Training's recommendation benchmark since v3.0 (DLRM-dcnv2 on
  Criteo 1TB with the synthetic multi-hot sizes): 26 tables capped at 40M rows (five of them
  at the cap, three of 0.4-3.1M rows, 18 small), dim 128, multi-hot sizes 3..100 (214 ids a
  sample), DCN v2 of 3 layers of rank 512, bottom MLP 512-256-128, top 1024-1024-512-256-1.
  About 105 GB of rows with row-wise Adagrad state: it fits in one DGX's HBM.
* ``dlrm_one_hot``: the same tables one-hot with the DLRM dot interaction (MLPerf Training's
  DLRM before v3.0).
* ``dcnv2_multi_hot_scaled``: the case the product exists for: DLRM-dcnv2 whose five large
  tables grow with the GPUs (weak scaling of the model) until each GPU's shards fill its host
  tier: the host memory budget on a DRAM tier, :data:`NVME_HOST_MULTIPLE` times it on NVMe.

:func:`tier_plan` decides, per system and scale, what a planner would do: every table in HBM
when the rows fit the device budget (nothing to fetch: proactive fetching does not apply),
else the largest tables tiered (row-wise over every GPU) with the cache the device budget
leaves (the coldest tables first), their rows in host DRAM (or on NVMe behind a host DRAM cache), or no plan when the
host tier cannot hold them.

:func:`shard_traffic` gives a tiered shard's steady-state traffic without replaying
millions of ids: ids are Zipf over each table (one-hot), expanded to multi-hot as MLPerf's
synthetic generator does (``multi_hot_distribution_type uniform``: a one-hot id ``v`` brings
``h - 1`` fixed, uniformly drawn rows with it, so each of its ``h`` rows is requested exactly
when ``v`` is); the cache is LRU in steady state by Che's approximation (a row is cached iff
it was requested within the characteristic time ``T``, ``sum_rows P(requested within T) =
cache rows``). A multi-hot table of size ``h`` then behaves as ``h`` copies of its one-hot
popularity whose rows are requested, and evicted, together: ``h`` x the one-hot misses at a
cache of ``C / h`` rows, with the per-step variance of groups of ``h``. Row-wise sharding
over ``W`` GPUs with a fixed batch per GPU leaves a shard's traffic at a given cache fraction
that of the whole table on one GPU (the shard sees ``1/W`` of the rows at ``W`` times their
rate). :mod:`torchrec_proactive.bench.scaling_study` checks these figures against the real
store (:mod:`torchrec_proactive.bench.cache_replay`) and against the bench's counters.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .hardware import HBM_USABLE, HardwareProfile
from .step_model import DLRMShape

__all__ = ["Table", "Workload", "WORKLOADS", "workload_named", "TierPlan", "tier_plan", "Popularity",
           "zipf_popularity", "trace_popularity", "multi_hot", "ShardTraffic", "shard_traffic", "multi_hot_ids", "row_bytes",
           "MLPERF_STEP", "NVME_HOST_MULTIPLE", "custom_workload"]

#: Criteo 1TB as MLPerf DLRM-dcnv2 caps it (``--num_embeddings_per_feature`` of the MLPerf
#: reference, mlcommons/training recommendation_v2/torchrec_dlrm, and of TorchRec's
#: ``materialize_synthetic_multihot_dataset.py``).
CRITEO_TB_ROWS: Tuple[int, ...] = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4,
    976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
#: ``--multi_hot_sizes`` of the same reference (214 ids a sample).
DCNV2_MULTI_HOT: Tuple[int, ...] = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
#: The scaled workload on an NVMe tier: each GPU's shards are this many times its host memory
#: budget (ASSUMED: the smallest clear case for a disk tier; a larger ratio only reads more).
NVME_HOST_MULTIPLE = 2.0

#: The share of the device budget a tier plan leaves at least to the tiered tables' caches.
MIN_CACHE_SHARE = 0.25

#: The step time the study takes from a published result, for the calibration of compute:
#: (ms, low, high) per step of DLRM-dcnv2, every row in HBM, 8 GPUs of a DGX H100.
MLPERF_STEP = (4.1, 3.5, 5.6)
MLPERF_SOURCE = (
    "MLPerf Training v3.0, result 3.0-2063 (NVIDIA, DGX H100, 8x H100 SXM5 80 GB, NVIDIA Merlin HugeCTR): "
    "DLRM-dcnv2 trained to AUC 0.80275 in 4.184 minutes (NVIDIA Data Center Deep Learning Product Performance "
    "page, MLPerf 3.0 Training, single node)",
    "steps ASSUMED: about 0.8 epoch of Criteo 1TB's 4,195,197,692 training samples (band 0.7-0.95) at a global "
    "batch of 55,296-65,536 (MLPerf dcnv2 submissions; 8,192 per GPU used): 45k-72k steps, so 4.184 min is "
    "3.5-5.6 ms a step, 4.1 nominal, evaluations included (they shorten the true step a little)",
    "HugeCTR's step is graph-captured, mixed precision, all rows in HBM: TorchRec's eager step is at least as long; "
    "the study adds TorchRec's extra fixed cost as the step overhead (band 0-4 ms, sensitivity to 8 ms)",
)


@dataclass(frozen=True)
class Table:
    name: str
    rows: int
    hotness: int = 1


@dataclass(frozen=True)
class Workload:
    """A model owners train, its tables, and what is assumed about its ids."""

    name: str
    description: str
    tables: Tuple[Table, ...]
    shape: DLRMShape
    #: Zipf exponent of the one-hot ids (ASSUMED for Criteo 1TB; ``--scaling-trace`` takes real ids)
    zipf_alpha: float = 1.05
    #: grow the tables of at least this many rows so that each GPU's tiered shards fill its
    #: host tier (0: the tables as given)
    scale_tables_from: int = 0
    sources: Tuple[str, ...] = field(default_factory=tuple)
    assumptions: Tuple[str, ...] = field(default_factory=tuple)

    @property
    def ids_per_sample(self) -> int:
        return sum(t.hotness for t in self.tables)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "description": self.description, "zipf_alpha": self.zipf_alpha,
                "tables": [asdict(t) for t in self.tables], "ids_per_sample": self.ids_per_sample,
                "shape": self.shape.to_dict(), "scaled": bool(self.scale_tables_from), "sources": list(self.sources),
                "assumptions": list(self.assumptions)}


def _criteo_tables(hotness: Sequence[int]) -> Tuple[Table, ...]:
    return tuple(Table(f"t{i}", rows, h) for i, (rows, h) in enumerate(zip(CRITEO_TB_ROWS, hotness)))


_BATCH = 8192  # per GPU: MLPerf's 65,536 global batch over 8 GPUs, held per GPU (weak scaling)
_SHARED_ASSUMPTIONS = (
    "one-hot ids Zipf(1.05) over each table's rows (ASSUMED for Criteo 1TB, the project's long-standing choice; "
    "give a TorchRec-preprocessed day with --scaling-trace for real ids)",
    "weak scaling: 8,192 samples per GPU at every scale; every tiered table row-wise over all GPUs",
    "rows fp32 with row-wise Adagrad state (516 bytes at dim 128)",
)

DCNV2 = Workload(
    name="dcnv2_multi_hot",
    description="MLPerf DLRM-dcnv2 on Criteo 1TB, multi-hot (214 ids a sample), 26 tables capped at 40M rows",
    tables=_criteo_tables(DCNV2_MULTI_HOT),
    shape=DLRMShape(batch_per_gpu=_BATCH, num_features=26, ids_per_feature=sum(DCNV2_MULTI_HOT) / 26,
                    embedding_dim=128, bottom_mlp=(13, 512, 256, 128), top_mlp=(1024, 1024, 512, 256, 1),
                    interaction="dcn", dcn_layers=3, dcn_rank=512),
    sources=("mlcommons/training recommendation_v2/torchrec_dlrm: --num_embeddings_per_feature, --multi_hot_sizes, "
             "--interaction_type=dcn --dcn_num_layers=3 --dcn_low_rank_dim=512, --dense_arch_layer_sizes 512,256,128, "
             "--over_arch_layer_sizes 1024,1024,512,256,1, --embedding_dim 128, --multi_hot_distribution_type uniform",),
    assumptions=_SHARED_ASSUMPTIONS + (
        "multi-hot ids as MLPerf's synthetic generator makes them (uniform: a one-hot id brings h - 1 fixed, "
        "uniformly drawn rows)",),
)

DLRM_ONE_HOT = Workload(
    name="dlrm_one_hot",
    description="DLRM (dot interaction) on Criteo 1TB, one-hot, the same 26 tables",
    tables=_criteo_tables([1] * 26),
    shape=DLRMShape(batch_per_gpu=_BATCH, num_features=26, ids_per_feature=1.0, embedding_dim=128,
                    bottom_mlp=(13, 512, 256, 128), top_mlp=(1024, 1024, 512, 256, 1), interaction="dot"),
    sources=("facebookresearch/dlrm and MLPerf Training DLRM (v0.7-v2.1): Criteo Terabyte, dim 128, bottom MLP "
             "13-512-256-128, top MLP 1024-1024-512-256-1, dot interaction",),
    assumptions=_SHARED_ASSUMPTIONS,
)

DCNV2_SCALED = replace(
    DCNV2, name="dcnv2_multi_hot_scaled",
    description=("DLRM-dcnv2 multi-hot whose five 40M-row tables grow with the GPUs until each GPU's tiered shards "
                 "fill its host tier (the host memory budget; twice it on NVMe)"),
    scale_tables_from=40_000_000,
    assumptions=DCNV2.assumptions + (
        "the scaled tables keep Criteo's Zipf(1.05) ids and multi-hot sizes over their larger row counts",
        "on an NVMe tier each GPU's shards are twice its host memory budget (ASSUMED: 400 GB on a DGX H100, "
        "of its 3.84 TB drive)",),
)

WORKLOADS: Tuple[Workload, ...] = (DCNV2, DLRM_ONE_HOT, DCNV2_SCALED)


def custom_workload(num_tables: int, rows: int, dim: int, batch_per_gpu: int, ids_per_sample: float,
                    alpha: float = 1.05) -> Workload:
    """Owner-given tables: ``num_tables`` tables of ``rows`` rows, ``ids_per_sample`` ids a
    sample and table (multi-hot when > 1, MLPerf's uniform expansion), DLRM's dot interaction."""
    hot = max(1, int(round(ids_per_sample)))
    return Workload(
        name="custom", description=f"{num_tables} tables x {rows:,} rows x {dim}, {hot} ids a sample and table, "
                                   f"batch {batch_per_gpu} per GPU (--scaling-tables/rows/dim/batch/ids-per-sample)",
        tables=tuple(Table(f"t{i}", rows, hot) for i in range(num_tables)),
        shape=DLRMShape(batch_per_gpu=batch_per_gpu, num_features=num_tables, ids_per_feature=float(hot),
                        embedding_dim=dim, bottom_mlp=(13, 512, 256, dim), top_mlp=(1024, 1024, 512, 256, 1)),
        zipf_alpha=alpha, assumptions=_SHARED_ASSUMPTIONS[:1] + ("the tables as given on the command line",))


def workload_named(name: str) -> Workload:
    found = [w for w in WORKLOADS if w.name == name]
    if not found:
        raise ValueError(f"--scaling-workloads {name!r}: no such workload; expected one of "
                         f"{', '.join(w.name for w in WORKLOADS)}")
    return found[0]


def row_bytes(shape: DLRMShape) -> int:
    return shape.embedding_dim * 4 + 4


# --------------------------------------------------------------------------------------------
# what a planner would tier


@dataclass(frozen=True)
class TierPlan:
    """Where a workload's rows go on ``world_size`` GPUs of a profile (bytes per GPU)."""

    world_size: int
    #: "resident" (every row in HBM: nothing to fetch), "tiered", or "no plan" (``why``)
    kind: str
    tables: Tuple[Table, ...]  # the workload's tables at this scale (scaled ones grown)
    tiered: Tuple[str, ...]
    hbm_budget_bytes: float
    resident_bytes: float
    tiered_bytes: float
    #: device cache rows over the tiered rows (every tiered table the same share)
    cache_fraction: float
    #: NVMe tier: host DRAM cache rows over the tiered rows (beside the device cache)
    host_cache_fraction: float
    host_budget_bytes: float
    why: str

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["tables"] = [t.name for t in self.tables if t.name in self.tiered]
        d["tiered_rows"] = {t.name: t.rows for t in self.tables if t.name in self.tiered}
        return d


def _grown(workload: Workload, profile: HardwareProfile, world_size: int) -> Tuple[Table, ...]:
    if not workload.scale_tables_from:
        return workload.tables
    rb = row_bytes(workload.shape)
    big = [t for t in workload.tables if t.rows >= workload.scale_tables_from]
    per_gpu = profile.host_memory_bytes_per_gpu * (NVME_HOST_MULTIPLE if profile.tier == "nvme" else 1.0)
    rows_each = int(per_gpu * world_size / len(big) / rb)
    return tuple(replace(t, rows=max(t.rows, rows_each)) if t in big else t for t in workload.tables)


def tier_plan(workload: Workload, profile: HardwareProfile, world_size: int) -> TierPlan:
    """What a planner would do with ``workload`` on ``world_size`` GPUs of ``profile``.

    Device budget for rows: :data:`~.hardware.HBM_USABLE` of HBM (TorchRec's planner
    reserves 15%) less the dense parameters with their gradients and optimizer state. Rows
    spread evenly over the GPUs. If they fit, nothing is tiered. Else tables are tiered in
    order of fewest ids per row (the coldest bytes first: TorchRec's offload proposer spends
    device memory where misses cost most) until the rest leaves :data:`MIN_CACHE_SHARE` of the
    budget, and their caches share what the rest leaves. The tiered shards must fit the host tier: host memory per GPU
    on a DRAM tier; on an NVMe tier the drive, with a host DRAM cache of the host memory."""
    rb = row_bytes(workload.shape)
    tables = _grown(workload, profile, world_size)
    budget = HBM_USABLE * profile.hbm_bytes - 3 * workload.shape.dense_param_bytes
    total = sum(t.rows for t in tables) * rb / world_size
    host = profile.host_memory_bytes_per_gpu
    if total <= budget:
        return TierPlan(world_size, "resident", tables, (), budget, total, 0.0, 1.0, 1.0, host,
                        f"{total / 1e9:.0f} GB of rows a GPU fit its {budget / 1e9:.0f} GB device budget: every row in "
                        f"HBM, nothing to fetch")
    tiered: List[Table] = []
    # the coldest bytes first: fewest ids per row (TorchRec's offload proposer spends device
    # memory where misses cost most), until the rest leaves a quarter of the budget to caches
    rest = list(sorted(tables, key=lambda t: (t.hotness / t.rows, -t.rows)))
    while rest and sum(t.rows for t in rest) * rb / world_size > (1 - MIN_CACHE_SHARE) * budget:
        tiered.append(rest.pop(0))
    resident = sum(t.rows for t in rest) * rb / world_size
    tiered_b = sum(t.rows for t in tiered) * rb / world_size
    cache = min(1.0, (budget - resident) / tiered_b)
    names = tuple(t.name for t in tiered)
    if profile.tier == "dram":
        if tiered_b > host:
            return TierPlan(world_size, "no plan", tables, names, budget, resident, tiered_b, cache, 1.0, host,
                            f"the tiered shards ({tiered_b / 1e9:.0f} GB a GPU) exceed the host memory a GPU has "
                            f"({host / 1e9:.0f} GB): a DRAM host tier cannot hold them")
        return TierPlan(world_size, "tiered", tables, names, budget, resident, tiered_b, cache, 1.0, host,
                        f"{len(tiered)} tables tiered ({tiered_b / 1e9:.0f} GB a GPU in host DRAM), device cache "
                        f"{100 * cache:.1f}% of their rows")
    if tiered_b > profile.nvme_bytes_per_gpu:
        return TierPlan(world_size, "no plan", tables, names, budget, resident, tiered_b, cache, 0.0, host,
                        f"the tiered shards ({tiered_b / 1e12:.1f} TB a GPU) exceed the NVMe a GPU has")
    host_cache = min(1.0, host / tiered_b)
    return TierPlan(world_size, "tiered", tables, names, budget, resident, tiered_b, cache, host_cache, host,
                    f"{len(tiered)} tables tiered ({tiered_b / 1e12:.2f} TB a GPU on NVMe), host DRAM cache "
                    f"{100 * host_cache:.1f}% and device cache {100 * cache:.1f}% of their rows")


# --------------------------------------------------------------------------------------------
# steady-state traffic of a tiered shard


@dataclass(frozen=True)
class Popularity:
    """A table's rows in buckets of equal request probability: ``count[i]`` rows that a sample
    requests with probability ``p[i]`` each (``sum(count * p)`` = ids a sample, the hotness);
    ``group[i]``: rows requested together (a multi-hot id's rows), for the step-to-step variance."""

    p: np.ndarray
    count: np.ndarray
    source: str
    group: Optional[np.ndarray] = None

    @property
    def rows(self) -> float:
        return float(self.count.sum())

    @property
    def ids_per_sample(self) -> float:
        return float(np.sum(self.count * self.p))


def zipf_popularity(n: int, alpha: float, ratio: float = 1.01, exact_head: int = 2000) -> Popularity:
    """The Zipf law :func:`~torchrec_proactive.data.criteo_synth.sample_zipf_ranks` draws from
    (the floor of a continuous power law on ``[1, n+1)``): rank ``r`` has probability
    ``G(r+2) - G(r+1)``; ranks beyond ``exact_head`` in geometric buckets (``ratio``)."""
    if n < 1:
        raise ValueError(f"a table needs rows, got {n}")
    e = 1.0 - alpha

    def cdf(x: np.ndarray) -> np.ndarray:
        if abs(e) < 1e-9:
            return np.log(x) / math.log(n + 1.0)
        return np.expm1(e * np.log(x)) / math.expm1(e * math.log(n + 1.0))

    head = min(n, exact_head)
    edges = list(range(head + 1))
    x = float(head)
    while edges[-1] < n:
        x = max(x * ratio, edges[-1] + 1)
        edges.append(min(n, int(math.ceil(x))))
    e_arr = np.asarray(edges, dtype=float)
    mass = cdf(e_arr[1:] + 1.0) - cdf(e_arr[:-1] + 1.0)
    count = np.diff(e_arr)
    return Popularity(p=mass / count, count=count, source=f"zipf({alpha:g})")


def trace_popularity(ids: np.ndarray) -> Popularity:
    """A table's empirical distribution from its ids in a trace, one id a sample (rows never
    seen are never requested)."""
    counts = np.bincount(np.asarray(ids, dtype=np.int64).ravel())
    counts = counts[counts > 0].astype(float)
    values, mult = np.unique(counts, return_counts=True)
    return Popularity(p=values / counts.sum(), count=mult.astype(float), source="trace")


def multi_hot(pop: Popularity, hotness: int, seed: int = 0, bins: int = 40_000) -> Popularity:
    """The rows of a table whose one-hot ids ``pop`` MLPerf's uniform multi-hot generator
    expands to ``hotness`` ids: row ``v`` itself and ``hotness - 1`` fixed rows drawn uniformly
    for ``v``. Every row then holds its own id's mass and, on average, ``hotness - 1`` other
    ids' extra rows (collisions merge their popularity). Heavy ids (mass above 8 x a row's
    mean) keep ``hotness`` rows of their own mass, requested together; the other rows' mass
    is a sum over the light ids that land in them, sampled (``bins`` rows, fixed seed)."""
    h = int(hotness)
    if h <= 1:
        return pop
    n = pop.rows
    heavy = pop.p > 8.0 * h / n
    lp, lc = pop.p[~heavy], pop.count[~heavy]
    heavy_rows = float(pop.count[heavy].sum())
    light_share = float(lc.sum()) / n  # a uniformly drawn id is light with this probability
    rng = np.random.default_rng(seed)
    weights = lc / lc.sum()

    def draw(size: int) -> np.ndarray:
        return lp[rng.choice(lp.size, size=size, p=weights)] if size else np.zeros(0)

    # a light row: its own (light) id, plus Poisson((h-1) x light share) light ids' extra rows
    extra = rng.poisson((h - 1) * light_share, size=bins)
    masses = draw(bins)
    owner = np.repeat(np.arange(bins), extra)
    np.add.at(masses, owner, draw(int(extra.sum())))
    mean_light_extra = (h - 1) * light_share * float(np.sum(lp * weights))
    edges = np.geomspace(masses.min() * 0.999, masses.max() * 1.001, 400)
    hist, _ = np.histogram(masses, bins=edges)
    sums, _ = np.histogram(masses, bins=edges, weights=masses)
    keep = hist > 0
    light_rows = max(0.0, n - heavy_rows * h)
    p_light = sums[keep] / hist[keep]
    c_light = hist[keep] / bins * light_rows
    p_heavy = pop.p[heavy] + mean_light_extra
    c_heavy = pop.count[heavy] * h
    return Popularity(p=np.concatenate([p_heavy, p_light]), count=np.concatenate([c_heavy, c_light]),
                      source=f"{pop.source} x multi-hot {h}",
                      group=np.concatenate([np.full(p_heavy.size, float(h)), np.ones(p_light.size)]))


@dataclass(frozen=True)
class ShardTraffic:
    """One GPU's steady-state traffic for one tiered table at a cache fraction, per step."""

    ids: float  # ids looked up (batch x hotness)
    unique_rows: float  # distinct rows asked for
    fetched_rows: float  # rows copied host -> device (LRU steady state), mean
    fetched_var: float  # their variance from step to step
    hit_rate: float  # hits / distinct rows asked for
    #: distinct rows of j consecutive batches, j = 1..
    union_rows: Tuple[float, ...]
    cache_rows: float

    def lead(self, depth: int) -> int:
        """The prefetch lead a batch gets: ``depth`` if the cache holds ``depth + 1`` batches'
        rows (pins), else the deepest that fits; 0 when even one batch does not fit."""
        for k in range(depth, 0, -1):
            if k + 1 <= len(self.union_rows) and self.union_rows[k] <= self.cache_rows:
                return k
        return 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _che_time(q: np.ndarray, count: np.ndarray, cache_rows: float) -> float:
    """Che's characteristic time ``T`` (steps): ``sum_rows (1 - (1 - q)^T) = C``."""
    lam = -np.log1p(-np.minimum(q, 1 - 1e-15))

    def filled(t: float) -> float:
        return float(np.sum(count * -np.expm1(-lam * t)))

    lo, hi = 1e-9, 1.0
    while filled(hi) < cache_rows and hi < 1e15:
        hi *= 2.0
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if filled(mid) < cache_rows:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-9:
            break
    return math.sqrt(lo * hi)


def shard_traffic(pop: Popularity, batch: int, cache_fraction: float, max_union: int = 9) -> ShardTraffic:
    """Steady-state LRU traffic of one table (or a row-wise shard of it) at ``cache_fraction``
    of its rows, ``batch`` samples a step (module docstring). Write-backs equal fetches in
    steady state (every evicted row was fetched for a lookup and updated by its backward)."""
    if not 0 < cache_fraction <= 1:
        raise ValueError(f"cache_fraction must be in (0, 1], got {cache_fraction!r}")
    count = pop.count
    group = pop.group if pop.group is not None else np.ones_like(count)
    rows = float(count.sum())
    cache = cache_fraction * rows
    q = -np.expm1(batch * np.log1p(-np.minimum(pop.p, 1 - 1e-15)))  # P(a row is requested in a step)
    unique = float(np.sum(count * q))
    log_miss = np.log1p(-np.minimum(q, 1 - 1e-15))
    unions = tuple(float(np.sum(count * -np.expm1(j * log_miss))) for j in range(1, max_union + 1))
    ids = batch * pop.ids_per_sample
    if cache >= rows:
        return ShardTraffic(ids, unique, 0.0, 0.0, 1.0, unions, cache)
    t = _che_time(q, count, cache)
    miss = q * np.exp(log_miss * t)  # requested this step and not within the T steps before
    fetched = float(np.sum(count * miss))
    var = float(np.sum(count * miss * (1 - miss) * group))  # a multi-hot id's rows miss together
    return ShardTraffic(ids, unique, fetched, var, 1.0 - fetched / unique if unique else 1.0, unions, cache)


def multi_hot_ids(rng: np.random.Generator, rows: int, alpha: float, samples: int, hotness: int,
                  table_seed: int = 0) -> np.ndarray:
    """Ids of one table for ``samples`` samples, ``[samples, hotness]``, as MLPerf's synthetic
    multi-hot generator makes them from one-hot ids (uniform: one-hot id ``v`` brings the
    fixed rows ``g_j(v)``, ``j < hotness``, drawn uniformly once per id), the one-hot ids Zipf
    ranks scattered over the rows by a fixed permutation (hot rows lie anywhere)."""
    from ..data.criteo_synth import sample_zipf_ranks

    ranks = sample_zipf_ranks(rng, rows, alpha, samples).astype(np.int64)
    out = np.empty((samples, hotness), dtype=np.int64)
    # column 0: the id's own row, ranks scattered by a fixed bijection (an affine map mod rows)
    mult = next(m for m in (1_000_003, 999_983, 7) if math.gcd(m, rows) == 1)
    out[:, 0] = (ranks * mult + 12_345 + table_seed) % rows
    r64 = ranks.astype(np.uint64)
    for j in range(1, hotness):
        # a keyed hash of (id, j): fixed per id, uniform over the rows
        out[:, j] = (_mix64(r64 * np.uint64(hotness) + np.uint64(j), table_seed) % np.uint64(rows)).astype(np.int64)
    return out


def _mix64(x: np.ndarray, key: int) -> np.ndarray:
    z = (x + np.uint64((0x9E3779B97F4A7C15 * (key + 1)) & 0xFFFFFFFFFFFFFFFF))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
