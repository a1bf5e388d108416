"""The host cache over the disk tier's file (store/disk_host_tier.py): any sequence of
batches - prefetched ahead, read, written, released, with a cache far smaller than the
table - leaves the file and the cache exactly as a table held wholly in memory; a row
evicted dirty reaches its file (read-modify-write of its page, with its page's other rows
intact) before any later read; pins bound what may be evicted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchrec_proactive.store import CacheCapacityError
from torchrec_proactive.store.disk_host_tier import Component, DiskHostTier, record_layout
from torchrec_proactive.store.row_file import DiskTierError, RowFile

from .io_faults import inject, io_backend  # noqa: F401 (a fixture)

COMPONENTS = [Component("weight", torch.float32, 12), Component("momentum1", torch.float32, 1)]


def _tier(tmp_path, rows=7000, row_slots=300, **kw) -> DiskHostTier:
    _, record = record_layout(COMPONENTS)
    f = RowFile(tmp_path / "t.rows", num_rows=rows, row_bytes=record, table="t", io_threads=4, **kw)
    return DiskHostTier(f, COMPONENTS, num_row_slots=row_slots)


def test_record_layout_aligns_components():
    offsets, size = record_layout([Component("w", torch.float16, 3), Component("s", torch.float32, 1)])
    assert offsets == [0, 8] and size == 16


def test_batches_through_a_small_host_cache_equal_a_table_in_memory(tmp_path):
    tier = _tier(tmp_path)
    assert (tier.rows_per_page, tier.file.num_pages) == (73, 96)  # 52-byte records padded to 56
    ref_w = torch.zeros(7000, 12)
    ref_s = torch.zeros(7000)
    g = torch.Generator().manual_seed(0)
    depth, in_flight = 2, []
    for step in range(60):
        rows = torch.unique(torch.randint(0, 7000, (60,), generator=g) % (7000 if step % 2 else 700))
        in_flight.append((rows, tier.prefetch(rows.numpy())))  # issued `depth` batches ahead
        if len(in_flight) <= depth:
            continue
        rows, ticket = in_flight.pop(0)
        tier.wait(ticket)
        w, s = tier.gather(rows)
        assert torch.equal(w, ref_w[rows]) and torch.equal(s.view(-1), ref_s[rows])
        new_w, new_s = w + torch.randn(w.shape, generator=g), s.view(-1) + 1.0
        tier.scatter(rows, [new_w, new_s])
        ref_w[rows], ref_s[rows] = new_w, new_s
        tier.release(ticket)
        tier.check_invariants()
    for rows, ticket in in_flight:
        tier.wait(ticket)
        tier.release(ticket)
    tier.check_invariants(expect_drained=True)
    st = tier.stats()
    assert st["row_misses"] > tier.num_slots and st["rows_written"] > 0  # it really evicted dirty rows
    assert st["pages_written"] < st["rows_written"] or st["rows_written"] < 5  # victims of a page share a write
    tier.flush()
    tier.close(remove=False)
    # The file alone holds the table now: read it back through a fresh cache.
    tier = _tier(tmp_path)
    for first in range(0, 7000, 250):
        rows = torch.arange(first, min(first + 250, 7000))
        t = tier.prefetch(rows.numpy())
        tier.wait(t)
        w, s = tier.gather(rows)
        assert torch.equal(w, ref_w[rows]) and torch.equal(s.view(-1), ref_s[rows])
        tier.release(t)
    tier.close()


def test_pins_bound_eviction_and_a_refusal_changes_nothing(tmp_path):
    tier = _tier(tmp_path, row_slots=3)
    a = tier.prefetch(np.array([0, 1, 500]))  # three rows, all pinned
    before = (tier.row_slot.copy(), tier.pins.copy())
    with pytest.raises(CacheCapacityError, match=r"table 't': a batch needs 1 more rows .* of 3 rows.*at least 4 rows"):
        tier.prefetch(np.array([7]))
    assert np.array_equal(before[0], tier.row_slot) and np.array_equal(before[1], tier.pins)
    tier.wait(a)
    tier.release(a)
    b = tier.prefetch(np.array([7]))
    tier.wait(b)
    tier.release(b)
    tier.check_invariants(expect_drained=True)
    tier.close()


def test_a_failed_read_is_reported_and_leaves_no_row_to_read(tmp_path, monkeypatch, io_backend):
    tier = _tier(tmp_path)
    assert tier.file.io_backend == io_backend
    inject(monkeypatch, io_backend, read=lambda offset, got: 7)
    t = tier.prefetch(np.array([5]))
    with pytest.raises(DiskTierError, match="short read"):
        tier.wait(t)
    with pytest.raises(Exception, match="row 5 is not in the host cache"):
        tier.gather(torch.tensor([5]))
    tier.release(t)
    tier.check_invariants(expect_drained=True)
    tier.close()


def test_victims_are_found_in_time_proportional_to_the_rows_asked_for(tmp_path):
    """The host cache's victim search (CLOCK) passes a few slots per victim however large the
    cache: a host cache of 20k rows under a skewed stream of batches scans a small multiple
    of the rows it evicts, not the cache per batch (a scan per batch would be 20k slots)."""
    from torchrec_proactive.store.disk_host_tier import Component, DiskHostTier
    from torchrec_proactive.store.row_file import RowFile

    rows = 100_000
    comps = [Component("weight", torch.float32, 4)]
    file = RowFile(tmp_path / "t.rows", rows, 16, table="t")
    tier = DiskHostTier(file, comps, num_row_slots=20_000)
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(60):
            batch = (torch.rand(500, generator=g) ** 3 * rows).long().numpy()
            ticket = tier.prefetch(batch)
            tier.wait(ticket)
            tier.release(ticket)
        s = tier.stats()
        assert s["victims_chosen"] > 20_000  # the cache filled and then evicted
        assert s["victim_slots_scanned"] <= 4 * s["victims_chosen"], s
    finally:
        tier.close()
