"""Nothing lost when a flush fails part-way (issue 42, found with the disk tier): a flush runs
in chunks (a table on disk: chunks its host cache can hold), and the chunks after a failed one
must keep their rows dirty, so that the next flush writes them."""

from __future__ import annotations

import pytest
import torch

from torchrec_proactive.fetch import FetchEngine, FetchFailedError
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable, pooled_lookup

ROWS, DIM = 200, 4
OPT = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)


def _trained(tmp_path, name):
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    # a host cache of 48 rows (24-byte records): flushes run in chunks of 24 rows
    table = TieredTable.on_disk(name, ROWS, DIM, OPT, num_slots=60, directory=tmp_path, host_cache_bytes=48 * 24,
                                initial_weight=init)
    engine, anchor = FetchEngine(), torch.empty(0, requires_grad=True)
    rows = torch.arange(0, 100, 2)[:40]  # 40 rows, all cached and dirty after the step
    batch = (rows, torch.arange(rows.numel() + 1), None, torch.ones(rows.numel(), DIM))
    run_lookahead(table, engine, [batch], 0, lambda i, tb, b: pooled_lookup(tb, anchor).backward(b[3]))
    return table, engine


def test_a_failed_flush_chunk_leaves_the_later_chunks_dirty(tmp_path):
    want_table, want_engine = _trained(tmp_path, "want")
    want_engine.flush([want_table])
    want = want_table.read_host_rows(0, ROWS)

    table, engine = _trained(tmp_path, "got")
    put = table.put_host
    calls = {"n": 0}

    def failing_once(rows, parts):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device (injected)")
        return put(rows, parts)

    table.put_host = failing_once
    with pytest.raises(FetchFailedError):
        engine.flush([table])
    assert table.has_dirty()  # the chunk that failed, and every chunk after it, still to write
    engine.flush([table])  # the fault cleared: the next flush writes everything
    got = table.read_host_rows(0, ROWS)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    table.close()
    want_table.close()
