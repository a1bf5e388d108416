"""torchrec-proactive: fetch the cold embedding rows of batch N+k while batch N communicates.

Public API (TorchRec-facing names are imported lazily so the store can be used without TorchRec):

* :class:`ProactiveEmbeddingBagCollectionSharder` - swap in for ``EmbeddingBagCollectionSharder``.
* :class:`ProactiveTrainPipeline` - swap in for ``TrainPipelineSparseDist``.
* :mod:`torchrec_proactive.store` / :mod:`torchrec_proactive.fetch` - the store and fetch engine.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ProactiveEmbeddingBagCollectionSharder": "torchrec_proactive.integration.sharder",
    "ProactiveShardedEmbeddingBagCollection": "torchrec_proactive.integration.sharded_ebc",
    "ProactiveTrainPipeline": "torchrec_proactive.integration.pipeline",
}

__all__ = list(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchrec_proactive' has no attribute {name!r}")
