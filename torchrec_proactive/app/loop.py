"""The training loop: segments of steps between drain points, logging, evaluation,
checkpoints, and the ``prefetch=auto`` warm-up.

The loop hands the pipeline one *segment* of batches at a time (``islice`` of the epoch's
iterator) and drives it until it drains. Segment ends are the only places where nothing
is in flight, so they are where checkpoints are taken, evaluation runs and the depth may
change: the end of the auto warm-up, every ``checkpoint_every`` steps, the end of an
epoch, the end of training, and wherever ``run(until)`` is asked to stop. Depth never
changes the numerics, so neither does where the segments end.

Throughput is measured on a clock that runs only while this trainer's steps run, so
evaluation, checkpoints - or another trainer interleaved with this one (``compare``) -
do not count.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from ..config.schema import Config
from .autodepth import agree, cache_depth_limit, choose_depth
from .checkpoint import Checkpointer, fused_optimizer_step, restore_param_groups, rng_state, set_rng_state
from .compose import config_hash, flatten
from .config_words import host_cache_key
from .resume import describe_changes, describe_progress, refuse_changes
from .errors import CheckpointError
from .rundir import MANIFEST
from .saved_state import check_saved_state
from .data import Loaders
from .env import RankEnv
from .preempt import EXIT_CODE, StopOnSignal
from .warmup import DenseWarmup
from .metrics import Window, evaluate, run_pipeline


@dataclass
class Position:
    """How far training got: steps done in total, and where in which epoch."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


def rescale_position(pos: Position, saved_world: int, world: int, steps_per_epoch: int) -> Position:
    """Where a run saved on ``saved_world`` ranks stands on ``world`` ranks: a step consumes
    ``world`` batches, so the epoch's samples done so far are ``batch_in_epoch * saved_world``
    batches; rounded down (at most one batch's samples are read again). The global step
    counts the new steps of the finished epochs plus the current one's. A point at or past
    the last whole step of the epoch here (the saved world's epoch may hold a batch more) is
    the start of the next epoch."""
    batch = pos.batch_in_epoch * saved_world // world
    epoch = pos.epoch
    if batch >= steps_per_epoch:
        epoch, batch = epoch + 1, 0
    return Position(step=epoch * steps_per_epoch + batch, epoch=epoch, batch_in_epoch=batch)


def check_position_in_epoch(manifest: Dict[str, Any], path: Any, steps_per_epoch: Optional[int]) -> None:
    """Raises :class:`CheckpointError` (one line) unless the saved ``batch_in_epoch`` is below
    ``steps_per_epoch``, the steps of an epoch of this run's data on the ranks that saved it
    (None: not known, nothing checked). The trainer never saves a position at an epoch's end
    (it is the next epoch's batch 0); the manifest's own numbers cannot bound it where only
    the data does (Criteo data in epoch 0 without ``train.max_steps``)."""
    state = manifest.get("state") if isinstance(manifest.get("state"), dict) else {}
    position = state.get("position") if isinstance(state.get("position"), dict) else {}
    batch = position.get("batch_in_epoch")
    if steps_per_epoch is None or not isinstance(batch, int) or batch < steps_per_epoch:
        return
    raise CheckpointError(f"{path}/{MANIFEST}: position.batch_in_epoch is {batch} in epoch {position.get('epoch')}, "
                          f"not below the {steps_per_epoch} batches an epoch of this data has on the "
                          f"{manifest.get('world_size')} rank(s) that saved it; refusing to load it")


def check_resume(ckpt: Checkpointer, path: Any, cfg: Config) -> Dict[str, Any]:
    """Collective; reads only. Refuses (:class:`CheckpointError`/``ConfigError``, every rank
    alike) a checkpoint whose files do not match their checksums, whose config differs where
    the saved state would be wrong, or whose saved values this trainer did not write; returns
    the config changes that are allowed (see :mod:`.resume`)."""
    manifest = ckpt.verify(path)
    changes = refuse_changes(manifest.get("config", {}), flatten(cfg), path)
    check_saved_state(manifest, path, [f.name for f in fields(Position)])
    return changes


@dataclass
class Summary:
    """A rank's results (``TrainResult.from_summary`` makes the documented JSON of it)."""

    steps: int = 0
    depth: int = 0
    train_loss: float = float("nan")  # mean over this rank's last log window
    steady: Dict[str, float] = field(default_factory=dict)  # after the first steps (Trainer.steady_from)
    evals: List[Dict[str, Any]] = field(default_factory=list)
    depth_choice: Optional[Dict[str, Any]] = None
    resumed_from: Optional[str] = None
    last_checkpoint: Optional[str] = None
    output_dir: Optional[str] = None
    already_finished: bool = False  # resumed a run that had trained all its steps
    cache_slots: Dict[str, int] = field(default_factory=dict)  # table -> rows its caches hold, all ranks


#: More than this share of the rows fetched at their lookup, with prefetches that waited for
#: cache room, is a run that fell back to reactive fetching: said once, as a warning.
FELL_BACK_SHARE = 0.05


def fell_back(steady: Dict[str, Any], depth: int) -> bool:
    """Whether a steady state meant to prefetch (``depth`` >= 1) fetched more than
    ``FELL_BACK_SHARE`` of its rows at their lookup because prefetches waited for cache room
    or rows overflowed: it ran mostly reactive."""
    fetched, at_lookup = steady.get("rows_fetched_per_step", 0.0), steady.get("rows_fetched_at_lookup_per_step", 0.0)
    waited = steady.get("deferred_batches", 0) or steady.get("overflow_rows_per_step", 0.0)
    return bool(depth >= 1 and fetched > 0 and at_lookup > FELL_BACK_SHARE * fetched and waited)


# Summary fields a checkpoint carries, so that resuming reports the whole run's results
# (a run resumed after its last step trains nothing and must still report them).
_CARRIED = ("train_loss", "steady", "evals", "depth_choice", "depth")


class Trainer:
    """``fit()`` = ``start()``, ``run(total)``, ``finish()``; ``run`` may be called with
    increasing ``until`` to interleave several trainers."""

    def __init__(self, cfg: Config, env: RankEnv, dmp: torch.nn.Module, optimizer: Any, pipeline: Any,
                 data: Loaders, checkpointer: Optional[Checkpointer], log: logging.Logger) -> None:
        self.cfg, self.env, self.dmp, self.optimizer = cfg, env, dmp, optimizer
        self.pipeline, self.data, self.ckpt, self.log = pipeline, data, checkpointer, log
        self.pos = Position()
        self.epoch_np_state: Any = None  # numpy's RNG at the epoch's start (batch shuffling)
        total = cfg.train.epochs * data.steps_per_epoch
        self.total = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
        self.summary = Summary(depth=pipeline.prefetch_depth, output_dir=cfg.train.output_dir)
        self.lr_warmup = DenseWarmup(optimizer, cfg.optimizer.dense_lr, cfg.optimizer.warmup_steps)
        self.clock = 0.0  # seconds spent in this trainer's steps
        self._mark = 0.0
        self._batches: Optional[Iterator[Any]] = None
        self._losses: List[float] = []
        self._window = Window(env.world_size, cfg.train.batch_size)
        self._steady = Window(env.world_size, cfg.train.batch_size)
        self._steady_from = 0
        self._metrics: Any = None
        self._bar: Any = None
        self._auto_pending = False
        self._warmup_start = 0
        self._warm_marks: List[Any] = []
        self._sigterm: Optional[StopOnSignal] = None  # installed by start(), removed by finish()
        self._stopping = False  # all ranks agreed to stop (SIGTERM): checkpoint, then exit

    @property
    def steady_from(self) -> int:
        """First step of the steady-state window: skips lazy init and cold caches."""
        remaining = self.total - self.pos.step
        return min(self.pos.step + max(2, remaining // 10), self.total - 1)

    def _record(self, kind: str, **values: Any) -> None:
        self._metrics.write(json.dumps({"kind": kind, **values}) + "\n")

    # ------------------------------------------------------------------ checkpoints
    def resume(self) -> None:
        """Continues from the latest complete checkpoint when ``train.resume`` is set."""
        if self.ckpt is None or not self.cfg.train.resume:
            return
        path = self.ckpt.latest()
        if path is None:  # (build_run said so, once)
            return
        changes = check_resume(self.ckpt, path, self.cfg)
        manifest = self.ckpt.manifest(path)
        saved_world = manifest.get("world_size")
        check_position_in_epoch(manifest, path, self.data.steps_per_epoch if saved_world == self.env.world_size
                                else self.data.steps_per_epoch_on(saved_world))
        if changes:
            self.log.info("train.resume: config changed since %s (none of it changes the saved state): %s",
                          path.name, describe_changes(changes))
        if any(k.startswith("optimizer.") for k in self.ckpt.unplaced_keys(path, self._checkpoint_state())):
            # KeyedOptimizer loads only into initialised state (Adam's is created lazily).
            self.optimizer.init_state()
            self.optimizer.zero_grad()
        # DCP loads into the live state dicts (each rank's shards, whatever world size saved
        # them); the load_state_dict calls then let the modules take them in (caches dropped).
        template = self._checkpoint_state()
        state = self.ckpt.load(path, None, self.env.device, template=template)
        self.dmp.load_state_dict(state["model"])
        optimizer_state = template["optimizer"]
        if "param_groups" in optimizer_state:
            # the learning rates are this run's config (they may change on resume), the rest saved
            optimizer_state["param_groups"] = restore_param_groups(
                optimizer_state["param_groups"], [r.get("param_groups", []) for r in state["saved_ranks"]],
                keep=("lr",))
        self.optimizer.load_state_dict(optimizer_state)
        self.pos = Position(**state["position"])
        saved_step, saved_world = self.pos.step, len(state["saved_ranks"])
        if saved_world != self.env.world_size:
            self.pos = rescale_position(self.pos, saved_world, self.env.world_size, self.data.steps_per_epoch)
            self.log.info("train.resume: saved on %d rank(s), resuming on %d: the same point of the epoch in "
                          "samples is step %d here (the order of the epoch's remaining batches differs)",
                          saved_world, self.env.world_size, self.pos.step)
        # FBGEMM's convention, which TorchRec's fused optimizers follow: the step counter
        # (Adam's bias correction) is not in the optimizer state. It advances on every
        # forward, evaluation included, so the checkpoint carries its value.
        saved_counter = state.get("optimizer_step")  # None: no fused table on the saving rank
        self.optimizer.set_optimizer_step(self.pos.step if saved_counter is None else saved_counter)
        self.epoch_np_state = state["epoch_np_state"]
        set_rng_state(state["rng"])
        for key, value in state.get("summary", {}).items():  # checkpoints before 0.1.x have none
            if key in _CARRIED:
                setattr(self.summary, key, value)
        self.summary.resumed_from = self.summary.last_checkpoint = str(path)
        progress = describe_progress(path.name, saved_step, saved_world, self.pos.step, self.env.world_size,
                                     self.total, self.cfg.train.batch_size, self._budget())
        if self.pos.step >= self.total:
            self.summary.already_finished = True
            self.log.info("train.resume: the run in %s already finished, nothing to train: %s (raise "
                          "train.max_steps or train.epochs to train more); reporting that run's results",
                          self.cfg.train.output_dir, progress)
            return
        self.log.info("resumed from %s at step %d (epoch %d, batch %d): %s", path, self.pos.step,
                      self.pos.epoch, self.pos.batch_in_epoch, progress)

    def _budget(self) -> str:
        """The setting that makes ``total`` (for messages)."""
        train = self.cfg.train
        if train.max_steps and self.total == train.max_steps:
            return f"train.max_steps={train.max_steps}"
        return f"train.epochs={train.epochs} of {self.data.steps_per_epoch} steps"

    def _checkpoint_state(self) -> Dict[str, Any]:
        """The tensors a checkpoint holds: the model's and the optimizers' (fused and dense)
        state dicts. Both read the host tier after flushing the caches into it."""
        optimizer = self.optimizer.state_dict()  # param_groups only when the optimizer saves them
        return {"model": self.dmp.state_dict(), "optimizer": dict(optimizer)}

    def save(self, optimizer_step: Optional[int] = None) -> None:
        """``optimizer_step``: the fused step counter to record (default: its value now)."""
        if self.ckpt is None:
            return
        state = self._checkpoint_state()
        payload = {
            "model": state["model"],
            "optimizer": {"state": state["optimizer"]["state"]},
            "param_groups": state["optimizer"].get("param_groups", []),  # per rank: each names its own shards
            "position": asdict(self.pos),
            "optimizer_step": fused_optimizer_step(self.dmp) if optimizer_step is None else optimizer_step,
            "epoch_np_state": self.epoch_np_state,
            "rng": rng_state(),
            "config_hash": config_hash(self.cfg),
            "summary": {k: getattr(self.summary, k) for k in _CARRIED if k != "depth"}
            | {"depth": self.pipeline.prefetch_depth},
        }
        extra = {"position": asdict(self.pos), "config": flatten(self.cfg)}
        self.summary.last_checkpoint = str(self.ckpt.save(
            self.pos.step, payload, extra, per_rank=("param_groups", "optimizer_step", "epoch_np_state", "rng", "summary")))

    # ------------------------------------------------------------------ loop
    def fit(self) -> Summary:
        self.start()
        try:
            self.run(self.total)
        finally:
            self._close_sigterm()
        return self.finish()

    def start(self) -> None:
        # Appends: a resumed run continues the file (a fresh run has a fresh directory,
        # see train.check_run_dir).
        self._metrics = open(self.env.output_dir / "metrics.jsonl", "a")
        # disable=None is tqdm's "only on a terminal": piped or redirected logs get none of
        # its carriage returns; a 1 s refresh keeps a terminal readable too.
        self._bar = tqdm(total=self.total, initial=self.pos.step, unit="step", desc="train", dynamic_ncols=True,
                         mininterval=1.0, disable=None if self.env.is_main and self.cfg.train.progress_bar else True)
        self._start_auto()
        self._sigterm = StopOnSignal(self.env.device)
        self.lr_warmup.before_step(self.pos.step + 1)
        stats = self.pipeline.stats()
        self._window.reset(self.pos.step, stats, self.clock)
        self._steady.reset(self.pos.step, stats, self.clock)
        self._steady_from = self.steady_from

    def run(self, until: int) -> None:
        """Trains until step ``min(until, total)``, drained at the end."""
        cfg, pos = self.cfg, self.pos
        until = min(until, self.total)
        while pos.step < until:
            if self._batches is None:
                self._batches = self._epoch_batches()
            n = self._segment_length(until)
            self._mark = time.perf_counter()
            done = run_pipeline(self.pipeline, self._unless_stopping(itertools.islice(self._batches, n)),
                                self._after_step)
            if self._stopping and pos.batch_in_epoch < self.data.steps_per_epoch:
                self.save()  # mid-epoch (drained): what checkpoint_every would write here
                self._exit_on_sigterm()
            if done != n:
                raise RuntimeError(f"the training loader yielded {done} of {n} batches expected "
                                   f"(epoch {pos.epoch}, batch {pos.batch_in_epoch})")
            self._maybe_choose_depth()
            epoch_done = pos.batch_in_epoch == self.data.steps_per_epoch
            if epoch_done:
                pos.epoch, pos.batch_in_epoch, self._batches = pos.epoch + 1, 0, None
            if epoch_done or pos.step == self.total:
                # The fused step counter advances on every forward (FBGEMM's rule). An eval
                # that runs only because this run ends here is not one an uninterrupted run
                # makes: its checkpoint keeps the counter from before it.
                counter = None if epoch_done else fused_optimizer_step(self.dmp)
                if cfg.train.eval:
                    self.evaluate()
                self.save(optimizer_step=counter)
            elif cfg.train.checkpoint_every and pos.step % cfg.train.checkpoint_every == 0:
                self.save()
            if self._stopping and pos.step < self.total:
                self._exit_on_sigterm()  # at an epoch's end: evaluated and saved above

    def _unless_stopping(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` until the ranks agree to stop; the pipeline then drains what it holds."""
        for batch in batches:
            if self._stopping:
                return
            yield batch

    def _exit_on_sigterm(self) -> None:
        """SIGTERM reached a rank and this step is checkpointed: every rank exits with 143."""
        self._bar.close()
        self._metrics.close()
        self._close_sigterm()
        self.log.warning("SIGTERM: stopped at step %d and wrote checkpoint %s; exiting (a requeued or resubmitted "
                         "job with train.resume=true continues from it)", self.pos.step, self.summary.last_checkpoint)
        raise SystemExit(EXIT_CODE)

    def _close_sigterm(self) -> None:
        if self._sigterm is not None:
            self._sigterm.close()
            self._sigterm = None

    def finish(self) -> Summary:
        self._close_sigterm()
        self._bar.close()
        self._metrics.close()
        self.summary.steps = self.pos.step
        if not self.summary.already_finished:  # else: the depth the finished run ended with
            self.summary.depth = self.pipeline.prefetch_depth
        return self.summary

    def _epoch_batches(self) -> Iterator[Any]:
        """This epoch's batches from the current position. The loader's batch shuffling draws
        from numpy's global RNG as batches are made, so replaying from the epoch's start
        state and skipping the done batches restores it exactly."""
        if self.pos.batch_in_epoch == 0 or self.epoch_np_state is None:
            self.epoch_np_state = np.random.get_state()
        else:
            np.random.set_state(self.epoch_np_state)
        batches = iter(self.data.train)
        for _ in range(self.pos.batch_in_epoch):
            next(batches)
        return batches

    def _segment_length(self, until: int) -> int:
        pos, cfg = self.pos, self.cfg
        ends = [until - pos.step, self.data.steps_per_epoch - pos.batch_in_epoch]
        if cfg.train.checkpoint_every:
            ends.append(cfg.train.checkpoint_every - pos.step % cfg.train.checkpoint_every)
        if self._warming_up():
            ends.append(self._warmup_start + cfg.prefetch.warmup_steps - pos.step)
        return max(1, min(ends))

    def _after_step(self, out: Any) -> None:
        now = time.perf_counter()
        self.clock += now - self._mark
        self._mark = now
        pos = self.pos
        pos.step += 1
        pos.batch_in_epoch += 1
        loss = float(out[0])
        self._losses.append(loss)
        self._record("step", step=pos.step, loss=loss)
        self.lr_warmup.before_step(pos.step + 1)
        self._bar.update(1)
        self._mark_warmup()
        if pos.step == self._steady_from:
            self._steady.reset(pos.step, self.pipeline.stats(), self.clock)
        if pos.step == self.total:
            self.summary.steady = self._steady.read(pos.step, self.pipeline.stats(), self.clock)
            self.summary.steady["fell_back"] = fell_back(self.summary.steady, self.pipeline.prefetch_depth)
            self._warn_if_fell_back(self.summary.steady)
        if pos.step % self.cfg.train.log_every == 0 or pos.step == self.total:
            self._log_window()
            # Asked where the ranks sync anyway (not every step: on CUDA the answer syncs the stream)
            if self._sigterm is not None and not self._stopping and pos.step < self.total:
                self._stopping = self._sigterm.agreed()
        self._mark = time.perf_counter()  # logging's collectives are not step time

    def _warn_if_fell_back(self, steady: Dict[str, Any]) -> None:
        """One WARNING when the steady state fetched more than ``FELL_BACK_SHARE`` of its
        rows at their lookup because prefetches waited for cache room (or rows overflowed
        to the host tier): the run meant to prefetch and mostly did not. (The first batch
        after each drain - epoch end, evaluation, checkpoint - is fetched at its lookup by
        design, and waits nothing: it is not this.)"""
        depth = self.pipeline.prefetch_depth
        fetched, at_lookup = steady.get("rows_fetched_per_step", 0.0), steady.get("rows_fetched_at_lookup_per_step", 0.0)
        deferred, overflow = steady.get("deferred_batches", 0), steady.get("overflow_rows_per_step", 0.0)
        if not fell_back(steady, depth):
            return
        cfg = self.cfg
        if cfg.cache.budget_bytes:
            fix = (f"raise cache.budget_bytes (now {cfg.cache.budget_bytes}) or cache.profile_batches (now "
                   f"{cfg.cache.profile_batches}: the floors come from that sample, and this run's batches pin more)")
        else:
            fix = f"raise cache.load_factor (now {cfg.cache.load_factor:g})" + (
                "" if cfg.cache.fit_depth else " or set cache.fit_depth=true (now false)")
        lower = "prefetch.max_depth" if cfg.prefetch.mode == "auto" else "prefetch.depth"
        lower = f", or lower {lower} (now {cfg.prefetch.max_depth if cfg.prefetch.mode == 'auto' else depth})"
        host_deferred, host_overflow = steady.get("host_deferred_batches", 0), steady.get("host_overflow_batches", 0)
        if (host_deferred or host_overflow) and cfg.tier.kind == "ssd":
            # (the host caches of the tables on disk were what had no room)
            key, value = host_cache_key(cfg)
            fix = f"raise {key} (now {value:g}: {host_deferred} waited for a host cache)"
            if host_deferred < deferred:
                fix += f", and {'cache.budget_bytes' if cfg.cache.budget_bytes else 'cache.load_factor'}"
            if host_overflow:  # one batch alone outgrew a host cache: no lower depth helps it
                fix = (f"raise {key} (now {value:g}): {host_overflow} batch(es) alone outgrew a host cache (the "
                       f"warnings above give the size one batch needs, and the size the batches in flight need)")
                lower = ""
        self.log.warning(
            "warning: prefetching fell back to fetching at lookup: %.0f%% of the rows fetched per step (%.1f of %.1f per rank, "
            "steps %d-%d) were fetched at their lookup, on the critical path; %d prefetch(es) waited for cache room "
            "(deferred_batches)%s: the caches hold fewer rows than %d batches in flight pin. To prefetch, %s%s",
            100.0 * at_lookup / fetched, at_lookup, fetched, steady.get("from_step", 0) + 1,
            steady.get("from_step", 0) + steady.get("steps", 0), deferred,
            f", {overflow:.1f} rows per step were served from the host tier" if overflow else "",
            depth + 1, fix, lower)

    def _log_window(self) -> None:
        stats = self.pipeline.stats()
        w = self._window.read(self.pos.step, stats, self.clock)
        self._window.reset(self.pos.step, stats, self.clock)
        loss = float(np.mean(self._losses)) if self._losses else float("nan")
        self._losses.clear()
        self.summary.train_loss = loss
        self._record("log", step=self.pos.step, loss=loss, depth=self.pipeline.prefetch_depth, **w)
        self._bar.set_postfix(loss=f"{loss:.4f}", sps=f"{w['samples_per_s']:.0f}",
                              stall=f"{w['stall_ms_per_step']:.2f}ms", hit=f"{w['hit_rate']:.3f}")
        self.log.info(
            "step %d loss %.4f | %.0f samples/s | %.1f ms/step | stall %.2f ms/step | hit rate %.3f | depth %d",
            self.pos.step, loss, w["samples_per_s"], w["step_ms"], w["stall_ms_per_step"],
            w["hit_rate"], self.pipeline.prefetch_depth,
        )

    # ------------------------------------------------------------------ prefetch=auto
    def _start_auto(self) -> None:
        """Arms the warm-up: the next ``warmup_steps`` steps run reactive and are measured."""
        self._auto_pending = self.cfg.prefetch.mode == "auto" and self.pos.step < self.total
        self._warmup_start = self.pos.step
        self._warm_marks = []
        if self._auto_pending:
            self.pipeline.set_prefetch_depth(0)

    def _warming_up(self) -> bool:
        return self._auto_pending and self.pos.step < self._warmup_start + self.cfg.prefetch.warmup_steps

    def _mark_warmup(self) -> None:
        # From the 2nd warm-up step on: the first ones carry one-time costs.
        if self._auto_pending and self.pos.step - self._warmup_start >= 2:
            self._warm_marks.append((self.pos.step, self.clock, dict(self.pipeline.stats())))

    def _maybe_choose_depth(self) -> None:
        if not self._auto_pending or self._warming_up():
            return
        self._auto_pending = False
        if len(self._warm_marks) < 2:
            return  # training ended inside the warm-up
        (s0, t0, st0), (s1, t1, st1) = self._warm_marks[0], self._warm_marks[-1]
        steps = s1 - s0
        fetch_s = (st1.get("stall_s", 0.0) - st0.get("stall_s", 0.0)) / steps
        other_s = max((t1 - t0) / steps - fetch_s, 0.0)
        limit = cache_depth_limit(self.dmp, self.env.world_size * self.cfg.train.batch_size)
        fetch_s, other_s, limit = agree(fetch_s, other_s, limit)
        choice = choose_depth(fetch_s, other_s, self.cfg.prefetch.max_depth, limit)
        self.pipeline.set_prefetch_depth(choice.depth)
        self.summary.depth_choice = choice.as_dict()
        self._record("prefetch_auto", step=self.pos.step, **choice.as_dict())
        self.log.info("prefetch=auto chose depth %d: %s (cache allows up to %d)", choice.depth, choice.reason, limit)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> Dict[str, Any]:
        max_batches = self.cfg.train.eval_max_batches
        metrics = evaluate(self.pipeline, self.dmp, self.data.eval, max_batches,
                           progress=self.env.is_main and self.cfg.train.progress_bar)
        result = {"step": self.pos.step, "epoch": self.pos.epoch, **metrics}
        self.summary.evals.append(result)
        self._record("eval", **result)
        self.log.info("eval at step %d: AUROC %.4f | log loss %.4f | %d samples", result["step"],
                      result["auroc"], result["logloss"], result["samples"])
        return result
