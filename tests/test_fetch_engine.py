"""The fetch engine: ticket order, the emulated link's timing, errors, and the CUDA path."""

from __future__ import annotations

import threading

import pytest
import torch

from torchrec_proactive.fetch import EmulatedLinkTransport, FetchEngine, InlineTransport, LinkModel, make_transport
from torchrec_proactive.store import OptimizerConfig, StoreStateError, TieredTable


def _table(rows=1000, dim=16, slots=500, device="cpu"):
    return TieredTable("t", torch.randn(rows, dim), OptimizerConfig(), num_slots=slots, device=device)


class _GatedLink(EmulatedLinkTransport):
    """The emulated link, held shut until the test opens it: whether ``issue`` returned
    before the copy ran is then a fact of the order of events, not of a stopwatch."""

    def __init__(self, link: LinkModel) -> None:
        super().__init__(link)
        self.gate = threading.Event()

    def run(self, ticket):
        self.gate.wait(timeout=60)
        super().run(ticket)


def test_emulated_link_completes_no_earlier_than_its_model():
    link = LinkModel(bandwidth_gbps=0.01, latency_us=2000)  # 10 MB/s
    transport = _GatedLink(link)
    engine = FetchEngine(transport)
    table = _table()
    try:
        plan = table.plan(torch.arange(200))  # 200 rows x 64 B = 12.8 kB -> 1.28 ms + 2 ms
        ticket = engine.issue([plan])
        assert not ticket.done, "issue must not block on the copy"
        transport.gate.set()
        stall = engine.wait(ticket)
        # A lower bound the transport enforces by construction (it sleeps until then).
        assert ticket.completed_at - ticket.started_at >= link.seconds(ticket.num_bytes) * 0.999
        assert engine.stats.stall_s == stall
        assert torch.equal(table.cache_weight[plan.slots], table.host_weight[plan.rows])
    finally:
        transport.gate.set()
        engine.close()


def test_tickets_complete_in_issue_order_on_one_link():
    engine = FetchEngine(EmulatedLinkTransport(LinkModel(bandwidth_gbps=0.02, latency_us=500)))
    table = _table()
    try:
        tickets = [engine.issue([table.plan(torch.arange(i * 100, i * 100 + 100))]) for i in range(4)]
        engine.drain()
        done = [t.completed_at for t in tickets]
        starts = [t.started_at for t in tickets]
        assert done == sorted(done)
        assert all(s >= d for s, d in zip(starts[1:], done[:-1])), "one transfer at a time"
        assert engine.in_flight == 0
        assert engine.stats.tickets == 4 and engine.stats.rows_fetched == 400
    finally:
        engine.close()


def test_empty_ticket_pays_no_latency():
    engine = FetchEngine(EmulatedLinkTransport(LinkModel(bandwidth_gbps=1.0, latency_us=50_000)))
    table = _table(slots=1000)  # full cache: every row moves in with the first plan ...
    try:
        first = table.plan(torch.arange(3))
        FetchEngine().run([first])
        table.release(first)
        ticket = engine.issue([table.plan(torch.arange(10))])  # ... so a later one moves nothing
        assert ticket.num_bytes == 0
        assert engine.wait(ticket) < 0.04
    finally:
        engine.close()


def test_transport_errors_surface_on_wait():
    class Broken(InlineTransport):
        def run(self, ticket):
            raise RuntimeError("link down")

    engine = FetchEngine(Broken())
    ticket = engine.issue([_table().plan(torch.arange(3))])
    with pytest.raises(RuntimeError, match="link down"):
        engine.wait(ticket)


def test_closed_engine_refuses_work_and_bad_link_is_refused():
    engine = FetchEngine(EmulatedLinkTransport(LinkModel()))
    engine.close()
    with pytest.raises(StoreStateError):
        engine.issue([])
    with pytest.raises(ValueError, match="bandwidth"):
        LinkModel(bandwidth_gbps=0)
    assert make_transport("cpu").kind == "inline"
    assert make_transport("cpu", LinkModel()).kind == "emulated"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stream_transport_matches_cpu():
    from torchrec_proactive.store import OptimType, plan_table_batch, pooled_lookup

    cfg = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
    host = torch.randn(5000, 32).pin_memory()
    gpu = TieredTable("g", host.clone().pin_memory(), cfg, num_slots=600, device="cuda")
    cpu = TieredTable("c", host.clone(), cfg, num_slots=600)
    eg, ec = FetchEngine(make_transport("cuda")), FetchEngine()
    anchor_g = torch.empty(0, device="cuda", requires_grad=True)
    anchor_c = torch.empty(0, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(20):
            values = torch.randint(0, 5000, (256,), generator=g)
            offsets = torch.arange(0, 257, 4)
            grad = torch.randn(64, 32, generator=g)
            outs = []
            for table, engine, anchor, dev in ((gpu, eg, anchor_g, "cuda"), (cpu, ec, anchor_c, "cpu")):
                tb = plan_table_batch(table, values, offsets)
                engine.wait(engine.issue([tb.plan]))
                out = pooled_lookup(tb, anchor)
                out.backward(grad.to(dev))
                outs.append(out.detach().cpu())
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        eg.drain()
        FetchEngine().flush([gpu])
        FetchEngine().flush([cpu])
        torch.cuda.synchronize()
        torch.testing.assert_close(gpu.host_weight, cpu.host_weight, rtol=1e-5, atol=1e-5)
    finally:
        eg.close()


def test_cuda_staging_alternates_two_sides_that_never_overlap(monkeypatch):
    """Chunk k+1 is gathered into one side while chunk k's copy reads the other: the two
    sides are distinct memory, each reused (not reallocated) chunk after chunk."""
    from torchrec_proactive.fetch import cuda as cuda_transport

    monkeypatch.setattr(cuda_transport, "_pinned", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    staging = cuda_transport._PinnedStaging()
    seen = {0: set(), 1: set()}
    for chunk in range(8):
        side = chunk % 2
        staging.begin(side)
        a = staging.get(100, 8, torch.float32)
        b = staging.get(50, 8, torch.float32)  # a second tensor of the same chunk: no overlap
        assert b.data_ptr() >= a.data_ptr() + a.numel() * 4
        seen[side].add(a.data_ptr())
    assert len(seen[0]) == len(seen[1]) == 1 and seen[0] != seen[1]
    assert staging.allocations == 2


def test_the_engine_counts_waits_that_block_their_caller():
    """``blocking_waits``: a count, not a clock. A ticket already done costs no wait; one whose
    moves are still held up (here: until its waiter arrives) does."""
    import threading

    from torchrec_proactive.fetch.engine import Transport
    from torchrec_proactive.store import TieredTable, OptimizerConfig

    class Gated(Transport):
        kind, asynchronous = "gated", True

        def __init__(self):
            self.gate = threading.Event()

        def run(self, ticket):
            self.gate.wait()
            for plan in ticket.plans:
                plan.table.transfer(plan)

        def begin_wait(self, ticket):
            self.gate.set()  # the moves may finish only once the caller is about to block

    table = TieredTable("t", torch.randn(100, 4), OptimizerConfig(), num_slots=50)
    inline, gated = FetchEngine(), FetchEngine(Gated())
    for engine, expected, rows in ((inline, 0, torch.arange(5, 15)), (gated, 1, torch.arange(20, 30))):
        plan = table.plan(rows)
        engine.wait(engine.issue([plan]))
        table.release(plan)
        assert engine.stats.blocking_waits == expected
        engine.close()
