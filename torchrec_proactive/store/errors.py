"""Errors raised by the tiered store. Every message names the table, the value and the limit."""

from __future__ import annotations


class ProactiveError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class IdOutOfRangeError(ProactiveError, IndexError):
    """An embedding id is negative or not below the table's (shard's) row count."""


class CacheCapacityError(ProactiveError):
    """The device cache cannot hold the rows that must be resident at the same time."""


class NotPrefetchedError(ProactiveError):
    """A lookup asked for rows that no fetch ticket covers (outside reactive mode)."""


class InvalidInputError(ProactiveError, ValueError):
    """Malformed input: shapes, dtypes, lengths that do not match values, non-finite values."""


class StoreStateError(ProactiveError):
    """The store was used out of order (e.g. loading weights while batches are in flight)."""
