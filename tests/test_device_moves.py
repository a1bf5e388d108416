"""A device plan's moves are enqueued by whoever issues it, with no host read (issue 30,
item 7): the row-move op, its Triton kernel (run by Triton's interpreter on the CPU), the
device table's moves on fake CUDA tensors, and the engine running such tickets on issue."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from torchrec_proactive.fetch.engine import FetchEngine, Ticket, Transport
from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable
from torchrec_proactive.store.cost_counter import CostCounter
from torchrec_proactive.store.row_moves import move_rows_
from torchrec_proactive.store.sync_detector import HostSyncError, fake_cuda


def device_table(*args, **kwargs) -> TieredTable:
    """A table planned on its device (``TieredTable(planner="device")``)."""
    return TieredTable(*args, planner="device", **kwargs)


def test_move_rows_moves_only_the_entries_whose_guard_is_below_the_bound():
    src = torch.randn(50, 5)
    dst = torch.zeros(9, 5)
    src_index = torch.tensor([3, 7, 50, 57, 9])  # 50 and 57: padding (sentinel rows)
    dst_index = torch.tensor([0, 4, 8, 0, 6], dtype=torch.int32)  # (padding may repeat a target)
    move_rows_(dst, dst_index, src, src_index, src_index, 50)
    expected = torch.zeros(9, 5)
    expected[[0, 4, 6]] = src[[3, 7, 9]]
    assert torch.equal(dst, expected)
    state = torch.zeros(9)
    move_rows_(state.view(9, 1), dst_index, torch.arange(50.0).view(50, 1), src_index, src_index, 50)
    assert state.tolist() == [3.0, 0, 0, 0, 7.0, 0, 9.0, 0, 0]


def test_the_triton_kernel_equals_the_reference():
    """On a capped grid too: with fewer blocks than tiles each block strides over several
    (the grid-stride loop), and a tile past the end is masked."""
    script = textwrap.dedent("""
        import torch
        from torchrec_proactive.store.row_moves import move_rows_, triton_move_rows
        g = torch.Generator().manual_seed(0)
        for width, dtype, n, blocks in [(1, torch.float32, 48, None), (5, torch.float32, 70, 2),
                                        (40, torch.float16, 48, 1), (300, torch.float32, 33, 3)]:
            src = torch.randn(64, width, generator=g).to(dtype)
            src_index = torch.randint(0, 80, (n,), generator=g)  # >= 64: padding
            dst_index = torch.randperm(200, generator=g)[:n].to(torch.int32)
            want, got = torch.zeros(200, width, dtype=dtype), torch.zeros(200, width, dtype=dtype)
            move_rows_(want, dst_index, src, src_index, src_index, 64)
            grid = triton_move_rows(got, dst_index, src, src_index, src_index, 64, max_blocks=blocks)
            assert grid == min(-(-n // 16), blocks or 16), (n, blocks, grid)
            assert torch.equal(want, got), width
        print("equal")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("equal"), out.stderr[-2000:]


def test_a_moves_grid_is_capped_whatever_its_length():
    """One block per 16-entry tile, at most an eighth of the SMs (at least 8): a 2M-entry
    move on an H100 (132 SMs) launches 16 blocks, not a block per entry (FBGEMM caps its
    prefetch grids alike), leaving the SMs to the compute stream."""
    from torchrec_proactive.store.row_moves import MOVE_STATS, TILE, max_move_blocks, move_grid, reset_move_stats

    assert max_move_blocks() == 16 and TILE == 16
    assert [move_grid(n) for n in (1, 16, 17, 256, 2_097_152)] == [1, 1, 2, 16, 16]
    assert move_grid(2_097_152, max_blocks=8) == 8
    reset_move_stats()
    with fake_cuda() as guard:
        with guard.setup():
            table = _table("cuda", 3_000_000, rows=4_000_000)
            table.host_on_device = [torch.empty(t.shape, dtype=t.dtype, device="cuda")
                                    for t in [table.host_weight, *table.host_state.values()]]
        table.enqueue_moves(table.plan_ids(torch.empty(2_000_000, dtype=torch.int64, device="cuda")))
    assert MOVE_STATS["moves"] == 4 and MOVE_STATS["grid_blocks_max"] == 16


def _table(device: str, slots: int, rows: int = 1000, dim: int = 8) -> TieredTable:
    return device_table("t", torch.zeros(rows, dim), OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD),
                             num_slots=slots, device=torch.device(device))


def test_a_plans_moves_read_nothing_on_the_host_and_cost_the_same_at_any_cache_size():
    """On fake CUDA: enqueuing the moves passes the sync detector, where the path every
    device plan took before (the fetch worker reading the plan's sizes) does not; and it is
    one op per tensor and direction, at any cache size."""
    costs = []
    for slots in (100_000, 1_000_000):
        with fake_cuda() as guard:
            with guard.setup():
                table = _table("cuda", slots, rows=2_000_000)
                table.host_on_device = [torch.empty(t.shape, dtype=t.dtype, device="cuda")
                                        for t in [table.host_weight, *table.host_state.values()]]
            plan = table.plan_ids(torch.empty(4096, dtype=torch.int64, device="cuda"))
            counter = CostCounter()
            with counter, counter.phase("moves"):
                table.enqueue_moves(plan)
            costs.append(counter.phases["moves"])
            with pytest.raises(HostSyncError):
                plan.resolve_sizes()
    assert plan.sizes is None and plan.stage == "done"
    small, large = costs
    assert small.launches == 4  # weight and momentum, written back then filled
    assert (small.names, small.bytes) == (large.names, large.bytes)


def test_moved_plans_equal_plans_moved_with_their_sizes_and_their_sizes_come_later():
    """The same batches moved by ``enqueue_moves`` and by the sized path (write-backs and
    fills narrowed to their counts) leave the same cache and host tier."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 300, (48,), generator=g) for _ in range(12)]
    results = []
    for sized in (False, True):
        table = _table("cpu", slots=100, rows=300)
        table.host_weight.copy_(torch.randn(300, 8, generator=torch.Generator().manual_seed(2)))
        for ids in batches:
            plan = table.plan_ids(ids)
            if sized:
                n_fill, n_wb = int(plan.counts[1]), int(plan.counts[2])
                table.write_back(plan.writeback_slots[:n_wb], plan.writeback_rows[:n_wb])
                table.fill(plan.fill_slots[:n_fill], table.gather_host(plan.fill_rows[:n_fill]))
                plan.stage = "done"
            else:
                table.transfer(plan)
                assert plan.sizes is None  # not read to move the rows
                assert plan.poll_sizes() and plan.sizes == tuple(plan.counts.tolist())
            table.apply_gradients(plan, torch.ones(plan.n, 8))
        results.append([table.host_weight.clone(), table.host_state["momentum1"].clone(), table.cache_weight.clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


class _Plan:
    """A plan whose sizes reach the host when the test says so."""

    def __init__(self, table, rows):
        self.table, self._rows, self.landed, self.sizes = table, rows, False, None

    def poll_sizes(self):
        if self.landed:
            self.sizes = self._rows
        return self.sizes is not None

    def resolve_sizes(self):
        self.landed = True
        self.poll_sizes()

    @property
    def num_fills(self):
        return self.sizes

    @property
    def bytes_to_move(self):
        return 4 * self.sizes


class _Table:
    def rollback(self, plan):
        pass


class _OnIssue(Transport):
    """Tickets tagged "device" only enqueue (run on issue); the others run on the worker,
    held until the test opens the gate."""

    asynchronous = True

    def __init__(self):
        self.gate = threading.Event()
        self.ran = []
        self.settled = []

    def runs_on_issue(self, ticket: Ticket) -> bool:
        return ticket.tag == "device"

    def run(self, ticket: Ticket) -> None:
        if ticket.tag != "device":
            self.gate.wait(30)
        self.ran.append((ticket.seq, threading.current_thread().name))

    def settle(self, ticket: Ticket) -> None:
        self.settled.append(ticket.seq)


def test_a_ticket_that_only_enqueues_runs_on_issue_and_never_makes_its_waiter_block():
    transport = _OnIssue()
    engine = FetchEngine(transport)
    main = threading.current_thread().name
    plans = [_Plan(_Table(), 3) for _ in range(3)]
    tickets = [engine.issue([p], tag="device") for p in plans]
    assert [name for _, name in transport.ran] == [main] * 3  # run by the issuing thread
    for t in tickets:
        engine.wait(t)
    assert engine.stats.blocking_waits == 0
    assert engine.stats.rows_fetched == 0  # the sizes have not landed yet
    plans[1].landed = True
    engine.wait(tickets[2])
    assert engine.stats.rows_fetched == 0  # counted in issue order: ticket 0 is still unsized
    plans[0].landed = True
    engine.wait(tickets[2])
    assert engine.stats.rows_fetched == 6
    engine.drain()  # reads the rest, and makes the host tier current first
    assert engine.stats.rows_fetched == 9 and transport.settled == [2]
    engine.close()


def test_a_device_ticket_behind_a_busy_worker_waits_its_turn_there():
    transport = _OnIssue()
    engine = FetchEngine(transport)
    host = engine.issue([_Plan(_Table(), 1)], tag="host")
    behind = engine.issue([_Plan(_Table(), 1)], tag="device")
    assert transport.ran == []  # not started before the ticket issued first
    transport.gate.set()
    engine.wait(behind)
    assert [seq for seq, _ in transport.ran] == [host.seq, behind.seq]
    assert transport.ran[1][1] == "proactive-fetch"
    engine.close()


def test_host_views_on_the_device_are_checked_by_device_type_and_shape():
    """A table built for ``cuda`` takes views on ``cuda:0`` (what every CUDA tensor reports),
    and refuses views of the wrong shape or on another kind of device."""
    with fake_cuda() as guard:
        with guard.setup():
            host = torch.zeros(100, 8)
            on_device = [torch.empty(100, 8, device="cuda:0"), torch.empty(100, device="cuda:0")]
            table = device_table("t", host, OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD), num_slots=10,
                                      device=torch.device("cuda"), host_on_device=on_device)
            assert table.host_on_device == on_device
            with pytest.raises(Exception, match="host_on_device must be"):
                device_table("t", torch.zeros(100, 8), OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD),
                                  num_slots=10, device=torch.device("cuda"),
                                  host_on_device=[torch.empty(100, 8), torch.empty(100)])
