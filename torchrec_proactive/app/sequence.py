"""``model=sequence``: a small sequence recommender on Criteo-format data.

The 26 Criteo categorical features are pooled (an ``EmbeddingBagCollection``, as in DLRM);
a user history (the ``history`` feature, :mod:`torchrec_proactive.data.history`) is looked
up id by id (an ``EmbeddingCollection``: one row per id, a ``JaggedTensor``), padded to
``model.history_length`` positions and summarised by a learned weight per position. The
summary, the pooled embeddings and the dense arch's output feed the over-arch MLP.

Wrapped in TorchRec's ``DLRMTrain``, so ``forward(batch)`` returns ``loss, (loss, logits,
labels)`` as for DLRM: the loop, evaluation (AUROC) and checkpoints take it unchanged.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.models.dlrm import DenseArch, DLRMTrain, OverArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..config.schema import NUM_DENSE_FEATURES, ModelConfig
from ..data.history import HISTORY_FEATURE, HistorySpec

HISTORY_TABLE = "t_history"


def history_table(cfg: ModelConfig) -> EmbeddingConfig:
    """The history's table: ``model.history_rows`` rows of ``model.embedding_dim``."""
    return EmbeddingConfig(name=HISTORY_TABLE, embedding_dim=cfg.embedding_dim, num_embeddings=cfg.history_rows,
                           feature_names=[HISTORY_FEATURE])


def history_spec(cfg: ModelConfig, seed: int) -> HistorySpec:
    """The histories the data gets for this model (``seed``: ``data.seed``)."""
    return HistorySpec(length=cfg.history_length, rows=cfg.history_rows, alpha=cfg.history_zipf_alpha, seed=seed)


class SequenceRecommender(nn.Module):
    """``forward(dense_features, sparse_features) -> logits [B, 1]`` (DLRM's signature).

    The pooled and the sequence collection read the same KJT (each takes its own keys), so
    ``ProactiveTrainPipeline`` finds both lookups fed straight from the batch and pipelines
    both. Padding positions are zero rows: a history shorter than ``history_length``
    contributes only its own ids to the summary."""

    def __init__(self, ebc: EmbeddingBagCollection, ec: EmbeddingCollection, history_length: int,
                 dense_arch_layer_sizes: Sequence[int], over_arch_layer_sizes: Sequence[int],
                 dense_device: torch.device) -> None:
        super().__init__()
        self.embedding_bag_collection = ebc
        self.embedding_collection = ec
        self.history_length = history_length
        dim = ec.embedding_configs()[0].embedding_dim
        pooled = sum(c.embedding_dim * len(c.feature_names) for c in ebc.embedding_bag_configs())
        self.dense_arch = DenseArch(NUM_DENSE_FEATURES, list(dense_arch_layer_sizes), dense_device)
        # one weight per position (mean-like at the start): the model learns how much
        # recent and older positions count
        self.position_weight = nn.Parameter(torch.full((history_length,), 1.0 / history_length, device=dense_device))
        width = dense_arch_layer_sizes[-1] + pooled + dim
        self.over_arch = OverArch(width, list(over_arch_layer_sizes), dense_device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        dense = self.dense_arch(dense_features)
        pooled = self.embedding_bag_collection(sparse_features).values()  # [B, 26 * D], table order
        rows = self.embedding_collection(sparse_features)[HISTORY_FEATURE]
        padded = rows.to_padded_dense(desired_length=self.history_length)  # [B, L, D], zeros past each length
        history = (padded * self.position_weight.view(1, -1, 1)).sum(dim=1)
        return self.over_arch(torch.cat([dense, pooled, history], dim=1))


def build_sequence_model(cfg: ModelConfig, pooled_tables: List[EmbeddingBagConfig],
                         device: torch.device) -> DLRMTrain:
    """``DLRMTrain(SequenceRecommender)`` with both collections on the meta device
    (sharding allocates and initialises only each rank's shards)."""
    meta = torch.device("meta")
    ebc = EmbeddingBagCollection(tables=pooled_tables, device=meta)
    ec = EmbeddingCollection(tables=[history_table(cfg)], device=meta)
    net = SequenceRecommender(ebc, ec, cfg.history_length, cfg.dense_arch_layer_sizes, cfg.over_arch_layer_sizes,
                              device)
    return DLRMTrain(net)  # type: ignore[arg-type]  (any module with DLRM's forward)
