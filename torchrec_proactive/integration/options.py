"""User-facing knobs of the proactive tables, shared by the sharder and the kernels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional

import torch

from ..fetch import LinkModel
from ..store import EvictionPolicy
from .disk_tier import DiskTierSpec


@dataclass(frozen=True)
class ProactiveOptions:
    """How proactive tables are cached.

    Attributes:
        cache_load_factor: default cache size as a fraction of each local shard's rows, used
            when the plan's ``CacheParams(load_factor=...)`` does not give one.
        num_slots: per-table cache size in rows; wins over any load factor.
        eviction_policy: default policy when the plan's ``CacheParams.algorithm`` is unset.
        hot_rows: per-table global row ids kept permanently in the cache (hotness profile).
        link: model of the host-to-device link on CPU (``None`` = plain in-process copy).
            Ignored on CUDA, where the copy stream is the link.
        debug_checks: verify the store's invariants after every batch (slow; for tests).
        planner: where batches are planned: ``"host"`` (NumPy bookkeeping; cheapest per op
            at CPU batch sizes), ``"device"`` (fixed-shape tensor ops on the cache's device,
            no host synchronisation: the store's ``DevicePlanner``) or ``"auto"``: device on CUDA,
            host on CPU.
        table_budgets: how a store serving a TorchRec group of several tables splits its
            cache: ``"per_table"`` (each table's rows only in its own share of the slots,
            its own size), ``"shared"`` (one cache of the summed slots, any table's rows
            anywhere) or ``"auto"``: per table when the group's tables were given different
            load factors (e.g. by the cache planner), else shared; on the device planner,
            which does not partition its cache yet, ``auto`` is shared and ``per_table`` is
            refused.
        disk: per table planned ``key_value``, where its rows live (``disk_tier.py``); set by
            the sharder from the plan. Its host cache is the store's host tier.
    """

    cache_load_factor: float = 0.2
    num_slots: Mapping[str, int] = field(default_factory=dict)
    eviction_policy: str = "lru"
    hot_rows: Mapping[str, torch.Tensor] = field(default_factory=dict)
    link: Optional[LinkModel] = None
    debug_checks: bool = False
    planner: str = "auto"
    table_budgets: str = "auto"
    disk: Mapping[str, DiskTierSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.table_budgets not in ("auto", "per_table", "shared"):
            raise ValueError(f"table_budgets must be 'auto', 'per_table' or 'shared', got {self.table_budgets!r}")
        if self.planner not in ("auto", "host", "device"):
            raise ValueError(f"planner must be 'auto', 'host' or 'device', got {self.planner!r}")
        if not 0.0 < self.cache_load_factor <= 1.0:
            raise ValueError(f"cache_load_factor must be in (0, 1], got {self.cache_load_factor}")
        EvictionPolicy.parse(self.eviction_policy)
        for name, n in self.num_slots.items():
            if int(n) < 1:
                raise ValueError(f"num_slots['{name}'] must be >= 1, got {n}")

    def plans_on_device(self, device: torch.device) -> bool:
        """Whether tables on ``device`` plan with the ``DevicePlanner``."""
        return self.planner == "device" or (self.planner == "auto" and torch.device(device).type != "cpu")

    def num_slots_for(self, table: str, local_rows: int, load_factor: float) -> int:
        if table in self.num_slots:
            return int(self.num_slots[table])
        if not 0.0 < load_factor <= 1.0:
            raise ValueError(f"table '{table}': cache load factor must be in (0, 1], got {load_factor}")
        return max(1, int(round(load_factor * local_rows)))

    def slots_for(self, table: str, local_rows: int, load_factor: float) -> int:
        """The slots a shard of ``local_rows`` rows caches: :meth:`num_slots_for`, at most its
        rows (what the kernel gives each table of its store)."""
        return min(self.num_slots_for(table, local_rows, load_factor), local_rows)

    def hot_rows_for(self, table: str, row_offset: int, local_rows: int) -> Optional[torch.Tensor]:
        """The table's hot rows that fall in this shard, as local ids."""
        rows = self.hot_rows.get(table)
        if rows is None:
            return None
        rows = torch.as_tensor(rows, dtype=torch.int64)
        mine = rows[(rows >= row_offset) & (rows < row_offset + local_rows)]
        return mine - row_offset
