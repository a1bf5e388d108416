"""``ShardedEmbeddingBagCollection`` whose cached tables are served from tiered stores.

The proactive hooks live in :class:`~.sharded_module.ProactiveShardedModule`; this module
names TorchRec's pooled parts for them and keeps the one factory TorchRec calls through the
instance (``create_embedding_bag_sharding``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv

from .sharded_module import (  # noqa: F401 - (re-exported: the public names lived here)
    BatchFetch,
    BatchRecord,
    ProactiveContextFields,
    ProactiveShardedModule,
    ProactiveStats,
    is_proactive_group,
)


@dataclass
class ProactiveEBCContext(ProactiveContextFields, EmbeddingBagCollectionContext):
    """TorchRec's EBC context with the batch's fetch (see :class:`ProactiveContextFields`)."""


class ProactiveShardedEmbeddingBagCollection(ProactiveShardedModule, ShardedEmbeddingBagCollection):
    """A ``ShardedEmbeddingBagCollection`` with proactive cold-row fetching.

    Made by :class:`ProactiveEmbeddingBagCollectionSharder`; users do not build it directly.
    ``prefetch_depth`` is set by :class:`ProactiveTrainPipeline`; at depth 0 (the default,
    and what a plain ``model(batch)`` call uses) rows are fetched at lookup time.
    """

    _stock_kernel_type = BatchedFusedEmbeddingBag
    _lookup_type = GroupedPooledEmbeddingsLookup
    _data_parallel_type = DpPooledEmbeddingSharding

    def _shardings(self) -> List[Any]:
        return list(self._embedding_shardings)

    def _table_configs(self) -> List[Any]:
        return list(self._embedding_bag_configs)

    def create_context(self) -> ProactiveEBCContext:
        return ProactiveEBCContext()

    def create_embedding_bag_sharding(  # type: ignore[override]
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> Any:
        self._mark_disk_tables(sharding_infos)
        sharding = ShardedEmbeddingBagCollection.create_embedding_bag_sharding.__func__(  # type: ignore[attr-defined]
            type(self), sharding_infos, env, device, permute_embeddings=permute_embeddings,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )
        return self._claim_proactive_groups(sharding, device)
