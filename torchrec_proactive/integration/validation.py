"""Checks a batch's sparse features before they leave the rank that owns them."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..store import IdOutOfRangeError, InvalidInputError


class InputValidator:
    """Vectorised range and shape checks of a KJT against the tables its features feed.

    One pass over the ids (a gather of per-feature limits and two comparisons); the
    message names the feature, its table, the offending id, the limit and the sample.
    """

    def __init__(self, configs: Sequence[EmbeddingBagConfig]) -> None:
        self._table_of: Dict[str, str] = {}
        self._rows_of: Dict[str, int] = {}
        for cfg in configs:
            for feature in cfg.feature_names:
                self._table_of[feature] = cfg.name
                self._rows_of[feature] = cfg.num_embeddings
        self._limits_cache: Dict[tuple, torch.Tensor] = {}

    def _limits(self, keys: List[str]) -> torch.Tensor:
        key = tuple(keys)
        limits = self._limits_cache.get(key)
        if limits is None:
            # Features of other modules may ride in the same KJT (several EBCs fed from one
            # KJT): TorchRec's input dist routes each module its own, so they are not ours
            # to check here and get no limit.
            unbounded = torch.iinfo(torch.int64).max
            limits = torch.tensor([self._rows_of.get(k, unbounded) for k in keys], dtype=torch.int64)
            self._limits_cache[key] = limits
        return limits

    def check(self, features: KeyedJaggedTensor) -> None:
        keys = features.keys()
        values, lengths = features.values(), features.lengths()
        if values.is_floating_point():
            raise InvalidInputError(f"sparse feature ids must be integers, got {values.dtype}")
        total = int(lengths.sum()) if lengths.numel() else 0
        if total != values.numel():
            raise InvalidInputError(
                f"KeyedJaggedTensor lengths add up to {total} but it holds {values.numel()} ids (features {keys})"
            )
        if bool((lengths < 0).any()):
            raise InvalidInputError(f"KeyedJaggedTensor has negative lengths (features {keys})")
        weights = features.weights_or_none()
        if weights is not None and not bool(torch.isfinite(weights).all()):
            raise InvalidInputError(f"per-sample weights of features {keys} contain NaN or Inf")
        if values.numel() == 0:
            return
        per_key = torch.tensor(features.length_per_key(), dtype=torch.int64)
        limits = self._limits(keys)
        limit = limits.repeat_interleave(per_key)
        ours = (limits != torch.iinfo(torch.int64).max).repeat_interleave(per_key)
        v = values.to(torch.int64).cpu()
        bad = ((v < 0) & ours) | (v >= limit)
        if not bool(bad.any()):
            return
        i = int(torch.nonzero(bad)[0])
        key_index = int(torch.searchsorted(per_key.cumsum(0), torch.tensor(i), right=True))
        feature = keys[key_index]
        # (each feature's bags start after the earlier features' bags: its own batch size
        # with a variable batch per feature)
        first_bag = sum(features.stride_per_key()[:key_index])
        key_offsets = features.offsets()
        position = int(torch.searchsorted(key_offsets, torch.tensor(i), right=True)) - 1
        sample = position - first_bag
        raise IdOutOfRangeError(
            f"feature '{feature}' (table '{self._table_of[feature]}'): id {int(v[i])} is out of range "
            f"[0, {self._rows_of[feature]}) in sample {sample} of this rank's batch"
        )
