"""Known third-party warnings a user of this package cannot act on, hidden by its entry points.

TorchRec passes DistributedDataParallel's deprecated ``broadcast_buffers`` itself, its
sharded tables are ShardedTensors (torch deprecates them in favour of DTensor), its row-wise
output dist calls the deprecated collectives' old names, its Criteo pipes use local
functions, torch.fx logs a note on its behalf, and fbgemm_gpu logs each library it loads.
Matched by message (and module, where one is given), so that any other warning still shows.
Called by the entry points (the CLI, the bench, the example script, each spawned rank), never
at import: a program that imports this package keeps its own warning settings.
"""

from __future__ import annotations

import logging
import warnings
from typing import Tuple

__all__ = ["quiet_third_party"]

_WARNINGS: Tuple[Tuple[type, str, str], ...] = (
    (FutureWarning, r"`broadcast_buffers` is deprecated", r"torchrec\.distributed\.model_parallel"),
    # raised in torch's, in TorchRec's KeyedOptimizer (torchrec.optim.keyed) and, on resume,
    # attributed to whichever caller's frame loads a ShardedTensor (ours too): any module
    (Warning, r"Please use DTensor instead and we are deprecating ShardedTensor", r""),
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", r""),
    (UserWarning, r"Local function is not supported by pickle", r"torch\.utils\.data\."),
)
_LOG_LINES: Tuple[Tuple[str, str], ...] = (
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true"),  # TorchRec's fx checks
    ("", "Successfully loaded: 'fbgemm_gpu"),  # fbgemm_gpu's import, on the root logger
)
_quieted = False


class _DropLines(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def quiet_third_party() -> None:
    """Hides the known third-party warnings above, once per process."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    for category, message, module in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, fragment in _LOG_LINES:
        logging.getLogger(name).addFilter(_DropLines(fragment))
