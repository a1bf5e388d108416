"""torchrec-proactive: fetch the cold embedding rows of batch N+k while batch N communicates.

Public API (imported lazily, so ``import torchrec_proactive`` is cheap and the store can be
used without TorchRec; ``dir(torchrec_proactive)`` lists it):

* :class:`ProactiveEmbeddingBagCollectionSharder` - swap in for ``EmbeddingBagCollectionSharder``.
* :class:`ProactiveEmbeddingCollectionSharder` - swap in for ``EmbeddingCollectionSharder``
  (sequence tables).
* :class:`ProactiveTrainPipeline` - swap in for ``TrainPipelineSparseDist``.
* :class:`ProactiveShardedEmbeddingBagCollection`, :class:`ProactiveShardedEmbeddingCollection` -
  the sharded modules the sharders build.
* :class:`ProactiveOptions` - how the sharder caches proactive tables (its keyword
  arguments, as the sharder holds them: ``sharder.options``).
* :class:`LinkModel` - an emulated host-to-device link for CPU runs (``torchrec_proactive.fetch``).
* :mod:`torchrec_proactive.store` / :mod:`torchrec_proactive.fetch` - the store and fetch engine.
* :func:`load_checkpoint` - ``dcp.load`` that reads ``.metadata`` safely (no code from the
  checkpoint runs) and refuses files outside the checkpoint (:mod:`torchrec_proactive.checkpoint`).
"""

import importlib as _importlib
from typing import Any as _Any, List as _List

__version__ = "0.1.0"

_LAZY = {
    "ProactiveEmbeddingBagCollectionSharder": "torchrec_proactive.integration.sharder",
    "ProactiveEmbeddingCollectionSharder": "torchrec_proactive.integration.sharder",
    "ProactiveShardedEmbeddingBagCollection": "torchrec_proactive.integration.sharded_ebc",
    "ProactiveShardedEmbeddingCollection": "torchrec_proactive.integration.sharded_ec",
    "ProactiveTrainPipeline": "torchrec_proactive.integration.pipeline",
    "ProactiveOptions": "torchrec_proactive.integration.options",
    "LinkModel": "torchrec_proactive.fetch",
    "load_checkpoint": "torchrec_proactive.checkpoint",
}
_SUBMODULES = ("fetch", "store", "integration", "data", "config", "app", "bench", "planning", "launch", "cli",
               "checkpoint")

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # imported once
        return value
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'torchrec_proactive' has no attribute {name!r}")


def __dir__() -> _List[str]:
    return sorted({*__all__, *_SUBMODULES})
