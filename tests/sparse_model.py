"""A small EBC + dense model with the ``forward(Batch) -> (loss, logits)`` shape pipelines expect."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import PoolingType

DENSE_IN = 8


def make_tables(num_tables: int = 4, rows: int = 1000, dim: int = 16, shared_feature: bool = False,
                pooling: PoolingType = PoolingType.SUM) -> List[EmbeddingBagConfig]:
    tables = []
    for i in range(num_tables):
        features = [f"f{i}"] + ([f"f{i}_b"] if shared_feature and i == 0 else [])
        tables.append(EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                                         feature_names=features, pooling=pooling))
    return tables


class SparseModel(nn.Module):
    def __init__(self, tables: List[EmbeddingBagConfig], device: Optional[torch.device] = None,
                 weighted: bool = False) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables, device=device or torch.device("cpu"), is_weighted=weighted)
        self.feature_names = [f for t in tables for f in t.feature_names]
        width = sum(t.embedding_dim * len(t.feature_names) for t in tables) + DENSE_IN
        self.over = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: Batch):
        pooled = self.ebc(batch.sparse_features).to_dict()
        # Sharded KeyedTensors come in sharding order: index by feature name.
        x = torch.cat([pooled[f] for f in self.feature_names] + [batch.dense_features], dim=1)
        logits = self.over(x).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def make_batch(tables: List[EmbeddingBagConfig], batch_size: int, seed: int, max_len: int = 4,
               zipf: float = 1.2, weighted: bool = False, one_id_per_bag: bool = False) -> Batch:
    """Zipf-skewed ids so a small cache sees both hits and misses; bags of 0..max_len ids,
    or exactly one id per bag (Criteo's shape) with ``one_id_per_bag``."""
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for t in tables:
        ranks = torch.arange(1, t.num_embeddings + 1, dtype=torch.float64)
        probs = ranks.pow(-zipf)
        for f in t.feature_names:
            l = (torch.ones(batch_size, dtype=torch.int64) if one_id_per_bag
                 else torch.randint(0, max_len + 1, (batch_size,), generator=g))
            v = torch.multinomial(probs, int(l.sum()), replacement=True, generator=g)
            keys.append(f)
            lengths.append(l)
            values.append(v)
    vals = torch.cat(values)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=vals, lengths=torch.cat(lengths),
        weights=torch.rand(vals.numel(), generator=g) if weighted else None,
    )
    return Batch(dense_features=torch.randn(batch_size, DENSE_IN, generator=g), sparse_features=kjt,
                 labels=torch.randint(0, 2, (batch_size,), generator=g).float())


def make_vbe_batch(tables: List[EmbeddingBagConfig], batch_size: int, seed: int, max_len: int = 3) -> Batch:
    """A variable-batch-per-feature (VBE) batch: feature ``i`` has ``batch_size // (i % 3 + 1)``
    distinct bags (a user feature shared by several samples of a request, say), and the KJT's
    ``inverse_indices`` map each of the ``batch_size`` samples to its bag, as TorchRec's VBE
    inputs do; the EBC's output is expanded back to ``batch_size`` rows."""
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values, strides, inverse = [], [], [], [], []
    for t in tables:
        probs = torch.arange(1, t.num_embeddings + 1, dtype=torch.float64).pow(-1.2)
        for f in t.feature_names:
            bags = max(1, batch_size // (len(keys) % 3 + 1))
            n = torch.randint(0, max_len + 1, (bags,), generator=g)
            keys.append(f)
            strides.append([bags])
            lengths.append(n)
            values.append(torch.multinomial(probs, int(n.sum()), replacement=True, generator=g))
            inverse.append(torch.randint(0, bags, (batch_size,), generator=g))
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths),
                            stride_per_key_per_rank=strides, inverse_indices=(keys, torch.stack(inverse)))
    return Batch(dense_features=torch.randn(batch_size, DENSE_IN, generator=g), sparse_features=kjt,
                 labels=torch.randint(0, 2, (batch_size,), generator=g).float())
