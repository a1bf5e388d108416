"""One training run on this rank: the pieces, built by small factories, then the loop.

Called on every rank of an initialised process group (``entry.rank_main`` does that for
the CLI, the example script and torchx).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import ProactiveTrainPipeline
from ..config.schema import Config
from . import data as data_lib
from . import model as model_lib
from .checkpoint import Checkpointer
from .compose import to_yaml
from .env import check_same_config, cpu_build_note, make_env, seed_everything, setup_logging
from .loop import Summary, Trainer, check_resume
from .result import TrainResult
from .rundir import check_run_dir, checkpoint_dir, latest_checkpoint
from .sequence import history_spec


def run_training(cfg: Config) -> Summary:
    """Builds the run, resumes it if asked to, trains it; returns rank-local results. Rank 0
    writes the result (``TrainResult``) to ``<train.output_dir>/result.json``."""
    trainer = build_run(cfg)
    trainer.resume()
    summary = trainer.fit()
    trainer.log.info("done: %d steps, depth %d, %s", summary.steps, summary.depth, format_steady(summary.steady))
    if trainer.env.is_main:
        path = TrainResult.from_summary(asdict(summary)).write(cfg.train.output_dir)
        trainer.log.info("result: %s", path)
    return summary


def build_run(cfg: Config, cache_depth: Optional[int] = None, log_config: bool = True,
              host_cache_depth: Optional[int] = None) -> Trainer:
    """Everything a run needs, ready to ``fit``. Caches are sized for ``cache_depth``
    (default: ``cache.sized_for_depth``, else the deepest depth the prefetch config may use);
    planned host caches (``tier.host_budget_mb``) for ``host_cache_depth`` (default: the
    deeper of ``tier.disk_depth`` and the caches' depth). ``log_config=False`` skips the
    config line (``compare`` builds two runs of one config, with one size for both)."""
    check_run_dir(cfg)  # before anything is written there
    env = make_env(cfg)
    log = setup_logging(env)
    digest = check_same_config(cfg, env)  # before anything collective depends on the config
    checkpointer = None
    if cfg.train.save_checkpoints:
        checkpointer = Checkpointer(checkpoint_dir(cfg), env.rank, env.world_size, cfg.train.keep_checkpoints, log)
        resume_from = checkpointer.latest() if cfg.train.resume else None
        if resume_from is not None:  # a checkpoint that will be refused is refused before anything is written
            check_resume(checkpointer, resume_from, cfg)
    (env.output_dir / "config.yaml").write_text(to_yaml(cfg))
    if log_config:
        log.info("config %s on %d rank(s), device %s, link %s", digest, env.world_size, env.device,
                 describe_link(cfg))
        note = cpu_build_note() if cfg.train.device == "auto" else None
        if note:
            log.warning("%s", note)
    if cfg.train.resume and latest_checkpoint(checkpoint_dir(cfg)) is None:
        log.info("train.resume: no complete checkpoint in %s (set train.output_dir to the directory of the run "
                 "to continue); starting from scratch", checkpoint_dir(cfg))

    # Bars only on a terminal: the generator and preprocessing take a plain flag.
    progress = env.is_main and cfg.train.progress_bar and sys.stderr.isatty()
    # compare builds two runs on one data set with one cache size: say those things once
    pre = data_lib.prepare(cfg.data, log if log_config else data_lib.QUIET, progress=progress)
    pre = data_lib.hash_to_tables(pre, cfg.model.num_embeddings_per_feature, log if log_config else data_lib.QUIET)
    data = data_lib.loaders(pre, cfg.data, cfg.train.batch_size)
    if cfg.model.arch == "sequence":  # each sample's history, a function of the sample (data/history.py)
        data = data_lib.with_histories(data, history_spec(cfg.model, cfg.data.seed))
    if log_config:
        log.info("data: %d training steps per epoch per rank, %d eval batches, %d tables",
                 data.steps_per_epoch, len(data.eval), len(data.cardinalities))

    seed_everything(cfg.train.seed)
    model = model_lib.build_model(cfg.model, data.cardinalities, env.device)
    tables = model_lib.model_tables(cfg.model, data.cardinalities)
    depth = cfg.cache_depth if cache_depth is None else cache_depth
    sharder = model_lib.build_sharder(cfg, {}, tables)
    load_factors = None
    if cfg.cache.budget_bytes:  # per-table sizes from the data's curves (app/cache_plan.py)
        from .cache_plan import plan_run_caches

        cache_plan = plan_run_caches(cfg, model, sharder, pre, tables, env.world_size, env.local_world_size,
                                     env.device, depth, Path(cfg.train.output_dir), log)
        # the plan's load factors for TorchRec's plan, its slots (each at least its floor,
        # an integer) for the stores, which take them as they are
        load_factors, slots = cache_plan.load_factors, dict(cache_plan.slots)
        plan = model_lib.plan(model, sharder, cfg, env, load_factors)
    else:
        plan = model_lib.plan(model, sharder, cfg, env, load_factors)
        # cache sizes from the plan's shards: sharding=auto may place a table whole on one rank
        slots, notes = model_lib.cache_slots(tables, cfg, env.world_size, env.local_world_size, depth,
                                             shard_rows=model_lib.shard_rows(plan))
        if notes and log_config:
            log.info("%s", model_lib.describe_growth(notes, depth))
    if cfg.tier.kind == "ssd" and cfg.tier.host_budget_mb:  # host caches from the data's curves too
        from .cache_plan import plan_run_host_caches

        host_depth = max(depth, cfg.tier.disk_depth or 0) if host_cache_depth is None else host_cache_depth
        host = plan_run_host_caches(cfg, pre, tables, plan, env.world_size, log, host_depth, device_slots=slots)
        sharder = model_lib.with_host_caches(sharder, host)
    dmp = model_lib.shard(model, model_lib.with_slots(sharder, slots), cfg, env, plan)
    optimizer = model_lib.build_optimizer(dmp, cfg.optimizer)
    pipeline = ProactiveTrainPipeline(dmp, optimizer, env.device, prefetch_depth=cfg.prefetch.initial_depth,
                                      disk_depth=cfg.tier.disk_depth)

    trainer = Trainer(cfg, env, dmp, optimizer, pipeline, data, checkpointer, log)
    shards: List[Any] = [None] * env.world_size
    dist.all_gather_object(shards, model_lib.cache_slots_of(dmp))
    trainer.summary.cache_slots = model_lib.table_slots(shards)
    return trainer


def describe_link(cfg: Config) -> str:
    if torch.cuda.is_available() and cfg.train.device != "cpu":
        return "the CUDA copy stream (link.* applies to CPU runs only)"
    if cfg.link.kind == "none":
        return "none (in-process copies)"
    return f"emulated ({cfg.link.bandwidth_gbps:g} GB/s, {cfg.link.latency_us:g} us per fetch)"


def format_steady(w: Dict[str, Any]) -> str:
    if not w:
        return "no steady-state window"
    # Which steps: the figures are not those of the last log window (the first steps, lazy
    # init and cold caches, are left out; a resumed run counts only what it trained).
    span = f"over steps {w['from_step'] + 1}-{w['from_step'] + w['steps']}: " if "from_step" in w else ""
    text = (f"{span}{w['samples_per_s']:.0f} samples/s, {w['step_ms']:.1f} ms/step, stall "
            f"{w['stall_ms_per_step']:.2f} ms/step, hit rate {w['hit_rate']:.3f}")
    if "rows_fetched_per_step" in w:  # (windows saved by older versions have none)
        fetched, at_lookup = w["rows_fetched_per_step"], w.get("rows_fetched_at_lookup_per_step", 0.0)
        share = f" ({100.0 * at_lookup / fetched:.0f}%)" if fetched else ""
        text += (f", rows fetched {fetched:.1f}/step/rank, {at_lookup:.1f} of them at lookup{share}, "
                 f"{int(w.get('deferred_batches', 0))} deferred batches, "
                 f"{w.get('overflow_rows_per_step', 0.0):.1f} overflow rows/step")
        if w.get("host_overflow_batches"):  # (tables on disk)
            text += f", {int(w['host_overflow_batches'])} batches through a host cache too small for them"
    if w.get("fell_back"):
        text += " - FELL BACK TO REACTIVE: prefetches waited for cache room (see the warning above)"
    return text

