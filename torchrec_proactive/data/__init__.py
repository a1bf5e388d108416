"""Criteo data for the product: a synthetic Criteo-format generator and TorchRec-based
preprocessing/loading.

``criteo_synth`` needs only NumPy; ``criteo`` imports TorchRec, so its names are loaded
lazily (the generator stays usable without TorchRec installed).
"""

from typing import Any

from torchrec_proactive.data.criteo_synth import (
    KAGGLE_CARDINALITIES,
    SPEC_FILE,
    TERABYTE_CARDINALITIES,
    SyntheticCriteoSpec,
    generate,
    read_generated,
    sample_zipf_ranks,
)

_LAZY = {
    "PreprocessedCriteo": "torchrec_proactive.data.criteo",
    "RowRange": "torchrec_proactive.data.criteo",
    "make_dataloaders": "torchrec_proactive.data.criteo",
    "preprocess": "torchrec_proactive.data.criteo",
    "split_rows": "torchrec_proactive.data.criteo",
}

__all__ = [
    "KAGGLE_CARDINALITIES",
    "SPEC_FILE",
    "TERABYTE_CARDINALITIES",
    "SyntheticCriteoSpec",
    "generate",
    "read_generated",
    "sample_zipf_ranks",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchrec_proactive.data' has no attribute {name!r}")
