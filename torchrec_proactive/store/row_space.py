"""Ids of a group's features moved into its store's row space, on the ids' own device.

Pure tensor code (no TorchRec): the kernel calls it for every batch on the device planner,
and ``benchmarks/gpu_check.py`` runs it without TorchRec installed.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def device_store_rows(values: torch.Tensor, offsets: torch.Tensor, stride: int, feature_start: np.ndarray,
                      feature_start_device: torch.Tensor, feature_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``store_rows`` on the ids' own device with no host read: the feature of each id comes
    from the KJT's offsets (``offsets[f * stride]`` is where feature f's ids start: one
    ``searchsorted``), not from its lengths per key. ``feature_start`` is the host copy of
    ``feature_start_device``, read only for its (host-known) values.

    ``feature_rows`` (per feature, on the device: the rows of its own table) checks each id
    against its own table, not only the group's row space: an id outside it comes out as -1,
    which the store counts in ``bad_ids`` and never looks up (without it, id 150 of a
    100-row table would read the next table's row 50)."""
    rows = values.to(torch.int64)
    num_features = feature_start.shape[0]
    feature: Optional[torch.Tensor] = None
    if num_features > 1 and (feature_rows is not None or bool(feature_start.any())):
        starts = offsets.index_select(0, torch.arange(stride, num_features * stride, stride, device=offsets.device))
        position = torch.arange(rows.shape[0], device=rows.device, dtype=starts.dtype)
        feature = torch.searchsorted(starts, position, right=True)
        if bool(feature_start.any()):
            rows = rows + feature_start_device.index_select(0, feature)
    elif num_features == 1 and feature_start[0]:
        rows = rows + int(feature_start[0])
    if feature_rows is not None and num_features:
        local = values.to(torch.int64)
        limit = feature_rows.index_select(0, feature) if feature is not None else feature_rows.narrow(0, 0, 1)
        rows = rows.masked_fill((local < 0) | (local >= limit), -1)
    return rows
