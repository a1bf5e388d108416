"""The disk hop's depth, chosen from measured figures (issue 42: disk reads issued
``disk_depth`` batches ahead, "chosen by config, or automatically from the measured read
latency and reads/s").

The schedule (``run_lookahead``, the pipeline): batch ``N + disk_depth`` is staged - its disk
reads queued - while batch ``N`` is consumed, and batch ``N + depth`` is planned then, its
host->device moves needing its rows in the host cache. So a batch's reads have
``disk_depth - depth`` steps from staging to planning, and must land within them.

One batch's reads are ``reads_per_step`` requests (page runs: the tier's ``read_requests``
per step) of ``read_latency_s`` each, at most ``max_in_flight`` at once (the file's
``io_threads``). By Little's law that limit alone allows ``max_in_flight / read_latency_s``
reads/s; the disk's measured ``reads_per_s`` (reached with that many in flight) bounds it
too, and the lower of the two is the rate::

    rate         = min(reads_per_s, max_in_flight / read_latency_s)
    batch_read_s = read_latency_s + (reads_per_step - 1) / rate      (first lands after one
                                                                      latency, the rest at the rate)
    disk_depth   = depth + ceil(batch_read_s / step_s)

That holds while the disk keeps up: one batch's reads take ``reads_per_step / rate <=
step_s`` of disk time, so they do not queue behind the batches before. Otherwise the disk
is the bottleneck (``disk_bound``): reads queue whatever the depth and each step stalls about
``reads_per_step / rate - step_s``; the same depth is returned (deeper only holds more host
cache). ``step_s`` is a step's time without its stall.

The depth is capped by ``max_disk_depth`` and, when given, by the host cache: the batches
staged and in flight pin about ``(disk_depth + 1) * rows_per_step`` rows there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["DiskDepthChoice", "choose_disk_depth"]


@dataclass(frozen=True)
class DiskDepthChoice:
    """``disk_depth``: the depth to use (``>= depth``). ``reads_per_s``: the read rate the
    choice assumes; ``batch_read_s``: one batch's reads at that rate; ``lead_steps``: the
    steps between staging and planning that they need; ``disk_bound``: the disk cannot read
    a batch per step (no depth hides it), ``stall_per_step_s`` the stall it leaves;
    ``capped_by``: ``"max_disk_depth"`` or ``"host cache"`` when the depth the reads need
    was cut, else None."""

    disk_depth: int
    reads_per_s: float
    batch_read_s: float
    lead_steps: int
    disk_bound: bool
    stall_per_step_s: float
    capped_by: Optional[str] = None


def choose_disk_depth(read_latency_s: float, reads_per_s: float, reads_per_step: float, step_s: float,
                      depth: int = 1, max_in_flight: int = 64, max_disk_depth: int = 64,
                      host_cache_rows: Optional[int] = None, rows_per_step: Optional[float] = None,
                      ) -> DiskDepthChoice:
    """The disk hop's depth for the measured figures (see the module docstring).

    Args:
        read_latency_s: one read's latency with the disk busy as in the run (seconds, > 0).
        reads_per_s: the read requests per second the disk reached (> 0).
        reads_per_step: read requests per step (>= 0; 0 gives ``depth``).
        step_s: a step's time without its stall (seconds, > 0).
        depth: the host->device hop's depth (>= 0).
        max_in_flight: reads in flight at most (the file's ``io_threads``, >= 1).
        max_disk_depth: the deepest to return (>= depth).
        host_cache_rows / rows_per_step: the host cache's rows and the rows a batch pins
            there; when both are given the depth leaves room for ``disk_depth + 1`` batches.
    """
    for name, value in (("read_latency_s", read_latency_s), ("reads_per_s", reads_per_s), ("step_s", step_s)):
        if not value > 0:
            raise ValueError(f"choose_disk_depth: {name} must be > 0, got {value}")
    if reads_per_step < 0 or depth < 0 or max_in_flight < 1 or max_disk_depth < depth:
        raise ValueError(f"choose_disk_depth: needs reads_per_step >= 0 (got {reads_per_step}), depth >= 0 (got "
                         f"{depth}), max_in_flight >= 1 (got {max_in_flight}), max_disk_depth >= depth (got "
                         f"{max_disk_depth})")
    rate = min(float(reads_per_s), max_in_flight / float(read_latency_s))
    if reads_per_step == 0:
        return DiskDepthChoice(depth, rate, 0.0, 0, False, 0.0)
    batch_read_s = read_latency_s + (reads_per_step - 1) / rate
    # (a hair under a whole number of steps is that number: float noise must not add a step)
    lead = max(1, math.ceil(batch_read_s / step_s - 1e-9))
    busy = reads_per_step / rate
    disk_bound = busy > step_s
    want = depth + lead
    got, capped = want, None
    if got > max_disk_depth:
        got, capped = max_disk_depth, "max_disk_depth"
    if host_cache_rows is not None and rows_per_step:
        room = max(depth, int(host_cache_rows // rows_per_step) - 1)
        if got > room:
            got, capped = room, "host cache"
    return DiskDepthChoice(got, rate, batch_read_s, lead, disk_bound, max(0.0, busy - step_s), capped)
