"""A run's cache profile and planned cache sizes (``cache.budget_bytes > 0``, ``profile-cache``).

Rank 0 samples ``cache.profile_batches`` global batches of the training split (every rank's
loader, batch ``t`` of each, together: what a table-wise shard sees), measures each table's
miss-ratio curve at the run's prefetch depth and saves the profile; later runs reuse it while
its fingerprint (data files, tables, batch size, world size, depth, sample size) matches.
With a budget, rank 0 then runs the cache planner and every rank gets its plan: per-table
slots never below the floor of the store's planner (``MissRatioCurve.for_planner``: the
device planner, on CUDA, counts a batch by its ids until its sizes come back), and the load
factors the run's own TorchRec plan carries.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig
from torchrec.distributed.types import ShardingPlan

from ..cacheplan.curve import MissRatioCurve
from ..cacheplan.host_plan import HostBudgetError, plan_host_caches
from ..cacheplan.planner import WHOLE_ROW_SHARDINGS, CacheBudgetError, CachePlan, budget_refusal, plan_cache_sizes
from ..cacheplan.profile import PROFILE_FILE, fingerprint, load_profile, profile_batches, save_profile
from ..config.schema import Config
from ..data.criteo import PreprocessedCriteo, make_dataloaders
from ..integration.disk_tier import KEY_VALUE
from . import data as data_lib
from .errors import ConfigError, PeerFailure, UserError


def profile_path(cfg: Config) -> Path:
    return Path(cfg.cache.profile_path) if cfg.cache.profile_path else data_lib.dataset_dir(cfg.data) / PROFILE_FILE


def _data_files(pre: PreprocessedCriteo) -> List[Path]:
    return [Path(p) for group in (pre.dense_paths, pre.sparse_paths, pre.labels_paths) for p in group]


def global_batch(parts: Sequence[Any]) -> Any:
    """One KJT of the ranks' batches ``parts`` (same keys): each key's ids of every rank, in
    rank order - the ids a table-wise shard receives for the step. (``KeyedJaggedTensor.concat``
    joins *keys*: with the same keys twice a table would see one rank's ids only.)"""
    from torchrec import KeyedJaggedTensor

    if len(parts) == 1:
        return parts[0]
    keys = list(parts[0].keys())
    per_rank = [p.to_dict() for p in parts]
    values = [jt[k].values() for k in keys for jt in per_rank]
    lengths = [jt[k].lengths() for k in keys for jt in per_rank]
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _global_batches(pre: PreprocessedCriteo, cfg: Config, world_size: int):
    """Batch ``t`` of every rank's training loader, as one KJT (:func:`global_batch`)."""
    loaders = [iter(make_dataloaders(pre, cfg.train.batch_size, r, world_size, eval_fraction=cfg.data.eval_fraction,
                                     shuffle_batches=cfg.data.shuffle_batches)[0]) for r in range(world_size)]
    for _ in range(cfg.cache.profile_batches):
        try:
            parts = [next(it).sparse_features for it in loaders]
        except StopIteration:
            return
        yield global_batch(parts)


def profile_here(cfg: Config, pre: PreprocessedCriteo, tables: Sequence[EmbeddingBagConfig], world_size: int,
                 depth: int, log: logging.Logger, path: Optional[Path] = None
                 ) -> Tuple[Dict[str, MissRatioCurve], Path, bool]:
    """The curves (reused from the saved profile at ``path``, default :func:`profile_path`,
    if its fingerprint matches), where they are, and whether they were reused."""
    path = path or profile_path(cfg)
    fp = fingerprint(_data_files(pre), tables=[(t.name, t.num_embeddings, list(t.feature_names)) for t in tables],
                     batch_size=cfg.train.batch_size, world_size=world_size, depth=depth,
                     profile_batches=cfg.cache.profile_batches, eval_fraction=cfg.data.eval_fraction)
    found = load_profile(path, fp)
    if found is not None:
        return found[0], path, True
    batches = list(_global_batches(pre, cfg, world_size))
    # The warm-up (batches that only fill the cache) is a share of what was read: the
    # training split may hold fewer batches than cache.profile_batches asks for.
    warmup = min(len(batches) // 5, 50)
    curves = profile_batches(batches, tables, depth=depth, warmup=warmup)
    save_profile(path, curves, fp, {"world_size": world_size, "global_batch": cfg.train.batch_size * world_size,
                                    "prefetch_depth": depth, "profile_batches": cfg.cache.profile_batches,
                                    "batches_read": len(batches), "warmup_batches": warmup})
    short = (f" (cache.profile_batches={cfg.cache.profile_batches}: the training split holds only {len(batches)})"
             if len(batches) < cfg.cache.profile_batches else "")
    log.info("cache profile: %d tables, %d global batches read%s, the first %d only warm the cache, at depth %d -> %s",
             len(curves), len(batches), short, warmup, depth, path)
    return curves, path, False


def _on_rank0(fn: Any) -> Any:
    """``fn()`` on rank 0, its result (or its one-line error) on every rank."""
    box: List[Any] = [None, None]
    failure: Optional[BaseException] = None
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except (UserError, ValueError) as e:
            failure = e if isinstance(e, UserError) else ConfigError(str(e))
            box[1] = str(e)
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[1] is not None:
        raise PeerFailure(f"rank 0 failed to plan the caches: {box[1]}", origin_rank=0, user_message=box[1])
    return box[0]


def _plan(cfg: Config, model: torch.nn.Module, sharder: Any, curves: Dict[str, MissRatioCurve], depth: int,
          world_size: int, local_size: int, device: torch.device, minimum_only: bool = False) -> CachePlan:
    """The cache planner on the curves, with the floors of the planner the run's stores use;
    table- and column-wise shardings only (the curves measure whole tables: see
    ``WHOLE_ROW_SHARDINGS``; the run's plan keeps to them too)."""
    on_device = sharder.options.plans_on_device(device)
    curves = {t: c.for_planner(on_device) for t, c in curves.items()}
    budget = cfg.cache.budget_bytes if cfg.cache.budget_bytes > 0 else None  # -1: the HBM left over
    if minimum_only and budget is None:
        budget = 1  # (only the minimum is wanted: no budget to check)
    try:
        return plan_cache_sizes(model, sharder, curves, budget, depth, world_size, local_size,
                                device_type=device.type, batch_size=cfg.train.batch_size,
                                sharding_types=WHOLE_ROW_SHARDINGS, minimum_only=minimum_only)
    except CacheBudgetError as e:
        raise ConfigError(str(e)) from None


def plan_run_caches(cfg: Config, model: torch.nn.Module, sharder: Any, pre: PreprocessedCriteo,
                    tables: Sequence[EmbeddingBagConfig], world_size: int, local_size: int, device: torch.device,
                    depth: int, run_dir: Path, log: logging.Logger) -> CachePlan:
    """Profile (or reuse it) and plan on rank 0; the plan on every rank; the profile copied
    into ``run_dir`` for the record. A budget too small is a :class:`ConfigError` (one line,
    naming the minimum in bytes)."""
    def work() -> CachePlan:
        curves, path, reused = profile_here(cfg, pre, tables, world_size, depth, log)
        if reused:
            log.info("cache profile: reused %s (same data, tables, batch and depth)", path)
        plan = _plan(cfg, model, sharder, curves, depth, world_size, local_size, device)
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, run_dir / PROFILE_FILE)
        return plan

    plan = _on_rank0(work)
    log.info("%s", plan.describe())
    if cfg.cache.eviction_policy != "lru":  # (TorchRec's scale-up proposer assumes LRU as well)
        log.info("cache plan: the curves model LRU eviction; with cache.eviction_policy=%s the hit rates differ "
                 "from the planned ones (the sizes still hold the pinned rows)", cfg.cache.eviction_policy)
    return plan


def host_profile_path(cfg: Config) -> Path:
    """The host caches' profile, beside the device caches' (another depth: the disk's)."""
    path = profile_path(cfg)
    return path.with_name(f"{path.stem}_host{path.suffix}")


def plan_run_host_caches(cfg: Config, pre: PreprocessedCriteo, tables: Sequence[EmbeddingBagConfig],
                         sharding_plan: ShardingPlan, world_size: int, log: logging.Logger, depth: int,
                         device_slots: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """``tier.host_budget_mb``: each table's host cache in bytes, planned on rank 0 from the
    data's curves at the disk ``depth`` (:func:`~torchrec_proactive.cacheplan.host_plan.plan_host_caches`),
    each rank's budget over the tables the (table-wise) plan put on it, beside their device
    caches (``device_slots``); the same on every rank. A budget below a rank's floors is a
    :class:`ConfigError` naming ``tier.host_budget_mb``."""
    from ..store import OptimizerConfig as StoreOptimizer
    from ..store.tiered_table import disk_record_bytes
    from .model import fused_params

    optimizer = StoreOptimizer.from_fused_params(fused_params(cfg.optimizer))
    dims = {t.name: t.embedding_dim for t in tables}
    on_rank: Dict[int, List[str]] = {}
    for module_plan in sharding_plan.plan.values():
        for name, ps in module_plan.items():  # type: ignore[union-attr]
            if name in dims and ps.compute_kernel == KEY_VALUE:
                on_rank.setdefault(int(ps.ranks[0]), []).append(name)  # (table-wise: one rank)
    budget = int(cfg.tier.host_budget_mb * 2**20)

    def work() -> Dict[str, int]:
        curves, path, reused = profile_here(cfg, pre, tables, world_size, depth, log, host_profile_path(cfg))
        log.info("host cache profile: %s %s (at the disk depth %d); tier.host_budget_mb=%g plans the host caches "
                 "(tier.host_cache_mb is not used)", "reused" if reused else "measured", path, depth,
                 cfg.tier.host_budget_mb)
        out: Dict[str, int] = {}
        for rank, names in sorted(on_rank.items()):
            try:
                plan = plan_host_caches({n: curves[n] for n in names},
                                        {n: disk_record_bytes(dims[n], optimizer) for n in names}, budget,
                                        device_slots={n: int((device_slots or {}).get(n, 0)) for n in names})
            except HostBudgetError as e:
                floors = ", ".join(f"{t} {n} rows" for t, n in sorted(e.floors.items()))
                raise ConfigError(
                    f"tier.host_budget_mb={cfg.tier.host_budget_mb:g} is too small for rank {rank}'s tables on disk: "
                    f"their host caches need at least {e.minimum_bytes / 2**20:.4g} MiB ({floors}: the rows "
                    f"{depth + 1} batches pin, and a batch's write-backs); raise tier.host_budget_mb to at least "
                    f"{math.ceil(e.minimum_bytes / 2**20 * 1e4) / 1e4:g} or lower tier.disk_depth (now {depth})"
                ) from None
            log.info("rank %d %s", rank, plan.describe())
            out.update(plan.host_cache_bytes)
        return out

    return _on_rank0(work)


_checked: Dict[Tuple[str, int], CachePlan] = {}


def refuse_budget_before_launch(cfg: Config, world_size: int) -> None:
    """Refuses a ``cache.budget_bytes`` below the minimum (:class:`ConfigError`, the same one
    line the ranks would raise) in the launching process, before any rank starts and before
    anything is written in the run directory. Prepares the data and measures the profile here
    (saved where the ranks look: they reuse both); the minimum needs only the tables' shapes.
    Nothing to do without a given budget (0, or -1: the device's memory, known to the ranks)."""
    if cfg.cache.budget_bytes <= 0 or cfg.sharding.type != "auto":
        return
    from .compose import config_hash
    from .model import build_model, build_sharder, table_configs

    key = (config_hash(cfg), world_size)
    if key not in _checked:
        log = logging.getLogger("torchrec_proactive.launcher")
        if not log.handlers:  # what it makes (data, profile) is said here; what it reuses, by the ranks
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s [launcher] %(message)s", "%H:%M:%S"))
            handler.addFilter(lambda record: "reusing" not in record.getMessage())
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False
        pre = data_lib.prepare_here(cfg.data, log)
        pre = data_lib.hash_to_tables(pre, cfg.model.num_embeddings_per_feature, data_lib.QUIET)
        tables = table_configs(cfg.model, pre.cardinalities)
        depth = cfg.cache_depth
        curves, _, _ = profile_here(cfg, pre, tables, world_size, depth, log)
        device = torch.device("cuda" if cfg.train.device == "cuda" or (cfg.train.device == "auto"
                                                                      and torch.cuda.is_available()) else "cpu")
        model = build_model(cfg.model, pre.cardinalities, torch.device("cpu"))  # (tables on meta: shapes only)
        _checked[key] = _plan(cfg, model, build_sharder(cfg, {}), curves, depth, world_size, world_size, device,
                              minimum_only=True)
    floor = _checked[key]
    if cfg.cache.budget_bytes < floor.min_budget_bytes:
        # the planner's own refusal, word for word (the ranks' planner checks the same minimum first)
        raise ConfigError(str(budget_refusal(cfg.cache.budget_bytes, floor.min_budget_bytes, floor.min_slots,
                                             floor.prefetch_depth, world_size)))


def run_profile(cfg: Config) -> Dict[str, Any]:
    """``profile-cache``: the profile (and, with ``cache.budget_bytes``, the plan) on rank 0."""
    from .env import make_env, setup_logging
    from .model import build_model, build_sharder, table_configs

    env = make_env(cfg)
    log = setup_logging(env)
    pre = data_lib.prepare(cfg.data, log)
    tables = table_configs(cfg.model, pre.cardinalities)
    depth = cfg.prefetch.capacity_depth

    def work() -> Dict[str, Any]:
        curves, path, reused = profile_here(cfg, pre, tables, env.world_size, depth, log)
        model, sharder = build_model(cfg.model, pre.cardinalities, env.device), build_sharder(cfg, {})
        # the minimum budget is the same figure a budget below it is refused with
        floor = _plan(cfg, model, sharder, curves, depth, env.world_size, env.local_world_size, env.device,
                      minimum_only=True)
        out: Dict[str, Any] = {
            "profile": str(path), "reused": reused, "prefetch_depth": depth,
            "min_budget_bytes": floor.min_budget_bytes,
            "tables": {n: {"rows": c.num_rows, "expected_lookups": c.expected_lookups,
                           "cacheability": c.cacheability, "min_slots": floor.min_slots[n],
                           "min_load_factor": floor.min_slots[n] / c.num_rows}
                       for n, c in curves.items()}}
        if cfg.cache.budget_bytes:
            plan = _plan(cfg, model, sharder, curves, depth, env.world_size, env.local_world_size, env.device)
            out["plan"] = {"log": plan.describe(), "slots": plan.slots, "load_factors": plan.load_factors,
                           "cache_bytes": plan.cache_bytes}
            for n, t in out["tables"].items():
                # the miss rate the curve expects of the planned cache (warm batches' distinct rows)
                t["planned_slots"] = plan.slots[n]
                t["planned_miss_rate"] = curves[n].expected_miss_rate(plan.slots[n] / curves[n].num_rows)
        return out

    return _on_rank0(work)
