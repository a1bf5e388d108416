"""The tiered embedding store: host tier + device cache per table group (``TieredTable``),
whose planner keeps the bookkeeping in NumPy on the host (``HostPlanner``) or in fixed-shape
tensors on the cache's device (``DevicePlanner``, for GPUs); nothing here imports TorchRec."""

from .errors import (
    CacheCapacityError,
    IdOutOfRangeError,
    InvalidInputError,
    NotPrefetchedError,
    ProactiveError,
    StoreStateError,
)
from .device_planner import DevicePlanner, RowMapping
from .eviction import EvictionPolicy
from .host_planner import HostPlanner
from .lookup import (
    TableBatch,
    plan_device_batch,
    plan_table_batch,
    plan_unique_rows,
    pooled_lookup,
    pooled_lookup_group,
)
from .optimizers import OptimizerConfig, OptimType, apply_row_update
from .tiered_table import (FetchPlan, Segment, TableStats, TieredTable, disk_record_bytes, load_factor_advice,
                           load_factor_text, unique_rows)

__all__ = [
    "CacheCapacityError", "DevicePlanner", "HostPlanner", "RowMapping", "EvictionPolicy", "FetchPlan", "IdOutOfRangeError", "InvalidInputError",
    "NotPrefetchedError", "OptimType", "OptimizerConfig", "ProactiveError", "Segment", "StoreStateError",
    "TableBatch", "TableStats", "TieredTable", "apply_row_update", "disk_record_bytes", "load_factor_advice",
    "load_factor_text",
    "plan_device_batch", "plan_table_batch", "plan_unique_rows", "pooled_lookup", "pooled_lookup_group", "unique_rows",
]
