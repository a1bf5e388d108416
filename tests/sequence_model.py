"""A small sequence recommender for tests: a user history looked up per id (an
``EmbeddingCollection``) beside pooled features (an ``EmbeddingBagCollection``), both fed
from one KJT, with the ``forward(Batch) -> (loss, logits)`` shape pipelines expect."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch

DENSE_IN = 8
MAX_HISTORY = 6


def make_sequence_tables(num_tables: int = 2, rows: int = 800, dim: int = 8) -> List[EmbeddingConfig]:
    """History tables; the first is read by two features (items clicked and items bought)."""
    return [EmbeddingConfig(name=f"s{i}", embedding_dim=dim, num_embeddings=rows,
                            feature_names=[f"h{i}"] + (["h0_b"] if i == 0 else []))
            for i in range(num_tables)]


def make_pooled_tables(num_tables: int = 2, rows: int = 600, dim: int = 8) -> List[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"p{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"p{i}"])
            for i in range(num_tables)]


class SequenceModel(nn.Module):
    """Each history feature's rows, padded to ``MAX_HISTORY`` positions and flattened (so
    every position has its own weights and its own gradient), beside the pooled features."""

    def __init__(self, seq_tables: List[EmbeddingConfig], pooled_tables: Optional[List[EmbeddingBagConfig]] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        device = device or torch.device("cpu")
        self.ec = EmbeddingCollection(tables=seq_tables, device=device)
        self.ebc = EmbeddingBagCollection(tables=pooled_tables, device=device) if pooled_tables else None
        self.seq_features = [f for t in seq_tables for f in t.feature_names]
        self.pooled_features = [f for t in pooled_tables or [] for f in t.feature_names]
        dim = seq_tables[0].embedding_dim
        width = len(self.seq_features) * MAX_HISTORY * dim + DENSE_IN
        width += sum(t.embedding_dim * len(t.feature_names) for t in pooled_tables or [])
        self.over = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: Batch):
        kjt = batch.sparse_features
        seqs = self.ec(kjt)
        parts = [seqs[f].to_padded_dense(desired_length=MAX_HISTORY).flatten(1) for f in self.seq_features]
        if self.ebc is not None:
            pooled = self.ebc(kjt).to_dict()
            parts += [pooled[f] for f in self.pooled_features]
        x = torch.cat(parts + [batch.dense_features], dim=1)
        logits = self.over(x).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def make_sequence_batch(seq_tables: List[EmbeddingConfig], pooled_tables: Optional[List[EmbeddingBagConfig]],
                        batch_size: int, seed: int, max_history: int = MAX_HISTORY, zipf: float = 1.1) -> Batch:
    """One KJT with every feature: histories of 0..``max_history`` ids, pooled bags of 1..3
    ids; ids Zipf-skewed (exponent ``zipf``) so a small cache sees hits and misses, and a
    history repeats items (so a row's gradient sums several occurrences)."""
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for tables, low, high in ((seq_tables, 0, max_history), (pooled_tables or [], 1, 3)):
        for t in tables:
            probs = torch.arange(1, t.num_embeddings + 1, dtype=torch.float64).pow(-zipf)
            for f in t.feature_names:
                n = torch.randint(low, high + 1, (batch_size,), generator=g)
                keys.append(f)
                lengths.append(n)
                values.append(torch.multinomial(probs, int(n.sum()), replacement=True, generator=g))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return Batch(dense_features=torch.randn(batch_size, DENSE_IN, generator=g), sparse_features=kjt,
                 labels=torch.randint(0, 2, (batch_size,), generator=g).float())
