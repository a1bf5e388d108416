"""A host cache smaller than one batch's rows (issue 42: any cache size at either level,
exact). A batch planned at its own use (``overflow``) with nothing else in flight or pinned
in the host cache moves its rows through the host cache a chunk at a time - its fills read,
its write-backs written, its overflow rows read at lookup and written at the update - each
chunk queued behind every earlier disk move. Bit-identical to the same table in DRAM; a
plan that may not overflow is still refused in one line."""

from __future__ import annotations

import contextlib

import pytest
import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.store import CacheCapacityError, OptimizerConfig, OptimType, TieredTable, disk_record_bytes

from .cuda_stream_standin import cpu_streams
from .disk_training import every_row, same_rows, skewed_batches, train, trained_in_dram

ROWS, DIM = 4000, 16
BATCH_IDS = 72


def _batches():
    return skewed_batches(ROWS, DIM, steps=10, bags=24, per_bag=3)


@pytest.mark.parametrize("optim, host_rows, slots, depth, disk_depth, cuda", [
    (OptimType.EXACT_ROWWISE_ADAGRAD, 10, 20, 2, None, False),   # both caches below a batch: overflow at both
    (OptimType.ADAM, 40, 200, 1, 3, False),                       # host cache below a batch, stages waiting
    (OptimType.EXACT_ROWWISE_ADAGRAD, 10, 60, 1, None, True),     # through the CUDA transport's worker path
])
def test_a_host_cache_below_a_batch_trains_as_in_dram(tmp_path, monkeypatch, optim, host_rows, slots, depth,
                                                      disk_depth, cuda):
    torch.manual_seed(0)
    init = torch.randn(ROWS, DIM)
    config = OptimizerConfig(optim, learning_rate=0.05)
    want = every_row(trained_in_dram(init, config, slots, _batches(), depth))
    with cpu_streams(monkeypatch) if cuda else contextlib.nullcontext():
        if cuda:
            from torchrec_proactive.fetch.cuda import CudaStreamTransport
            engine = FetchEngine(CudaStreamTransport(torch.device("cpu")))
        else:
            engine = FetchEngine()
        table = TieredTable.on_disk("t", ROWS, DIM, config, num_slots=slots, directory=tmp_path,
                                    host_cache_bytes=host_rows * disk_record_bytes(DIM, config), initial_weight=init)
        try:
            assert table.disk.num_slots == host_rows < BATCH_IDS
            train(table, _batches(), depth, disk_depth, engine=engine)
            got = every_row(table)
            overflowed = table.stats.host_overflow_plans
            table.disk.check_invariants(expect_drained=True)
        finally:
            engine.close()
            table.close()
    assert same_rows(got, want), (optim, host_rows, slots, depth)
    assert overflowed > 0


def test_a_plan_that_may_not_overflow_is_refused_by_a_small_host_cache(tmp_path):
    config = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
    table = TieredTable.on_disk("t", ROWS, DIM, config, num_slots=200, directory=tmp_path,
                                host_cache_bytes=10 * disk_record_bytes(DIM, config))
    try:
        ids = torch.arange(0, 2 * BATCH_IDS, 2)
        before = table.stats.as_dict()
        with pytest.raises(CacheCapacityError, match=r"table 't': a batch needs 72 more rows in the host cache of "
                                                     r"10 rows.*give the host cache at least"):
            table.plan_ids(ids)
        assert table.in_flight == 0 and table.stats.host_overflow_plans == 0
        # A refused plan counts nothing (a user trial: a batch deferred and planned again was
        # counted at every try, so table_stats() no longer added up to the pipeline's stats).
        assert table.stats.as_dict() == before
        # Beside a plan in flight, even one that may overflow is refused (its rows could be
        # read before that plan's write-backs), changing nothing.
        first = table.plan_ids(torch.arange(5), overflow=True)
        with pytest.raises(CacheCapacityError):
            table.plan_ids(ids, overflow=True)
        assert table.in_flight == 1
        table.rollback(first)
        table.release(first)
        plan = table.plan_ids(ids, overflow=True)  # alone: through the host cache in chunks
        assert table.stats.host_overflow_plans == 1
        table.rollback(plan)
        table.release(plan)
        assert table.in_flight == 0
        table.check_invariants(expect_drained=True)
    finally:
        table.close()



def test_the_advice_is_per_table_the_setting_s_unit():
    """The store sizes one host cache per TorchRec group; the sharder's host_cache_bytes is
    per table, summed per group: the advice divides (a user trial set the group's figure on
    every table, three times what was needed)."""
    from torchrec_proactive.integration.disk_tier import host_cache_advice

    refusal = "table 'a+b+c': a batch needs 166 more rows in the host cache of 42 rows ...; give the host cache " \
              "at least 166 rows (11952 bytes)"
    assert host_cache_advice(refusal).endswith(
        "to at least 3984 bytes for each of its 3 tables (a group's host cache is its tables' shares summed; "
        "leave headroom: batches vary)")
    alone = refusal.replace("'a+b+c'", "'a'")
    assert host_cache_advice(alone).endswith("to at least 11952 bytes (leave headroom: batches vary)")
    assert host_cache_advice("no size here") == "raise host_cache_bytes (or KeyValueParams.l2_cache_size)"
