"""Cheap per-rank trace events of the pipeline (for timelines; off by default).

Events are plain dicts ``{lane, name, batch, start_s, end_s, rank}`` with ``perf_counter``
times, the format ``torchrec_proactive.bench.timeline`` renders. When disabled every call
returns at the first line, so the hot path pays one attribute read.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist


class PipelineTracer:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.events: List[Dict[str, object]] = []
        self._open: Dict[Tuple[str, int], float] = {}
        self._rank: Optional[int] = None

    def _rank_id(self) -> int:
        if self._rank is None:
            self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return self._rank

    def add(self, lane: str, name: str, batch: int, start_s: float, end_s: float) -> None:
        if not self.enabled:
            return
        self.events.append(
            {"lane": lane, "name": name, "batch": int(batch), "start_s": start_s, "end_s": end_s, "rank": self._rank_id()}
        )

    def open(self, lane: str, batch: int, start_s: Optional[float] = None) -> None:
        if self.enabled:
            self._open[(lane, batch)] = time.perf_counter() if start_s is None else start_s

    def close(self, lane: str, batch: int) -> None:
        if not self.enabled:
            return
        start = self._open.pop((lane, batch), None)
        if start is not None:
            self.add(lane, f"{'a2a ids' if lane == 'data_dist' else lane} b{batch}", batch, start, time.perf_counter())
