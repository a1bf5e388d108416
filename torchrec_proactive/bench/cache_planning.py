"""``bench --cache-planning``: planner-chosen cache sizes vs one uniform load factor, equal bytes.

Skewed tables (different Zipf exponents and sizes) train on one rank with an emulated link.
Their curves are measured on a separate sample of batches (the profile), TorchRec's planner
with :mod:`torchrec_proactive.cacheplan.planner` picks per-table load factors under
``budget_bytes``, and the *uniform* arm gets one load factor with the same total cache bytes
(rounded down, so never more). Every arm keeps TorchRec's grouping: the four tables are one
group, one store, one plan and one lookup per step. In ``uniform`` and ``planned`` each table
has its own budget of that store's slots (``table_budgets="per_table"``; for the planned
load factors, which differ, the default ``auto`` does it); the third arm, ``uniform_shared``, is the
uniform load factor in one cache shared by the tables (``table_budgets="shared"``: any
table's rows in any slot; the default for equal load factors). The arms train on the same batches,
from the same weights, in alternating rounds, and report ``{hit_rate, rows_fetched_per_step, step_ms,
cache_bytes}`` (step_ms: the median step, a measurement on a shared CPU; the counters are
deterministic).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Tuple

import torch

from ..fetch import LinkModel
from ..quiet import quiet_third_party
from ..integration.pipeline import ProactiveTrainPipeline
from ..integration.sharder import ProactiveEmbeddingBagCollectionSharder
from ..planning import build_plan, combined_optimizer, shard_model
from .rank import BenchSettings, _fused, _summarize, _train
from .workload import DLRMTrainModel, Workload

__all__ = ["SkewedWorkload", "PlanningCase", "cache_planning_rank", "run_cache_planning"]


@dataclass(frozen=True)
class SkewedWorkload(Workload):
    """Tables of different sizes and Zipf exponents."""

    table_rows: Tuple[int, ...] = (200_000, 100_000, 50_000, 20_000)
    table_alphas: Tuple[float, ...] = (1.2, 0.7, 1.05, 0.5)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.table_rows) != len(self.table_alphas) or not self.table_rows:
            raise ValueError(f"table_rows {self.table_rows} and table_alphas {self.table_alphas} must pair up")

    def cardinalities(self) -> List[int]:
        return list(self.table_rows)

    def alphas(self) -> List[float]:
        return list(self.table_alphas)


@dataclass(frozen=True)
class PlanningCase:
    """The case's workload, budget and measurement."""

    workload: SkewedWorkload = field(default_factory=lambda: SkewedWorkload(embedding_dim=32, batch_size=512))
    prefetch_depth: int = 2
    budget_bytes: int = 0  # per device; 0: a quarter of the tables' bytes (TorchRec counts optimizer state and I/O too)
    profile_steps: int = 300  # long enough for the caches to fill: capacity misses, not cold ones
    warmup_steps: int = 150  # the caches fill before the measured steps
    measure_steps: int = 100
    rounds: int = 2
    link_bandwidth_gbps: float = 0.5
    link_latency_us: float = 100.0

    @property
    def budget(self) -> int:
        w = self.workload
        return self.budget_bytes or sum(w.cardinalities()) * w.embedding_dim * 4 // 4


def _slots(load_factors: Dict[str, float], rows: Dict[str, int]) -> Dict[str, int]:
    return {t: max(1, int(round(lf * rows[t]))) for t, lf in load_factors.items()}


def cache_planning_rank(rank: int, world_size: int, case: PlanningCase) -> Dict[str, Any]:
    """Profiles, plans and trains both arms on this (single) rank."""
    from ..cacheplan.planner import plan_cache_sizes
    from ..cacheplan.profile import profile_batches

    warnings.filterwarnings("ignore", message=r".*device cache.*", category=UserWarning)
    w = case.workload
    tables = w.tables()
    rows = {t.name: t.num_embeddings for t in tables}
    row_bytes = w.embedding_dim * 4
    # The profile: a sample of the same distribution, not the batches measured below.
    curves = profile_batches((b.sparse_features for b in w.batches(case.profile_steps, rank + 1000)), tables,
                             depth=case.prefetch_depth, warmup=case.profile_steps // 5)
    model = DLRMTrainModel(w)
    plan = plan_cache_sizes(model, ProactiveEmbeddingBagCollectionSharder(fused_params=_fused()), curves,
                            case.budget, case.prefetch_depth, world_size, batch_size=w.batch_size)
    planned = _slots(plan.load_factors, rows)
    planned_bytes = sum(planned.values()) * row_bytes
    u = planned_bytes / (sum(rows.values()) * row_bytes)
    uniform = {t: max(1, int(u * n)) for t, n in rows.items()}  # rounded down: never more bytes

    settings = BenchSettings(workload=w, sharding="table_wise", warmup_steps=case.warmup_steps,
                             measure_steps=case.measure_steps)
    batches = w.batches(case.warmup_steps + case.measure_steps, rank)
    torch.manual_seed(1234)
    init_state = DLRMTrainModel(w).state_dict()
    link = LinkModel(bandwidth_gbps=case.link_bandwidth_gbps, latency_us=case.link_latency_us)
    # Through the plan's CacheParams, as a user's plan carries them. TorchRec groups the
    # tables into one store whatever their load factors; the store splits its slots into
    # per-table budgets, or (uniform_shared) lets the tables share them.
    arms = {"uniform": {t: slots / rows[t] for t, slots in uniform.items()},
            "planned": {t: slots / rows[t] for t, slots in planned.items()}}
    arms["uniform_shared"] = arms["uniform"]
    budgets = {"uniform": "per_table", "planned": "auto", "uniform_shared": "shared"}
    runs: Dict[str, list] = {name: [] for name in arms}
    stores: Dict[str, int] = {}
    sizes: Dict[str, Any] = {}
    for r in range(case.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):  # alternate which runs first
            sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=_fused(), link=link,
                                                             table_budgets=budgets[name])
            torch.manual_seed(0)
            model = DLRMTrainModel(w)
            plan_ = build_plan(model, sharder, "table_wise", kernel="fused_uvm_caching", cache_load_factor=arms[name])
            dmp = shard_model(model, sharder, plan_, torch.device("cpu"))
            dmp.load_state_dict(copy.deepcopy(init_state))
            opt = combined_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=settings.learning_rate))
            pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=case.prefetch_depth)
            runs[name].append(_train(pipe, batches, case.warmup_steps))
            ebc = dmp.module.model.sparse_arch.embedding_bag_collection
            stores[name] = len(ebc.named_tables())
            sizes[name] = ebc.cache_sizes()
            pipe.detach()
    out: Dict[str, Any] = {"budget_bytes": case.budget, "prefetch_depth": case.prefetch_depth,
                           "load_factors": plan.load_factors, "plan_log": plan.describe(),
                           "uniform_load_factor": u,
                           "tables": {t.name: {"rows": t.num_embeddings, "zipf_alpha": a,
                                               "expected_lookups": curves[t.name].expected_lookups,
                                               "cacheability": curves[t.name].cacheability,
                                               "min_load_factor": curves[t.name].min_load_factor}
                                      for t, a in zip(tables, w.alphas())}}
    for name, slots in (("uniform", uniform), ("planned", planned), ("uniform_shared", uniform)):
        s = _summarize(name, settings, runs[name], world_size, {})
        out[name] = {"hit_rate": s["hit_rate"], "rows_fetched_per_step": s["rows_fetched_per_step"],
                     "step_ms": s["step_ms_median"], "cache_bytes": sum(slots.values()) * row_bytes,
                     "slots": slots, "stores": stores[name], "table_budgets": budgets[name],
                     "per_table_slots": {t: v["num_slots"] for store in sizes[name].values()
                                         for t, v in store.get("tables", {}).items()},
                     "deferred_batches_per_step": s["deferred_batches_per_step"],
                     "rows_fetched_at_lookup_per_step": s["rows_fetched_at_lookup_per_step"]}
    p, un = out["planned"], out["uniform"]
    out["ratios"] = {
        "rows_fetched_planned_over_uniform": (p["rows_fetched_per_step"] / un["rows_fetched_per_step"]
                                              if un["rows_fetched_per_step"] else None),
        "step_ms_planned_over_uniform": p["step_ms"] / un["step_ms"] if un["step_ms"] else None,
        "rows_fetched_planned_over_uniform_shared": (p["rows_fetched_per_step"] / out["uniform_shared"]["rows_fetched_per_step"]
                                                     if out["uniform_shared"]["rows_fetched_per_step"] else None),
        "step_ms_planned_over_uniform_shared": (p["step_ms"] / out["uniform_shared"]["step_ms"]
                                                if out["uniform_shared"]["step_ms"] else None),
    }
    out["settings"] = {**asdict(case), "budget_bytes": case.budget}
    return out


def run_cache_planning(case: PlanningCase, timeout_s: float = 1800) -> Dict[str, Any]:
    """Runs the case on one spawned gloo rank; returns its ``cache_planning`` section."""
    from ..launch import run_ranks

    return run_ranks(_worker, world_size=1, timeout_s=timeout_s, case=case)[0]


def _worker(rank: int, world_size: int, case: PlanningCase) -> Dict[str, Any]:
    quiet_third_party()
    return cache_planning_rank(rank, world_size, case)


def summary_line(out: Dict[str, Any]) -> str:
    """The bench's one-line summary of the case."""
    p, u, sh = out["planned"], out["uniform"], out["uniform_shared"]
    r = out["ratios"]
    return (f"cache planning (budget {out['budget_bytes']} bytes, depth {out['prefetch_depth']}, equal cache bytes "
            f"{p['cache_bytes']}): rows fetched/step planned {p['rows_fetched_per_step']:.1f} vs uniform "
            f"{u['rows_fetched_per_step']:.1f} (x{r['rows_fetched_planned_over_uniform']:.2f}; one cache shared by the tables: "
            f"{sh['rows_fetched_per_step']:.1f}), hit rate {p['hit_rate']:.3f} vs {u['hit_rate']:.3f}, step "
            f"{p['step_ms']:.2f} vs {u['step_ms']:.2f} ms (shared: {sh['step_ms']:.2f}; emulated link, shared CPU)")
