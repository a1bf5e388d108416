"""A k-deep prefetch loop over one tiered table, without TorchRec.

The same schedule as the TorchRec pipeline, reduced to one table: the fetch of batch
``i + depth`` is issued before batch ``i`` is consumed; ``depth == 0`` fetches at use time.
A table on disk has a second hop: its rows are staged (read from the file into the host
cache, ``TieredTable.stage_rows``) ``disk_depth >= depth`` batches ahead.
Used by the store tests, the GPU check, the benches and anything that drives a store
directly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Optional, Sequence, Tuple

import torch

from ..store import CacheCapacityError, TableBatch, TieredTable, plan_table_batch
from ..store.disk_host_tier import HostCacheCapacityError
from ..store.tiered_table import Stage
from .engine import FetchEngine, Ticket

# (values, offsets, per-sample weights or None, anything the consumer needs)
LookaheadBatch = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Any]


@dataclass
class LookaheadReport:
    """What :func:`run_lookahead` did, batch by batch: ``staged_at[j]`` / ``planned_at[j]``
    is the batch ``i`` being consumed next when batch ``j``'s rows were staged (its disk
    reads queued) / when it was planned and issued (its host->device moves); ``j - i`` is
    that hop's lead in batches. ``stages_waited``: stages the host cache refused at first
    (tried again later); ``stages_dropped``: stages given up for a plan the host cache
    could not fit beside them (staged again later)."""

    staged_at: Dict[int, int] = field(default_factory=dict)
    planned_at: Dict[int, int] = field(default_factory=dict)
    stages_waited: int = 0
    stages_dropped: int = 0

    def leads(self) -> Tuple[float, float]:
        """Mean lead in batches of the disk hop (staged batches; planned ones where none
        was staged) and of the host->device hop."""
        plan = [j - i for j, i in self.planned_at.items()]
        disk = [j - self.staged_at.get(j, i) for j, i in self.planned_at.items()]
        mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
        return mean(disk), mean(plan)


def run_lookahead(
    table: TieredTable,
    engine: FetchEngine,
    batches: Sequence[LookaheadBatch],
    depth: int,
    consume: Callable[[int, TableBatch, LookaheadBatch], None],
    mode: str = "sum",
    disk_depth: Optional[int] = None,
) -> LookaheadReport:
    """Calls ``consume(i, planned_batch, batches[i])`` in order, each batch's rows resident.

    Schedule, at batch ``i``: stage (in order) every batch up to ``i + disk_depth`` that is
    not planned yet (a table on disk: its rows' disk reads queued now,
    ``TieredTable.stage_rows``; a batch's stage is dropped once it is planned), plan and
    issue (in order) every batch up to ``i + depth``, then wait for batch ``i`` and consume
    it. Returns a :class:`LookaheadReport` (each hop's lead, batch by batch).

    A batch whose rows do not fit beside the batches in flight waits (and the ones behind
    it), at the latest until its own use, where rows that still do not fit overflow to the
    host tier: any cache size works, exactly. Likewise a stage that does not fit the host
    cache beside the batches in flight and staged waits (tried again each batch, in order),
    and a plan refused by the host cache first drops the stages of the batches after it:
    staging never stops a batch that runs without it. ``disk_depth`` changes only which rows
    are where: the parameters are bit-identical at any ``(depth, disk_depth)``.

    ``disk_depth``: ``>= depth``; default ``depth`` (nothing staged: a batch's disk reads are
    queued when it is planned). Off disk it changes nothing. See ``fetch.disk_depth`` to
    choose it from measured figures.

    ``consume`` must look the batch up (``pooled_lookup``) and, with grad, run backward, so
    the batch's pins are released before the loop moves on. When anything raises (a fault
    of the disk tier, a failed fetch, ``consume``), the batches issued and not consumed are
    released and every stage dropped before it propagates, so the store is consistent and
    a run of the batches not consumed yet continues exactly.
    """
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    disk_depth = depth if disk_depth is None else int(disk_depth)
    if disk_depth < depth:
        raise ValueError(f"disk_depth must be >= depth ({depth}), got {disk_depth}")
    n = len(batches)
    in_flight: Deque[Tuple[TableBatch, Ticket]] = deque()
    stages: Dict[int, Stage] = {}
    next_to_issue = 0
    next_to_stage = 0
    now = 0
    report = LookaheadReport()

    def drop_stages_after(j: int) -> bool:
        nonlocal next_to_stage
        later = [k for k in stages if k > j]
        for k in later:
            table.unstage(stages.pop(k))
            report.staged_at.pop(k, None)
        report.stages_dropped += len(later)
        next_to_stage = min(next_to_stage, j + 1)
        return bool(later)

    def plan(i: int, overflow: bool) -> TableBatch:
        values, offsets, _, _ = batches[i]
        try:
            return plan_table_batch(table, values, offsets, mode, depth_hint=depth, overflow=overflow)
        except HostCacheCapacityError:
            if not drop_stages_after(i):  # (stages of later batches give way to this one)
                raise
            return plan_table_batch(table, values, offsets, mode, depth_hint=depth, overflow=overflow)

    def issue(i: int, overflow: bool = False) -> bool:
        try:
            tb = plan(i, overflow=False)
        except CacheCapacityError:
            if not overflow:
                return False  # does not fit beside the batches in flight yet: it waits, in order
            tb = plan(i, overflow=True)
        in_flight.append((tb, engine.issue([tb.plan], tag=i)))
        report.planned_at[i] = now
        stage = stages.pop(i, None)
        if stage is not None:  # (planned: its rows are pinned by the plan now)
            table.unstage(stage)
        return True

    def stage_upto(limit: int) -> None:
        nonlocal next_to_stage
        next_to_stage = max(next_to_stage, next_to_issue)  # (planned batches need no stage)
        while next_to_stage <= min(limit, n - 1):
            try:
                stages[next_to_stage] = table.stage_rows(batches[next_to_stage][0])
            except HostCacheCapacityError:
                report.stages_waited += 1
                return  # does not fit beside the batches in flight and staged yet: it waits, in order
            report.staged_at[next_to_stage] = now
            next_to_stage += 1

    current: Optional[TableBatch] = None
    try:
        for i in range(n):
            now = i
            # Stage first: at the start, the batches about to be planned are staged too, so
            # their reads go out together with the later ones'.
            if disk_depth > depth and table.disk is not None:
                stage_upto(i + disk_depth)
            # Issue, in order, every batch up to i + depth that fits; batch i itself is issued
            # at its use at the latest, with overflow (nothing after it is issued yet).
            while next_to_issue <= min(i + depth, n - 1) and not (engine.failed and in_flight):
                # (after a failed fetch nothing more is planned until the next wait rolled it
                # back: a plan on top of it would count its rows as resident)
                if not issue(next_to_issue, overflow=next_to_issue == i):
                    break
                next_to_issue += 1
            current, ticket = in_flight.popleft()
            engine.wait(ticket)
            consume(i, current, batches[i])
            current = None
    except BaseException:
        # Leave the store as if the batches not consumed had never been issued: each
        # waited (a failed one is rolled back by the engine), then unpinned.
        for tb, ticket in in_flight:
            try:
                engine.wait(ticket)
            except Exception:  # noqa: BLE001 - the first fault is the one raised
                pass
        for tb in ([current] if current is not None else []) + [tb for tb, _ in in_flight]:
            table.release(tb.plan)
        raise
    finally:
        for stage in stages.values():
            table.unstage(stage)
    return report
