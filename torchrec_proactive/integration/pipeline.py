"""``TrainPipelineSparseDist`` with a k-deep proactive fetch of cold embedding rows.

Steady state at the start of step ``N`` (depth ``k >= 1``): the pipeline holds batches
``N .. N+k``. Batches ``N .. N+k-1`` have their rows in flight or resident (fetch issued);
batch ``N+k`` has its id all-to-all in flight. Step ``N`` then runs::

    1. zero_grad
    2. prefetch N+k      wait for its ids (input all-to-all), queue it for planning
    3. enqueue N+k+1     load it and start its input all-to-all (splits)
    4. forward N         waits for N's fetch ticket (usually long done), lookup, output a2a;
                         while that all-to-all runs, plan N+k's rows and issue its fetch
    5. launch N+k+1      the ids all-to-all of N+k+1 (second half of input dist)
    6. backward N        fused embedding update (unpins N's rows), dense all-reduce
    7. optimizer step, dequeue N

so the copy of N+k's cold rows overlaps steps 4-7 of N and all of N+1 .. N+k-1. With
``k = 0`` (reactive) step 2 only waits for N's ids and the rows are fetched inside forward,
on the critical path - TorchRec's behaviour, kept as the baseline.

Capacity: ``k + 1`` batches hold pinned cache rows and one more has ids in flight; all of it
derives from ``prefetch_depth``.

Tables on disk (planned ``key_value``) have a second hop, disk -> host cache, whose reads can
take several steps. With ``disk_depth = D > k`` the pipeline holds batches ``N .. N+D``: at
step 2 it also *stages* batch N+D (waits for its ids and queues its disk reads, pinning its
rows in the host caches), so its reads run during steps N .. N+D-k-1 and its plan, D-k steps
later, finds them in DRAM. Only the host caches hold the extra batches; the device cache
still holds ``k + 1``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline.pipeline_context import PrefetchTrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.types import NoWait
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.utils import _wait_for_batch

from ..fetch import FetchFailedError
from ..store import IdOutOfRangeError, InvalidInputError, StoreStateError
from ..store.async_count import AsyncCount
from .sharded_module import ProactiveShardedModule
from .tracing import PipelineTracer


class ModelNotTraceableError(RuntimeError):
    """The model's forward cannot be FX-traced, which TorchRec's pipelines (and this one)
    need to find the sharded modules to pipeline; the message says why and what to change."""


def _raised_in_fx(error: BaseException) -> bool:
    """Whether ``error`` was raised while FX traced a forward (a frame of ``torch.fx``)."""
    fx_dir = os.path.dirname(torch.fx.__file__)
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(fx_dir):
            return True
        tb = tb.tb_next
    return isinstance(error, torch.fx.proxy.TraceError)


class ProactiveTrainPipeline(TrainPipelineSparseDist):
    """Drop-in for ``TrainPipelineSparseDist`` that fetches cold rows ``prefetch_depth`` batches ahead.

    Same ``progress(dataloader_iter)`` contract: returns the model output of one batch and
    raises ``StopIteration`` once the iterator is exhausted and the in-flight batches are
    drained. In ``model.eval()`` mode the forward runs under ``torch.no_grad()``.

    Statistics: :meth:`stats` (sums over this rank's proactive modules, or per table with
    ``per_table=True``) and :meth:`reset_stats`. On CPU without an emulated link (the
    sharder's ``link=None``) fetches are in-process copies, so ``stall_s`` stays near 0 even
    at depth 0: pass ``link=LinkModel(...)`` to see what prefetching saves on CPU (on CUDA the
    copy stream is the link and the stall is real).

    Args:
        model: a ``DistributedModelParallel`` sharded with
            :class:`ProactiveEmbeddingBagCollectionSharder` and/or
            :class:`ProactiveEmbeddingCollectionSharder` (bags, sequences, or both, fed from
            one KJT or several; other sharded modules run stock).
        optimizer: the dense optimizer (usually a ``CombinedOptimizer`` with the fused one).
        device: training device.
        prefetch_depth: ``k``; 0 is the reactive baseline.
        disk_depth: ``D >= k``: for tables on disk, how many batches ahead their disk reads
            are queued (default ``k``: at their plan). Changes only where rows are, never a
            value; a host cache too full to stage a batch skips it (``stages_skipped``).
        execute_all_batches: as TorchRec's: ``True`` trains the batches still in the
            pipeline once the iterator is exhausted, then raises ``StopIteration``; ``False``
            raises ``StopIteration`` as soon as the iterator is exhausted and keeps its
            ``k + 1`` in-flight batches (their cache rows pinned): the next ``progress()`` with
            a new iterator trains them first, and ``reset()`` releases them.
        apply_jit: as TorchRec's: ``torch.jit.script`` the model's unsharded modules (passed
            to TorchRec as is; the proactive modules are sharded, so never scripted).
        custom_model_fwd: as TorchRec's: a function ``batch -> (losses, output)`` called
            instead of ``model(batch)``; the sharded modules it calls are pipelined as usual.
        trace: record per-rank trace events (see :class:`PipelineTracer`) for timelines.
    """

    # Stock's forward type: the modules' forwards are the same objects whichever of several
    # pipelines taking turns on the model installed them (a validation pipeline mid-epoch,
    # EvalPipelineSparseDist), so each reads whatever context its current pipeline sets.
    _pipelined_forward_type = PipelinedForward

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        prefetch_depth: int = 2,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        custom_model_fwd: Optional[Any] = None,
        trace: bool = False,
        disk_depth: Optional[int] = None,
    ) -> None:
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an integer >= 0, got {prefetch_depth!r}")
        if disk_depth is not None and (not isinstance(disk_depth, int) or disk_depth < prefetch_depth):
            raise ValueError(f"disk_depth must be an integer >= prefetch_depth={prefetch_depth}, got {disk_depth!r}")
        super().__init__(
            model=model,
            optimizer=optimizer,
            device=device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            context_type=PrefetchTrainPipelineContext,
            custom_model_fwd=custom_model_fwd,
        )
        self.prefetch_depth = prefetch_depth
        self._disk_depth = disk_depth
        self.tracer = PipelineTracer(enabled=trace)
        self._proactive_modules: List[ProactiveShardedModule] = []
        # Names of the contexts whose ids were waited for (and fetch issued when k >= 1), and
        # of those staged on disk (ids waited for, disk reads queued, not planned yet).
        self._prefetched: set = set()
        self._staged: set = set()
        self._consistency_checked = False
        self._warned_unpipelined = False
        self._failure: Optional[BaseException] = None
        self._dense_nonfinite: Optional[AsyncCount] = None  # GPU batches: see enqueue_batch
        # Marks this pipeline's batches in the modules, so that pipelines taking turns on one
        # model (training, validation mid-epoch) never plan, wait for or free each other's.
        self._owner = weakref.ref(self)
        # Before the model is rewritten, plain calls go straight to the sharded modules:
        # tell them the depth now so a bypassed pipeline fails loudly instead of silently.
        for module in self._find_proactive_modules(model):
            module.set_prefetch_depth(prefetch_depth)

    def enqueue_batch(self, dataloader_iter: Iterator[Any]) -> bool:
        """TorchRec's enqueue plus a finiteness check of the dense features.

        A NaN/Inf there would reach every table's rows through the gradients. On CPU the
        batch is refused before any of its collectives, leaving the model and the host tier
        untouched; on a GPU see the comment below (no host read on the training thread).
        """
        if not super().enqueue_batch(dataloader_iter):
            return False
        dense = getattr(self.batches[-1], "dense_features", None)
        if isinstance(dense, torch.Tensor) and dense.is_floating_point() and dense.device.type != "cpu":
            # On a GPU the check runs on the stream that filled the tensor (TorchRec's memcpy
            # stream: no race with its non-blocking copy) and is counted on the device; a
            # host read here would stall the step, so it is reported at a later step.
            if self._dense_nonfinite is None:
                self._dense_nonfinite = AsyncCount(dense.device)
            stream = self._memcpy_stream
            with self._stream_context(stream) if stream is not None else contextlib.nullcontext():
                self._dense_nonfinite.add(torch.isfinite(dense).all().logical_not())
            return True
        if isinstance(dense, torch.Tensor) and dense.is_floating_point() and not bool(torch.isfinite(dense).all()):
            index = self.contexts[-1].index
            self.batches.pop()
            self.contexts.pop()
            bad = int((~torch.isfinite(dense)).sum())
            raise InvalidInputError(
                f"batch {index}: {bad} dense feature value(s) are NaN or Inf (shape {tuple(dense.shape)}); "
                f"the batch was refused before training on it"
            )
        return True

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _find_proactive_modules(model: torch.nn.Module) -> List[ProactiveShardedModule]:
        root = model.module if isinstance(model, DistributedModelParallel) else model
        return [m for m in root.modules() if isinstance(m, ProactiveShardedModule)]

    def _configure_modules(self) -> None:
        self._proactive_modules = [
            m for m in self._pipelined_modules if isinstance(m, ProactiveShardedModule)
        ]
        for module in self._proactive_modules:
            module.set_prefetch_depth(self.prefetch_depth)
            module.proactive_stats.keep_records = module.proactive_stats.keep_records or self.tracer.enabled
        if self.prefetch_depth > 0 and not self._warned_unpipelined:
            self._warn_unpipelined()
        if not self._consistency_checked:
            self._check_consistent_across_ranks()
            self._consistency_checked = True

    def _warn_unpipelined(self) -> None:
        """Says, once, which proactive modules TorchRec's pipeline left out (their KJT is not
        taken straight from the batch): they train exactly, but fetch at their lookup."""
        self._warned_unpipelined = True
        pipelined = {id(m) for m in self._proactive_modules}
        root = self._model.module if isinstance(self._model, DistributedModelParallel) else self._model
        left = [name or type(m).__name__ for name, m in root.named_modules()
                if isinstance(m, ProactiveShardedModule) and id(m) not in pipelined]
        if left:
            warnings.warn(
                f"torchrec-proactive: module(s) {', '.join(repr(n) for n in left)} are not pipelined: TorchRec's "
                f"pipeline starts a module's input all-to-all ahead only when its KJT comes straight from the batch "
                f"(e.g. self.ebc(batch.sparse_features)), and this forward hands them one it made or changed. They "
                f"train exactly, but fetch their rows at its lookup (reactive), whatever prefetch_depth="
                f"{self.prefetch_depth} says; pass the batch's KJT unchanged to prefetch them",
                stacklevel=4,
            )

    def _check_consistent_across_ranks(self) -> None:
        """Every rank must run the same depth on the same set of proactive modules: the
        pipeline issues collectives in an order that depends on both, and a mismatch would
        hang in an all-to-all instead of failing. Checked once, with one small all-gather."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        mine = torch.tensor([self.prefetch_depth, len(self._proactive_modules), len(self._pipelined_modules),
                             self.disk_depth], dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        for rank, theirs in enumerate(gathered):
            if not torch.equal(theirs, mine):
                raise ValueError(
                    f"ranks disagree on the pipeline: this rank (rank {dist.get_rank()}) has prefetch_depth="
                    f"{int(mine[0])}, disk_depth={int(mine[3])} and {int(mine[1])} proactive / {int(mine[2])} "
                    f"pipelined modules, rank {rank} has prefetch_depth={int(theirs[0])}, disk_depth="
                    f"{int(theirs[3])} and {int(theirs[1])} / {int(theirs[2])}; "
                    f"every rank must use the same configuration"
                )

    def _launch_input_dist(self, i: int) -> None:
        """Starts and launches the input all-to-all of ``self.batches[i]`` (both halves)."""
        ctx = self.contexts[i]
        t0 = time.perf_counter()
        with _naming_batch(ctx.index):
            self.start_sparse_data_dist(self.batches[i], ctx)
        self.tracer.open("data_dist", ctx.index, t0)

    @property
    def disk_depth(self) -> int:
        """``D``: how many batches ahead tables on disk queue their reads (``>= prefetch_depth``)."""
        return self.prefetch_depth if self._disk_depth is None else max(self._disk_depth, self.prefetch_depth)

    def _stage(self, i: int) -> None:
        """Waits for the ids of ``contexts[i]`` (``k < i <= D``) and queues the disk reads of
        its rows (tables on disk); it is planned when it comes within ``k``."""
        context: PrefetchTrainPipelineContext = self.contexts[i]  # type: ignore[assignment]
        if context.index in self._staged or context.index in self._prefetched:
            return
        self._staged.add(context.index)
        for module in self._pipelined_modules:
            name = module.forward.name  # type: ignore[union-attr]
            dist_input = context.input_dist_tensors_requests.pop(name).wait()
            module_ctx = context.module_contexts[name]
            module_ctx.owner = self._owner  # type: ignore[attr-defined]
            if isinstance(module, ProactiveShardedModule):
                module.stage(dist_input, module_ctx)
            context.input_dist_tensors_requests[name] = NoWait(dist_input)

    def _prefetch(self, i: int) -> None:
        """Waits for the ids of ``contexts[i]`` and, at depth >= 1, issues its row fetch."""
        context: PrefetchTrainPipelineContext = self.contexts[i]  # type: ignore[assignment]
        if context.index in self._prefetched:
            return
        self._prefetched.add(context.index)
        self._staged.discard(context.index)
        stream = self._data_dist_stream
        for module in self._pipelined_modules:
            name = module.forward.name  # type: ignore[union-attr]
            request = context.input_dist_tensors_requests.pop(name)
            with self._stream_context(stream) if stream is not None else contextlib.nullcontext():
                dist_input = request.wait()
            module_ctx = context.module_contexts.pop(name)
            if stream is not None:
                # 1. ids land on the data-dist stream; 2. the current (prefetch) stream waits
                # for them; 3. both streams that will read them keep the memory alive.
                current = torch.get_device_module(self._device).current_stream()
                current.wait_stream(stream)
                dist_input.record_stream(current)
                module_ctx.record_stream(current)
            module_ctx.batch_index = context.index  # type: ignore[attr-defined]
            module_ctx.owner = self._owner  # type: ignore[attr-defined]
            if self.prefetch_depth > 0 and isinstance(module, ProactiveShardedModule):
                module_ctx.prefetch_expected = True  # type: ignore[attr-defined]
                # Batch N's forward comes before this batch's lookup (k >= 1): plan it while
                # N's output all-to-all runs (see ProactiveContextFields).
                module_ctx.plan_in_output_dist = True  # type: ignore[attr-defined]
                module.prefetch(dist_input=dist_input, forward_stream=None, ctx=module_ctx)
            # Handed to the forward as stock hands it: an awaitable of the ids (already here).
            context.input_dist_tensors_requests[name] = NoWait(dist_input)
            context.module_contexts[name] = module_ctx
        self.tracer.close("data_dist", context.index)

    # ------------------------------------------------------------------ pipeline
    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Fills an empty pipeline: batches 0..k with ids launched, fetches of 0..k-1 issued."""
        if self.batches:
            return
        # Batches still held for pipelines that no longer exist (dropped without reset(), e.g.
        # a new pipeline per epoch) are released; those of live pipelines are theirs. A
        # dropped pipeline may sit in a reference cycle, so collect before deciding.
        modules = self._find_proactive_modules(self._model)
        if any(m.holds_batches_of_others(self._owner) for m in modules):
            gc.collect()
        for module in modules:
            module.abandon_orphans()
        if not self.enqueue_batch(dataloader_iter):
            return
        t0 = time.perf_counter()
        with _naming_batch(self.contexts[0].index):  # (this starts batch 0's input all-to-all)
            try:
                self._init_pipelined_modules(self.batches[0], self.contexts[0], self._pipelined_forward_type)
            except Exception as e:
                if not _raised_in_fx(e):
                    raise
                root = self._model.module if isinstance(self._model, DistributedModelParallel) else self._model
                raise ModelNotTraceableError(
                    f"ProactiveTrainPipeline, like TorchRec's TrainPipelineSparseDist, finds the sharded embedding "
                    f"modules to pipeline by FX-tracing the model's forward, and tracing "
                    f"{type(root).__name__}.forward failed: {type(e).__name__}: {e}. Python that reads a tensor's "
                    f"values (if/while on a tensor, float(), int(), .item(), .tolist()) cannot be traced: move it "
                    f"into a function decorated with @torch.fx.wrap (traced as one call) or out of forward. The "
                    f"sharded modules' inputs must come from the batch (e.g. self.ebc(batch.sparse_features))"
                ) from e
        self._configure_modules()
        self.tracer.open("data_dist", self.contexts[0].index, t0)
        self.wait_sparse_data_dist(self.contexts[0])
        for j in range(1, self.disk_depth + 1):
            if j - 1 < self.prefetch_depth:
                self._prefetch(j - 1)
            else:
                self._stage(j - 1)
            if not self.enqueue_batch(dataloader_iter):
                return
            self._launch_input_dist(j)
            self.wait_sparse_data_dist(self.contexts[j])

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """One training (or, in ``model.eval()``, evaluation) step; see the module docstring.

        If a step raises, the pipeline's in-flight batches are in an unknown stage: the error
        carries a note saying so, and every later call raises :class:`StoreStateError` until
        ``reset()`` releases them.
        """
        if self._failure is not None:
            raise StoreStateError(
                f"call pipeline.reset() to release its in-flight batches before calling progress() again: "
                f"the pipeline stopped on an error in an earlier progress() call ({self._failure!r})"
            )
        try:
            return self._progress(dataloader_iter)
        except StopIteration:
            raise
        except BaseException as e:
            self._failure = e
            e.add_note(
                "torchrec-proactive: the pipeline still holds its in-flight batches; call pipeline.reset() "
                "to release them before calling progress() again"
            )
            raise

    def _progress(self, dataloader_iter: Iterator[Any]) -> Any:
        if self._dense_nonfinite is not None and self._dense_nonfinite.poll():
            raise InvalidInputError(
                "a recent batch's dense features held NaN or Inf (checked on the GPU, where the check is reported "
                "a step or so late instead of stalling every step); its embedding updates were skipped, but the "
                "dense optimizer may have stepped on it"
            )
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        training = self._model.training
        k = self.prefetch_depth
        current = self.contexts[0]
        self._set_module_context(current)

        # 1. zero_grad
        if training:
            self._optimizer.zero_grad()
        _wait_for_batch(self.batches[0], self._data_dist_stream)

        # 2. ids of N+k are local: issue its fetch (at k = 0 only N's ids are waited for);
        #    tables on disk: stage N+k+1 .. N+D (their disk reads queued now)
        for i in range(min(k, len(self.batches) - 1) + 1):
            self._prefetch(i)
        for i in range(k + 1, min(self.disk_depth, len(self.batches) - 1) + 1):
            self._stage(i)

        # 3. next batch in: its input all-to-all starts behind this step
        has_next = self.enqueue_batch(dataloader_iter)
        if has_next:
            self._launch_input_dist(len(self.batches) - 1)

        # 4. forward N (waits for N's rows)
        t0 = time.perf_counter()
        with torch.no_grad() if not training else contextlib.nullcontext():
            losses, output = self._model_fwd(self.batches[0])
        self.tracer.add("compute", f"fwd b{current.index}", current.index, t0, time.perf_counter())
        self._record_fetches(current.index)

        # 5. launch the ids all-to-all of N+k+1
        if has_next:
            self.wait_sparse_data_dist(self.contexts[-1])

        if training:
            # 6. backward: fused embedding updates (unpin N), dense all-reduce
            t0 = time.perf_counter()
            torch.sum(losses, dim=0).backward()
            self.tracer.add("compute", f"bwd b{current.index}", current.index, t0, time.perf_counter())
            # 7. dense optimizer
            t0 = time.perf_counter()
            self._optimizer.step()
            self.tracer.add("compute", f"opt b{current.index}", current.index, t0, time.perf_counter())

        self._prefetched.discard(current.index)
        self.dequeue_batch()
        if not self.batches:
            self._check_drained()
        return output

    def _record_fetches(self, index: int) -> None:
        if not self.tracer.enabled:
            return
        for module in self._proactive_modules:
            records = module.proactive_stats.records
            if records and records[-1].index == index:
                r = records[-1]
                if r.fetch_started_at is not None and r.fetch_completed_at is not None and r.bytes_moved:
                    self.tracer.add("fetch", f"fetch b{index}", index, r.fetch_started_at, r.fetch_completed_at)
                if r.stall_s > 0:
                    self.tracer.add("stall", f"stall b{index}", index, r.lookup_started_at, r.lookup_started_at + r.stall_s)

    def attach(self, model: Optional[torch.nn.Module] = None, sparse_dist: bool = True) -> None:
        """TorchRec's ``attach`` (after ``detach()``: plain forwards mid-epoch), keeping the
        batch the pipeline will train next as it was. Stock re-initialises that batch's
        module contexts (and starts its splits all-to-all again, which every rank then waits
        for here); ours carry its prefetched fetch, so they are put back."""
        if not self.contexts:
            super().attach(model, sparse_dist)
            return
        first = self.contexts[0]
        requests, module_contexts = dict(first.input_dist_tensors_requests), dict(first.module_contexts)
        splits_before = len(first.fused_splits_awaitables)
        super().attach(model, sparse_dist)
        for _, awaitable in first.fused_splits_awaitables[splits_before:]:
            awaitable.wait()  # (the same collective on every rank: nothing left in flight)
        del first.fused_splits_awaitables[splits_before:]
        first.input_dist_tensors_requests.clear()
        first.input_dist_tensors_requests.update(requests)
        first.module_contexts.clear()
        first.module_contexts.update(module_contexts)

    def _check_drained(self) -> None:
        for module in self._proactive_modules:
            module.fetch_engine.drain()
            if module._proactive_options.debug_checks:
                # (drained of this pipeline's batches; another pipeline may hold its own)
                module.check_invariants(expect_drained=not module.holds_batches_of_others(self._owner))

    def reset(self) -> None:
        """Abandons in-flight batches (e.g. a loop stopped early): their rows are unpinned
        and their fetches completed, so nothing leaks and the cache stays consistent."""
        for context in self.contexts:
            for module_ctx in list(getattr(context, "module_contexts", {}).values()):
                fetch = getattr(module_ctx, "fetch", None)
                if fetch is None:
                    continue
                module_ctx.fetch = None
                # Its moves complete in order (or failed and were rolled back by the
                # engine), then every group of the batch is unpinned.
                try:
                    fetch.ticket._engine.wait(fetch.ticket)
                except FetchFailedError:
                    pass
                finally:
                    ProactiveShardedModule._release_fetch(fetch)
        # Input all-to-alls already launched must complete on every rank before we forget them.
        for context in self.contexts:
            if context.fused_splits_awaitables:
                self.wait_sparse_data_dist(context)
            for request in list(context.input_dist_tensors_requests.values()):
                request.wait()
        for module in self._proactive_modules:
            module.release_unfinished(owner=self._owner)
            module.abandon_prefetched(owner=self._owner)
        self._prefetched.clear()
        self._staged.clear()
        self._failure = None
        super().reset()
        self._check_drained()

    def set_prefetch_depth(self, depth: int) -> None:
        """Changes ``k`` between epochs or segments; the pipeline must be drained (every
        ``progress`` call returned or ``StopIteration`` raised, or ``reset()`` called)."""
        if not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch_depth must be an integer >= 0, got {depth!r}")
        if self.batches:
            raise StoreStateError(
                f"cannot change prefetch_depth from {self.prefetch_depth} to {depth} with {len(self.batches)} "
                f"batch(es) in flight; drain the pipeline or call reset() first"
            )
        self.prefetch_depth = depth
        for module in self._proactive_modules or self._find_proactive_modules(self._model):
            module.set_prefetch_depth(depth)

    @property
    def in_flight(self) -> int:
        """Batches currently held by the pipeline (at most ``disk_depth + 2``)."""
        return len(self.batches)

    def stats(self, per_table: bool = False) -> Dict[str, Any]:
        """Cumulative fetch statistics summed over this rank's proactive modules (since the
        pipeline was built, or :meth:`reset_stats`); with ``per_table=True``, per table instead.

        Keys: ``batches`` (one per lookup - a training step or a plain forward - for each
        module with proactive shards on this rank; plain forwards count in every key),
        ``stall_s`` (seconds lookups waited for their rows), ``rows_requested`` (distinct rows
        per batch, summed), ``hits``, ``hit_rate`` (``hits / rows_requested``; preloaded rows
        count as hits), ``rows_fetched`` (host -> cache), ``rows_fetched_at_lookup`` (of those,
        rows copied while their lookup waited, on the critical path: every miss at depth 0,
        only batches that could not be prefetched at depth >= 1 - the first one, and any that
        waited for pins until their lookup), ``rows_written_back``, ``bytes_moved``
        (fetches and write-backs, optimizer state included; host-tier reads of overflow rows
        are not moves), ``deferred_batches`` (prefetches that waited for pins, per module;
        ``host_deferred_batches`` of them waited for a disk table's host cache;
        ``host_overflow_batches``: batches whose rows alone outgrew a host cache, moved
        through it a chunk at a time),
        ``overflow_rows`` (rows served from the host tier), ``prefetch_lead_lookups`` (per
        batch, how many of its module's lookups ahead its fetch was issued, summed: divided by
        ``batches`` it is the effective depth, ``k`` when nothing waits), ``plan_s`` / ``plan_cpu_s``
        (planning wall / CPU seconds), ``late_updates`` (backwards that came after their
        module's next training forward, whose rows were planned again: see the README's pin
        rule), ``external_writes`` (in-place writes into the exposed tensors that the cache
        picked up - DMP's load of the initial weights counts one per store) and, for tables
        on disk, ``staged_batches``, ``stages_skipped`` and ``stages_yielded`` (see
        ``disk_depth``). On CPU without an emulated link (``link=None``) fetches are
        in-process copies, so ``stall_s`` stays near 0 even at depth 0.

        ``per_table=True``: ``{tables: {key: value}}`` from each store this rank holds, keyed by
        the tables it serves - ``"t2"``, or ``"t0+t1"`` where TorchRec grouped several tables
        (same dim and sharding) into one kernel, whose store counts them together (the fused
        param ``use_one_tbe_per_table=True`` gives one per table); summed over this rank's
        shards of a table. Keys: ``rows_requested``, ``hits``, ``hit_rate``, ``rows_fetched``,
        ``rows_written_back``, ``bytes_moved``, ``overflow_rows`` (the same counts as above,
        adding up to them), ``updates``, ``late_updates``, ``external_writes``. Stall, batches,
        fetches at lookup and deferrals are per module (a batch's lookup), so only in the sums.
        """
        if per_table:
            tables: Dict[str, Dict[str, float]] = {}
            for module in self._proactive_modules:
                for name, counts in module.table_stats().items():
                    mine = tables.setdefault(name, dict.fromkeys(counts, 0))
                    for key, value in counts.items():
                        mine[key] = mine.get(key, 0) + value
            for mine in tables.values():
                mine["hit_rate"] = mine["hits"] / mine["rows_requested"] if mine["rows_requested"] else 1.0
            return tables
        total: Dict[str, float] = {}
        for module in self._proactive_modules:
            for key, value in module.proactive_stats.snapshot().items():
                total[key] = total.get(key, 0) + value
            for kernel in module.proactive_kernels:
                for key in ("late_updates", "external_writes"):
                    total[key] = total.get(key, 0) + getattr(kernel.store.stats, key)
        if total.get("rows_requested"):
            total["hit_rate"] = total["hits"] / total["rows_requested"]
        return total

    def reset_stats(self) -> None:
        """Zeroes every counter :meth:`stats` reads (both forms) on this rank, e.g. after a
        warm-up, so that the next reads count only what follows. Batches already looked up are
        counted before the reset, so none of theirs lands after it; nothing else changes (the
        caches, pins and depth). Local to the rank: call it on every rank for global figures."""
        for module in self._proactive_modules:
            module.reset_proactive_stats()


@contextlib.contextmanager
def _naming_batch(index: int) -> Iterator[None]:
    """Says which dataloader batch bad input came from: the pipeline reads ``k + 1`` batches
    ahead of the one it trains, so "this batch" would not tell the user which one."""
    try:
        yield
    except (IdOutOfRangeError, InvalidInputError) as e:  # raised before any collective started
        raise type(e)(
            f"the pipeline's batch {index} (counted from 0 since the pipeline started or was last reset): {e}"
        ) from e
