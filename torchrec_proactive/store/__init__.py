"""The tiered embedding store: host tier + device cache per table group. PyTorch tensors with
host-side bookkeeping in NumPy (``TieredTable``) or device-side, fixed-shape bookkeeping
(``DeviceTieredTable``, for GPUs); nothing here imports TorchRec."""

from .errors import (
    CacheCapacityError,
    IdOutOfRangeError,
    InvalidInputError,
    NotPrefetchedError,
    ProactiveError,
    StoreStateError,
)
from .device_table import DeviceFetchPlan, DeviceTieredTable, RowMapping
from .eviction import EvictionPolicy
from .lookup import (
    TableBatch,
    plan_device_batch,
    plan_table_batch,
    plan_unique_rows,
    pooled_lookup,
    pooled_lookup_group,
)
from .optimizers import OptimizerConfig, OptimType, apply_row_update
from .tiered_table import FetchPlan, Segment, TableStats, TieredTable, load_factor_advice, load_factor_text, unique_rows

__all__ = [
    "CacheCapacityError", "DeviceFetchPlan", "DeviceTieredTable", "RowMapping", "EvictionPolicy", "FetchPlan", "IdOutOfRangeError", "InvalidInputError",
    "NotPrefetchedError", "OptimType", "OptimizerConfig", "ProactiveError", "Segment", "StoreStateError",
    "TableBatch", "TableStats", "TieredTable", "apply_row_update", "load_factor_advice", "load_factor_text",
    "plan_device_batch", "plan_table_batch", "plan_unique_rows", "pooled_lookup", "pooled_lookup_group", "unique_rows",
]
