"""Cache planning: miss-ratio curves, the profile, TorchRec's planner with proactive costs."""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Sequence

import numpy as np
import pytest

from torchrec_proactive.bench.cache_replay import replay_table
from torchrec_proactive.cacheplan.curve import MissRatioCurve, pinned_rows, reuse_distances, shard_steps


def _lru_hits(steps: Sequence[np.ndarray], num_slots: int, warmup: int = 0) -> int:
    """Brute force: a batch-granular LRU cache of ``num_slots`` rows; a batch's distinct rows
    (in id order) are looked up, then become the most recent; victims are the least recent
    rows of other batches."""
    cache: "OrderedDict[int, None]" = OrderedDict()
    hits = 0
    for t, ids in enumerate(steps):
        rows = [int(r) for r in np.unique(ids)]
        assert len(rows) <= num_slots
        if t >= warmup:
            hits += sum(r in cache for r in rows)
        for r in rows:
            cache.pop(r, None)
            cache[r] = None
        while len(cache) > num_slots:
            cache.popitem(last=False)
    return hits


def _trace(seed: int, num_rows: int, batch: int, num_batches: int, alpha: float) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_rows + 1) ** alpha
    p /= p.sum()
    perm = rng.permutation(num_rows)
    return [perm[rng.choice(num_rows, size=batch, p=p)] for _ in range(num_batches)]


@pytest.mark.parametrize("seed", [0, 1])
def test_curve_equals_brute_force_lru_at_every_size(seed: int) -> None:
    steps = _trace(seed, num_rows=300, batch=24, num_batches=60, alpha=0.9)
    curve = MissRatioCurve.from_steps(steps, num_rows=300, depth=0, warmup=5)
    assert curve.accesses == sum(np.unique(s).size for s in steps[5:])
    checked = 0
    for slots in range(curve.pinned_rows, 301, 7):
        lru = _lru_hits(steps, slots, warmup=5)
        assert curve.hit_rows(slots) == lru, slots
        assert curve.expected_miss_rate(slots / 300) == pytest.approx(1 - lru / curve.accesses)
        checked += 1
    assert checked > 30
    assert curve.expected_miss_rate(0.0) == 1.0 and curve.expected_miss_rate(1.0) == 0.0
    rates = [curve.expected_miss_rate(x) for x in np.linspace(0, 1, 50)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # monotone
    assert 0.0 < curve.cacheability < 1.0


def test_reuse_distance_small_example() -> None:
    # batch 0: {1,2}; batch 1: {3}; batch 2: {1}: after 1 (position 1), rows 2 and 3 were planned
    d = reuse_distances([np.array([2, 1, 1]), np.array([3]), np.array([1, 3])])
    assert [x.tolist() for x in d] == [[-1, -1], [-1], [2, 0]]


def test_depth_pins_k_plus_one_batches() -> None:
    steps = [np.array([0, 1]), np.array([2, 3]), np.array([0, 4]), np.array([5, 6, 7])]
    assert pinned_rows(steps, 0) == 3
    assert pinned_rows(steps, 1) == 5  # {0,4} + {5,6,7}
    assert pinned_rows(steps, 2) == 7  # {2,3} + {0,4} + {5,6,7}
    curve = MissRatioCurve.from_steps(steps, num_rows=10, depth=1)
    assert curve.pinned_rows == 5 and curve.min_load_factor == 0.5
    # below the pinned rows no batch is planned ahead: nothing counts as a hit
    assert curve.expected_miss_rate(0.4) == 1.0


def test_curve_matches_the_real_store_replay() -> None:
    """The store's eviction is sampled LRU: its hit count is close to the curve's."""
    steps = _trace(3, num_rows=2000, batch=64, num_batches=80, alpha=1.0)
    for depth in (0, 2):
        curve = MissRatioCurve.from_steps(steps, num_rows=2000, depth=depth, warmup=10)
        for fraction in (0.2, 0.5):
            got = replay_table(steps, 2000, fraction, depth, warmup=10)
            predicted = curve.hit_rows(int(fraction * 2000))
            assert got["unique_rows"] == curve.accesses
            assert abs(got["hits"] - predicted) <= 0.05 * curve.accesses, (depth, fraction)


def test_json_round_trip_and_shards() -> None:
    steps = _trace(4, num_rows=100, batch=10, num_batches=20, alpha=1.1)
    curve = MissRatioCurve.from_steps(steps, num_rows=100, depth=1)
    again = MissRatioCurve.from_dict(curve.to_dict())
    assert again == curve
    lo = MissRatioCurve.from_steps(shard_steps(steps, 0, 50), 50)
    hi = MissRatioCurve.from_steps(shard_steps(steps, 50, 100), 50)
    assert lo.accesses + hi.accesses == MissRatioCurve.from_steps(steps, 100).accesses
    with pytest.raises(ValueError, match="num_rows"):
        MissRatioCurve.from_steps(steps, num_rows=10)
