"""Known third-party warnings the bench's users cannot act on, filtered in its entry points only."""

from __future__ import annotations

import logging
import warnings
from typing import Tuple

__all__ = ["quiet_third_party"]


# Raised inside TorchRec / PyTorch for calls they make themselves: nothing a user of the bench
# can act on. Filtered by message, in our entry points and the rank processes they spawn only
# (never at library import).
_THIRD_PARTY_WARNINGS: Tuple[Tuple[type, str], ...] = (
    (FutureWarning, r"`broadcast_buffers` is deprecated"),  # DistributedModelParallel -> DDP
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"),
)
_THIRD_PARTY_LOG_LINES: Tuple[Tuple[str, str], ...] = (
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true"),  # TorchRec's fx checks
)


class _DropLines(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def quiet_third_party() -> None:
    """Filters the known third-party warnings we cannot fix (idempotent). Entry points only."""
    for category, message in _THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, fragment in _THIRD_PARTY_LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) and f.fragment == fragment for f in logger.filters):
            logger.addFilter(_DropLines(fragment))
