"""Host caches of the tables on disk, sized from miss-ratio curves under one DRAM budget.

A table on the disk tier has two caches: the device cache, and below it the host cache in
DRAM, over the table's file. A row the device cache misses is read into the host cache (from
the disk when it is not there) and stays there until the host cache evicts it, whether the
device holds it or not; a row the device cache evicts is written back into the host cache.
So a host cache larger than the device cache keeps the device cache's recent rows too, as an
inclusive level: the disk reads of a table with a host cache of ``h`` slots are about the
misses of one LRU cache of ``h`` slots on the table's stream. A host cache no larger than
the device's holds mostly what the device evicted (its recent victims) and adds about half
its rows to the device's: the misses at ``d + h / 2``. Together: the misses at
``max(h, d + h / 2)`` (:func:`effective_slots`; the 1/2 fitted on 7 replays of one table,
checked held out on another, within 7% of the store's counted reads: see
``tests/test_host_cache_plan.py``, where the inclusive ``h`` and the exclusive ``d + h``
readings are each further off).

:func:`plan_host_caches` spends a host budget in bytes on the tables whose next byte saves
the most disk reads a batch - the same upper-hull allocation as the device caches'
(:func:`~torchrec_proactive.cacheplan.proposer.allocate_by_curves`) - from each table's
floor: twice the rows ``disk_depth + 1`` batches pin (the curve's ``pinned_rows``, when the
curve was measured at the disk depth), which holds those pins and, beside them, the rows the
device cache writes back for a batch (at most one batch's rows). The result goes to the
sharder as it is::

    curves = profile_batches(batches, tables, depth=disk_depth)
    plan = plan_host_caches(curves, record_bytes, budget_bytes=8 << 30)
    ProactiveEmbeddingBagCollectionSharder(host_cache_bytes=plan.host_cache_bytes, ...)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import numpy as np

from .curve import MissRatioCurve
from .proposer import allocate_by_curves

__all__ = ["HostCachePlan", "HostBudgetError", "plan_host_caches", "disk_reads_per_batch", "host_floor",
           "effective_slots"]


class HostBudgetError(ValueError):
    """The host budget cannot hold every table's floor (the rows its staged and in-flight
    batches pin); ``minimum_bytes`` is the least budget that can."""

    def __init__(self, message: str, minimum_bytes: int, floors: Optional[Mapping[str, int]] = None) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.floors: Dict[str, int] = dict(floors or {})  # per table, its floor in rows


@dataclass(frozen=True)
class HostCachePlan:
    """Per table: the host cache in bytes (what ``host_cache_bytes`` of the sharder takes)
    and in rows, and the disk reads a batch its curve expects of it. Invariant: every table's
    ``slots`` is at least its floor and at most its rows; the bytes sum to at most
    ``budget_bytes``."""

    host_cache_bytes: Dict[str, int]
    slots: Dict[str, int]
    disk_reads_per_batch: Dict[str, float]
    budget_bytes: int
    device_slots: Dict[str, int] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        def device(t: str) -> str:
            return f", over {self.device_slots[t]} device rows" if self.device_slots.get(t) else ""

        parts = ", ".join(f"{t} {self.slots[t]} rows ({self.host_cache_bytes[t]} bytes{device(t)}, "
                          f"{self.disk_reads_per_batch[t]:.1f} disk reads/batch)" for t in sorted(self.slots))
        return f"host cache plan: {sum(self.host_cache_bytes.values())} of {self.budget_bytes} bytes: {parts}"


#: The share of a host cache no larger than the device cache that holds rows the device does
#: not (its recent victims), fitted on replays of the real store (see the module docstring).
VICTIM_SHARE = 0.5


def effective_slots(host_slots: float, device_slots: float) -> float:
    """The single LRU cache whose misses a table's two levels read from disk (see above)."""
    return max(float(host_slots), float(device_slots) + VICTIM_SHARE * float(host_slots))


def _steady(curve: MissRatioCurve) -> MissRatioCurve:
    """The curve in steady state at the full size: a cache of every row hits every warm
    access (its first reads come once, not every batch), so between the sample's last reuse
    and the whole table the hits rise linearly to all of them - a neutral assumption where
    the sample saw no reuse, which leaves no host byte of a budget idle while a table still
    reads from disk."""
    if not curve.sizes or curve.sizes[-1] < curve.num_rows or curve.hits[-1] >= curve.accesses:
        return curve
    sizes, hits = np.asarray(curve.sizes, dtype=np.float64), np.asarray(curve.hits, dtype=np.float64)
    k = int(np.searchsorted(hits, hits[-1], side="left"))  # (the first size with the sample's last hit)
    rise = (curve.accesses - hits[k]) * (sizes[k:] - sizes[k]) / max(sizes[-1] - sizes[k], 1.0)
    return dataclasses.replace(curve, hits=tuple(hits[:k].tolist()) + tuple((hits[k] + rise).tolist()))


def disk_reads_per_batch(curve: MissRatioCurve, host_slots: int, device_slots: int = 0) -> float:
    """Rows a batch reads from disk with a host cache of ``host_slots`` rows below a device
    cache of ``device_slots``: the distinct rows a batch looks up, less those a cache of
    :func:`effective_slots` hits (in steady state: none at the whole table)."""
    slots = min(float(curve.num_rows), effective_slots(host_slots, device_slots))
    if not curve.num_batches:
        return 0.0
    return max(0.0, (curve.accesses - _steady(curve).hit_rows(slots)) / curve.num_batches)


def _behind(curve: MissRatioCurve, device_slots: int) -> MissRatioCurve:
    """The curve as a host cache below ``device_slots`` sees it, in steady state: a host
    cache of ``x`` rows hits what one of :func:`effective_slots` ``(x, device_slots)`` rows does."""
    curve = _steady(curve)
    if device_slots <= 0:
        return curve
    hits = tuple(curve.hit_rows(min(float(curve.num_rows), effective_slots(x, device_slots))) for x in curve.sizes)
    return dataclasses.replace(curve, hits=hits)


def host_floor(curve: MissRatioCurve) -> int:
    """The fewest host cache rows a table on disk is planned with: its staged and in-flight
    batches' pins and one batch's write-backs beside them (see the module's docstring)."""
    return int(min(curve.num_rows, max(1, 2 * curve.pinned_rows)))


def plan_host_caches(curves: Mapping[str, MissRatioCurve], record_bytes: Mapping[str, int],
                     budget_bytes: int, device_slots: Optional[Mapping[str, int]] = None) -> HostCachePlan:
    """Host cache sizes for the tables in ``curves`` (measured at the disk depth: their
    ``pinned_rows`` is each host cache's floor) under ``budget_bytes`` of DRAM in all.

    ``record_bytes[t]``: bytes a host cache slot of table ``t`` takes (its row and optimizer
    state, as the file stores them: ``store.disk_record_bytes(dim, optimizer)``);
    ``device_slots[t]``: its device cache, where known (a table whose device cache holds most of what it reads
    gains less from host rows: see :func:`effective_slots`). Raises
    :class:`HostBudgetError` (one line naming the budget, the minimum and each table's
    floor) when the budget cannot hold the floors."""
    names = sorted(curves)
    missing = [t for t in names if t not in record_bytes]
    if missing:
        raise ValueError(f"plan_host_caches: no record_bytes for table(s) {', '.join(missing)}")
    bad = [f"{t}={record_bytes[t]!r}" for t in names if not int(record_bytes[t]) >= 1]
    if bad:
        raise ValueError(f"plan_host_caches: record_bytes must be >= 1 (a row's bytes on disk), got {', '.join(bad)}")
    stray = sorted(set(device_slots or {}) - set(names))
    negative = [f"{t}={d!r}" for t, d in (device_slots or {}).items() if not int(d) >= 0]
    if stray or negative:
        raise ValueError(f"plan_host_caches: device_slots names tables without a curve {stray} or counts below 0 "
                         f"{negative}; give each table's device cache rows, >= 0")
    if budget_bytes < 1:
        raise ValueError(f"host cache budget must be >= 1 byte, got {budget_bytes!r}")
    floors = {t: host_floor(curves[t]) for t in names}
    minimum = sum(floors[t] * int(record_bytes[t]) for t in names)
    if budget_bytes < minimum:
        shown = ", ".join(f"{t} {floors[t]} rows" for t in names)
        raise HostBudgetError(
            f"host cache budget {budget_bytes} bytes is below the {minimum} bytes the tables' pinned rows need "
            f"({shown}: the rows their staged and in-flight batches pin, and a batch's write-backs); give at least "
            f"{minimum} bytes or lower the disk depth", minimum, floors)
    # In load factors of the host cache (slots / rows), from each floor up to every row.
    device = {t: int((device_slots or {}).get(t, 0)) for t in names}
    order = [_behind(curves[t], device[t]) for t in names]
    start = [floors[t] / curves[t].num_rows for t in names]
    per_clf = [curves[t].num_rows * float(record_bytes[t]) for t in names]
    factors = allocate_by_curves(order, per_clf, start, budget_bytes - minimum, 1.0)
    slots = {t: int(min(curves[t].num_rows, max(floors[t], math.floor(lf * curves[t].num_rows + 1e-9))))
             for t, lf in zip(names, factors)}
    return HostCachePlan(host_cache_bytes={t: slots[t] * int(record_bytes[t]) for t in names}, slots=slots,
                         disk_reads_per_batch={t: disk_reads_per_batch(curves[t], slots[t], device[t])
                                               for t in names},
                         budget_bytes=int(budget_bytes), device_slots={t: d for t, d in device.items() if d})
