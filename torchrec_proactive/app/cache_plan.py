"""A run's cache profile and planned cache sizes (``cache.budget_bytes > 0``, ``profile-cache``).

Rank 0 samples ``cache.profile_batches`` global batches of the training split (every rank's
loader, batch ``t`` of each, together: what a table-wise shard sees), measures each table's
miss-ratio curve at the run's prefetch depth and saves the profile; later runs reuse it while
its fingerprint (data files, tables, batch size, world size, depth, sample size) matches.
With a budget, rank 0 then runs the cache planner and every rank gets its load factors.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig

from ..cacheplan.curve import MissRatioCurve
from ..cacheplan.planner import CacheBudgetError, CachePlan, plan_cache_sizes
from ..cacheplan.profile import PROFILE_FILE, fingerprint, load_profile, profile_batches, save_profile
from ..config.schema import Config
from ..data.criteo import PreprocessedCriteo, make_dataloaders
from . import data as data_lib
from .errors import ConfigError, PeerFailure, UserError


def profile_path(cfg: Config) -> Path:
    return Path(cfg.cache.profile_path) if cfg.cache.profile_path else data_lib.dataset_dir(cfg.data) / PROFILE_FILE


def _data_files(pre: PreprocessedCriteo) -> List[Path]:
    return [Path(p) for group in (pre.dense_paths, pre.sparse_paths, pre.labels_paths) for p in group]


def _global_batches(pre: PreprocessedCriteo, cfg: Config, world_size: int):
    """Batch ``t`` of every rank's training loader, as one KJT per table feature set."""
    loaders = [iter(make_dataloaders(pre, cfg.train.batch_size, r, world_size, eval_fraction=cfg.data.eval_fraction,
                                     shuffle_batches=cfg.data.shuffle_batches)[0]) for r in range(world_size)]
    from torchrec import KeyedJaggedTensor

    for _ in range(cfg.cache.profile_batches):
        try:
            parts = [next(it).sparse_features for it in loaders]
        except StopIteration:
            return
        yield KeyedJaggedTensor.concat(parts) if len(parts) > 1 else parts[0]


def profile_here(cfg: Config, pre: PreprocessedCriteo, tables: Sequence[EmbeddingBagConfig], world_size: int,
                 depth: int, log: logging.Logger) -> Tuple[Dict[str, MissRatioCurve], Path, bool]:
    """The curves (reused from the saved profile if its fingerprint matches), where they are,
    and whether they were reused."""
    path = profile_path(cfg)
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


def plan_run_caches(cfg: Config, model: torch.nn.Module, sharder: Any, pre: PreprocessedCriteo,
                    tables: Sequence[EmbeddingBagConfig], world_size: int, local_size: int, device: torch.device,
                    depth: int, run_dir: Path, log: logging.Logger) -> CachePlan:
    """Profile (or reuse it) and plan on rank 0; the plan on every rank; the profile copied
    into ``run_dir`` for the record. A budget too small is a :class:`ConfigError` (one line)."""
    def work() -> CachePlan:
        curves, path, reused = profile_here(cfg, pre, tables, world_size, depth, log)
        if reused:
            log.info("cache profile: reused %s (same data, tables, batch and depth)", path)
        budget = cfg.cache.budget_bytes if cfg.cache.budget_bytes > 0 else None  # -1: the HBM left over
        try:
            plan = plan_cache_sizes(model, sharder, curves, budget, depth, world_size, local_size,
                                    device_type=device.type, batch_size=cfg.train.batch_size)
        except CacheBudgetError as e:
            raise ConfigError(str(e)) from None
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, run_dir / PROFILE_FILE)
        return plan

    plan = _on_rank0(work)
    log.info("%s", plan.describe())
    if cfg.cache.eviction_policy != "lru":  # (TorchRec's scale-up proposer assumes LRU as well)
        log.info("cache plan: the curves model LRU eviction; with cache.eviction_policy=%s the hit rates differ "
                 "from the planned ones (the sizes still hold the pinned rows)", cfg.cache.eviction_policy)
    return plan


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
        out: Dict[str, Any] = {"profile": str(path), "reused": reused, "prefetch_depth": depth,
                               "tables": {n: {"expected_lookups": c.expected_lookups, "cacheability": c.cacheability,
                                              "min_load_factor": c.min_load_factor,
                                              "miss_rate_at_load_factor": c.expected_miss_rate(cfg.cache.load_factor)}
                                          for n, c in curves.items()}}
        if cfg.cache.budget_bytes:
            model = build_model(cfg.model, pre.cardinalities, env.device)
            try:
                budget = cfg.cache.budget_bytes if cfg.cache.budget_bytes > 0 else None
                plan = plan_cache_sizes(model, build_sharder(cfg, {}), curves, budget, depth,
                                        env.world_size, env.local_world_size, device_type=env.device.type,
                                        batch_size=cfg.train.batch_size)
            except CacheBudgetError as e:
                raise ConfigError(str(e)) from None
            out["plan"] = {"log": plan.describe(), "load_factors": plan.load_factors, "cache_bytes": plan.cache_bytes}
        return out

    return _on_rank0(work)
