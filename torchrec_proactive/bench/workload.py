"""The benchmark's model and data: a DLRM over Criteo-like tables with Zipf-skewed ids.

Every configuration of a bench run trains this same model, from the same initial weights,
on the same batches, so their step times can be divided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM

from ..data.criteo_synth import KAGGLE_CARDINALITIES, sample_zipf_ranks

NUM_DENSE = 13


@dataclass(frozen=True)
class Workload:
    """Shape of the benchmark model and its data (per rank)."""

    num_tables: int = 8
    rows_per_table: int = 100_000
    embedding_dim: int = 64
    batch_size: int = 512
    ids_per_feature: int = 1
    zipf_alpha: float = 1.05
    #: skewed tables: table i's Zipf exponent is ``zipf_alpha * (1 + skew * (1 - 2 i / (n - 1)))``
    #: (flatter tables miss more), so table-wise shards differ in rows copied per step
    skew: float = 0.0
    seed: int = 0
    #: bursts: every ``burst_every``-th batch (0: none) draws ``burst_share`` of each table's
    #: ids uniformly over its rows (cold rows: a new day's ids, a crawler), the rest as usual;
    #: the scaling study's held-out runs use it (a burst that outlasts its window stalls the
    #: steps behind it, which a model of the mean copy does not see)
    burst_every: int = 0
    burst_share: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_tables", "rows_per_table", "embedding_dim", "batch_size", "ids_per_feature"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.skew < 1.0:
            raise ValueError(f"skew must be in [0, 1), got {self.skew}")
        if self.burst_every < 0 or not 0.0 <= self.burst_share <= 1.0:
            raise ValueError(f"burst_every must be >= 0 and burst_share in [0, 1], got {self.burst_every}, "
                             f"{self.burst_share}")
        if self.embedding_dim % 4:
            raise ValueError(f"embedding_dim must be a multiple of 4 (FBGEMM), got {self.embedding_dim}")

    def cardinalities(self) -> List[int]:
        """Kaggle's largest tables, capped at ``rows_per_table`` (skew comes from Zipf)."""
        big = sorted(KAGGLE_CARDINALITIES, reverse=True)[: self.num_tables]
        return [min(c, self.rows_per_table) for c in big]

    def alphas(self) -> List[float]:
        """Each table's Zipf exponent (all ``zipf_alpha`` unless ``skew``; the cache-planning
        case's workload sets its own per table)."""
        n = self.num_tables
        return [self.zipf_alpha * (1 + self.skew * (1 - 2 * i / (n - 1) if n > 1 else 0.0)) for i in range(n)]

    def tables(self) -> List[EmbeddingBagConfig]:
        return [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=self.embedding_dim, num_embeddings=n, feature_names=[f"cat_{i}"])
            for i, n in enumerate(self.cardinalities())
        ]

    def batches(self, num: int, rank: int) -> List[Batch]:
        rng = np.random.default_rng([self.seed, rank])
        out = []
        cards = self.cardinalities()
        for index in range(num):
            n = self.batch_size * self.ids_per_feature
            values = [torch.from_numpy(sample_zipf_ranks(rng, c, a, n).astype(np.int64))
                      for c, a in zip(cards, self.alphas())]
            if self.burst_every and index % self.burst_every == self.burst_every - 1:
                cold = int(round(self.burst_share * n))
                for v, c in zip(values, cards):
                    v[:cold] = torch.from_numpy(rng.integers(0, c, size=cold))
            lengths = torch.full((len(cards) * self.batch_size,), self.ids_per_feature, dtype=torch.int64)
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=[f"cat_{i}" for i in range(len(cards))], values=torch.cat(values), lengths=lengths
            )
            dense = torch.from_numpy(rng.standard_normal((self.batch_size, NUM_DENSE)).astype(np.float32))
            labels = torch.from_numpy((rng.random(self.batch_size) < 0.25).astype(np.float32))
            out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
        return out


class DLRMTrainModel(nn.Module):
    """``forward(Batch) -> (loss, logits)`` around TorchRec's DLRM (what pipelines expect)."""

    def __init__(self, workload: Workload) -> None:
        super().__init__()
        d = workload.embedding_dim
        ebc = EmbeddingBagCollection(tables=workload.tables(), device=torch.device("cpu"))
        self.model = DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                          dense_arch_layer_sizes=[128, d], over_arch_layer_sizes=[256, 128, 1])
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch):
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        return self.loss_fn(logits, batch.labels), logits.detach()
