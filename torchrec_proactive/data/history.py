"""Synthetic user histories for the sequence recommender (``model=sequence``).

Criteo has no user history, so each sample is given one, as a pure function of the sample
itself: its *key* is a 64-bit hash of its own sparse ids (every id of every feature of its
KJT, with the feature's position) and ``seed``. The same sample therefore gets the same
history in any batch, at any position, on any rank, shuffled or not, resumed or not - so
``compare``, resumes and evaluation all see one history per sample.

The distribution, with ``L = length``, ``N = rows``, ``a = alpha``:

* **length**: ``1 + h mod L`` for a hash ``h`` of the key: uniform on ``1..L`` (every
  history holds at least one id; the bias of the modulo is below ``L / 2**64``).
* **ids**: position ``p``'s id is ``floor(x) - 1`` where ``x`` is the inverse CDF of the
  continuous power law with density ``~ x**-a`` on ``[1, N + 1)``, applied to a uniform
  ``u`` in ``[0, 1)`` hashed from ``(key, p)`` - the same sampler as the synthetic Criteo
  generator's (``criteo_synth.sample_zipf_ranks``), so id ``r`` has weight about
  ``(r + 1)**-a`` (Zipf(a)) and id 0 is the most popular. Exactly, the ids below ``k`` take
  ``((k + 1)**(1 - a) - 1) / ((N + 1)**(1 - a) - 1)`` of all draws (``log(k + 1) / log(N + 1)``
  for ``a = 1``): :func:`share_below`. Positions of one history are drawn independently
  (a history may repeat an id, as a user's does).

Vectorised NumPy: no Python loop per sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Tuple

import numpy as np
import torch

#: The KJT key of the history feature (the EC's one feature).
HISTORY_FEATURE = "history"

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_LENGTH_SALT = np.uint64(0x6C656E677468)  # b"length": the length's hash differs from every id's
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on ``uint64`` (wrapping arithmetic): a bijection of 64-bit
    values whose outputs look uniform, so any bit range of it is a fair hash."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class HistorySpec:
    """What a history is: at most ``length`` ids below ``rows``, Zipf(``alpha``) skewed;
    ``seed`` picks another set of histories for the same samples."""

    length: int
    rows: int
    alpha: float
    seed: int = 0

    def __post_init__(self) -> None:
        if self.length < 1 or self.rows < 1 or not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"HistorySpec(length={self.length}, rows={self.rows}, alpha={self.alpha}) is invalid: "
                             f"needs length >= 1, rows >= 1 and a finite alpha > 0")


def sample_keys(kjt: Any, seed: int = 0) -> np.ndarray:
    """One ``uint64`` key per sample of ``kjt`` (a ``KeyedJaggedTensor`` of one batch size
    for every feature): a hash of the sample's ids, each mixed with its feature's index, so
    it depends on the sample alone - never on the batch it is in or its position there.
    Ids within one feature's bag are summed (a bag's order does not change the key)."""
    lengths = kjt.lengths().numpy().astype(np.int64)
    values = kjt.values().numpy().astype(np.int64).astype(np.uint64)
    features = len(kjt.keys())
    batch = lengths.size // max(features, 1)
    feature_of = np.repeat(np.arange(features, dtype=np.uint64), batch)  # per (feature, sample) bag
    with np.errstate(over="ignore"):
        mixed = splitmix64(splitmix64(values) ^ (np.repeat(feature_of, lengths) + np.uint64(1)) * _GOLDEN)
        keys = np.zeros(batch, dtype=np.uint64)
        if lengths.size and (lengths == 1).all():  # Criteo: one id per sample and feature
            keys = mixed.reshape(features, batch).sum(axis=0, dtype=np.uint64)
        else:  # multi-hot: sum each sample's ids, wrapping
            np.add.at(keys, np.repeat(np.tile(np.arange(batch), features), lengths), mixed)
    return splitmix64(keys ^ splitmix64(np.full(1, seed, dtype=np.uint64)))


def zipf_ids(u: np.ndarray, rows: int, alpha: float) -> np.ndarray:
    """Ids in ``[0, rows)`` from uniforms ``u`` in ``[0, 1)``: the floored inverse CDF of the
    continuous power law ``x**-alpha`` on ``[1, rows + 1)``, less one (id 0 the hottest)."""
    log_top = math.log(rows + 1.0)
    exponent = 1.0 - alpha
    if abs(exponent) < 1e-9:
        x = np.exp(u * log_top)
    else:  # (1 + u * ((N+1)**e - 1)) ** (1/e), with expm1/log1p for e near 0
        x = np.exp(np.log1p(u * math.expm1(exponent * log_top)) / exponent)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, rows - 1)


def share_below(k: int, rows: int, alpha: float) -> float:
    """The share of history ids below ``k`` that :func:`zipf_ids` gives (the formula the
    docstring states): what the top ``k`` ids take."""
    if k >= rows:
        return 1.0
    exponent = 1.0 - alpha
    if abs(exponent) < 1e-9:
        return math.log(k + 1.0) / math.log(rows + 1.0)
    return math.expm1(exponent * math.log(k + 1.0)) / math.expm1(exponent * math.log(rows + 1.0))


def histories(keys: np.ndarray, spec: HistorySpec) -> Tuple[np.ndarray, np.ndarray]:
    """``(lengths, ids)`` of the samples with ``keys``: lengths in ``1..spec.length``, ids
    (concatenated in sample order) in ``[0, spec.rows)``; a function of each key alone."""
    keys = keys.astype(np.uint64)
    with np.errstate(over="ignore"):
        lengths = (splitmix64(keys ^ _LENGTH_SALT) % np.uint64(spec.length)).astype(np.int64) + 1
        starts = np.cumsum(lengths) - lengths
        position = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        h = splitmix64(np.repeat(keys, lengths) ^ splitmix64(position.astype(np.uint64) + np.uint64(1)))
    u = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53  # 53 bits: exact in a double, < 1
    return lengths, zipf_ids(u, spec.rows, spec.alpha)


def with_history(batch: Any, spec: HistorySpec) -> Any:
    """``batch`` (a TorchRec ``Batch``) whose KJT gains the :data:`HISTORY_FEATURE` key
    (last), each sample's history from :func:`histories` of its own ids."""
    from torchrec import KeyedJaggedTensor

    kjt = batch.sparse_features
    if HISTORY_FEATURE in kjt.keys():
        raise ValueError(f"the batch already has a {HISTORY_FEATURE!r} feature")
    lengths, ids = histories(sample_keys(kjt, spec.seed), spec)
    values = torch.cat([kjt.values(), torch.from_numpy(ids).to(kjt.values().dtype)])
    all_lengths = torch.cat([kjt.lengths(), torch.from_numpy(lengths).to(kjt.lengths().dtype)])
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[*kjt.keys(), HISTORY_FEATURE], values=values,
                                                 lengths=all_lengths)
    return type(batch)(dense_features=batch.dense_features, sparse_features=sparse, labels=batch.labels)


class HistoryLoader:
    """A loader whose batches gain histories (:func:`with_history`); as long as ``loader``."""

    def __init__(self, loader: Any, spec: HistorySpec) -> None:
        self.loader, self.spec = loader, spec

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield with_history(batch, self.spec)

    def __len__(self) -> int:
        return len(self.loader)
