"""``ShardedEmbeddingCollection`` whose cached tables are served from tiered stores.

Sequence tables (``EmbeddingConfig``: one embedding per id, no pooling) get the same store,
lookahead, pins, write-backs and fused optimizers as pooled ones: the proactive hooks live in
:class:`~.sharded_module.ProactiveShardedModule`, and the kernel looks a sequence group up as
bags of one id each (``ProactiveEmbeddingBag`` with ``PoolingMode.NONE``). This module names
TorchRec's sequence parts for them and keeps the factory TorchRec calls through the instance
(``create_embedding_sharding``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbedding
from torchrec.distributed.embedding import EmbeddingCollectionContext, ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
from torchrec.distributed.types import ShardingEnv

from .sharded_module import ProactiveContextFields, ProactiveShardedModule


@dataclass
class ProactiveECContext(ProactiveContextFields, EmbeddingCollectionContext):
    """TorchRec's EC context with the batch's fetch (see :class:`ProactiveContextFields`)."""


class ProactiveShardedEmbeddingCollection(ProactiveShardedModule, ShardedEmbeddingCollection):
    """A ``ShardedEmbeddingCollection`` with proactive cold-row fetching.

    Made by :class:`ProactiveEmbeddingCollectionSharder`; users do not build it directly.
    Its lookup returns each id's row (TorchRec's ``JaggedTensor`` per feature after the
    output all-to-all); the backward sums each row's gradients over its occurrences in id
    order (deterministic) before the fused update. ``prefetch_depth`` is set by
    :class:`ProactiveTrainPipeline`, exactly as for bags.
    """

    _stock_kernel_type = BatchedFusedEmbedding
    _lookup_type = GroupedEmbeddingsLookup
    _data_parallel_type = DpSequenceEmbeddingSharding

    def _shardings(self) -> List[Any]:
        return list(self._sharding_type_to_sharding.values())

    def _table_configs(self) -> List[Any]:
        return list(self._embedding_configs)

    def create_context(self) -> ProactiveECContext:
        return ProactiveECContext()

    def create_embedding_sharding(  # type: ignore[override]
        self,
        sharding_type: str,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> Any:
        self._mark_disk_tables(sharding_infos)
        sharding = ShardedEmbeddingCollection.create_embedding_sharding.__func__(  # type: ignore[attr-defined]
            type(self), sharding_type=sharding_type, sharding_infos=sharding_infos, env=env, device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )
        return self._claim_proactive_groups(sharding, device)
