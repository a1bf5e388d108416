"""The benchmark's model and data: a DLRM over Criteo-like tables with Zipf-skewed ids, or
(``model="sequence"``) a sequence recommender: the same pooled tables beside a user history,
looked up per id from an ``EmbeddingCollection``.

Every configuration of a bench run trains this same model, from the same initial weights,
on the same batches, so their step times can be divided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM

from ..data.criteo_synth import KAGGLE_CARDINALITIES, sample_zipf_ranks

NUM_DENSE = 13
MODELS = ("dlrm", "sequence")
HISTORY_FEATURE = "history"


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
    #: ``"dlrm"``, or ``"sequence"``: a user history of ``history_length`` item ids per
    #: sample (every sample's full history, as a recommender trained on its last N events
    #: sees it), Zipf(``zipf_alpha``) over ``history_rows`` items, looked up per id
    model: str = "dlrm"
    history_length: int = 32
    history_rows: int = 400_000

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.model == "sequence" and (self.history_length < 1 or self.history_rows < 1):
            raise ValueError(f"history_length and history_rows must be >= 1, got {self.history_length}, "
                             f"{self.history_rows}")
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

    def sequence_tables(self) -> List[EmbeddingConfig]:
        """The history table (``model="sequence"``; none otherwise)."""
        if self.model != "sequence":
            return []
        return [EmbeddingConfig(name="t_history", embedding_dim=self.embedding_dim, num_embeddings=self.history_rows,
                                feature_names=[HISTORY_FEATURE])]

    def ids_per_step(self) -> int:
        """Ids one rank's batch looks up: pooled ids plus history ids."""
        history = self.history_length if self.model == "sequence" else 0
        return self.batch_size * (self.num_tables * self.ids_per_feature + history)

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
            keys = [f"cat_{i}" for i in range(len(cards))]
            lengths = torch.full((len(cards) * self.batch_size,), self.ids_per_feature, dtype=torch.int64)
            if self.model == "sequence":
                n = self.batch_size * self.history_length
                values.append(torch.from_numpy(sample_zipf_ranks(rng, self.history_rows, self.zipf_alpha, n)
                                               .astype(np.int64)))
                keys.append(HISTORY_FEATURE)
                lengths = torch.cat([lengths, torch.full((self.batch_size,), self.history_length, dtype=torch.int64)])
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=lengths)
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


class SequenceTrainModel(nn.Module):
    """A sequence recommender: each sample's history rows (an ``EmbeddingCollection``),
    weighed by a learned weight per position and summed, beside DLRM's pooled features and
    dense arch, into an MLP. ``forward(Batch) -> (loss, logits)``."""

    def __init__(self, workload: Workload) -> None:
        super().__init__()
        d, cpu = workload.embedding_dim, torch.device("cpu")
        self.history_length = workload.history_length
        self.ebc = EmbeddingBagCollection(tables=workload.tables(), device=cpu)
        self.ec = EmbeddingCollection(tables=workload.sequence_tables(), device=cpu)
        self.features = [f"cat_{i}" for i in range(workload.num_tables)]
        self.positions = nn.Parameter(torch.full((workload.history_length, 1), 1.0 / workload.history_length))
        self.dense = nn.Sequential(nn.Linear(NUM_DENSE, 128), nn.ReLU(), nn.Linear(128, d), nn.ReLU())
        self.over = nn.Sequential(nn.Linear(d * (workload.num_tables + 2), 256), nn.ReLU(), nn.Linear(256, 128),
                                  nn.ReLU(), nn.Linear(128, 1))
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch):
        kjt = batch.sparse_features
        pooled = self.ebc(kjt).to_dict()
        history = self.ec(kjt)[HISTORY_FEATURE].to_padded_dense(desired_length=self.history_length)
        summary = (history * self.positions).sum(dim=1)  # [B, d]
        x = torch.cat([self.dense(batch.dense_features), summary] + [pooled[f] for f in self.features], dim=1)
        logits = self.over(x).squeeze(-1)
        return self.loss_fn(logits, batch.labels), logits.detach()


def bench_model(workload: Workload) -> nn.Module:
    """The workload's model: :class:`DLRMTrainModel` or :class:`SequenceTrainModel`."""
    return SequenceTrainModel(workload) if workload.model == "sequence" else DLRMTrainModel(workload)
