"""Checkpoints of tables ON DISK through their live views (``disk_views.py``; issue 42 item 5):
TorchRec's ``ShardedTensor`` state dict (built by TorchRec's own ``get_state_dict``) over disk
views is created without a read, read and loaded into; ``torch.distributed.checkpoint`` saves
and loads it bit-exactly, into another sharding and other cache sizes, and never holds a whole
table: the views' counters show every read, write and block in DRAM bounded by the chunk.
A 1-rank gloo process group; the owners flush through a real fetch engine."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torchrec.distributed.embedding_kernel import get_state_dict
from torchrec.distributed.embedding_types import ShardedEmbeddingTable

from torchrec_proactive.checkpoint import SafeFileSystemReader
from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.integration.disk_views import (DiskRowsView, StreamingSavePlanner, disk_view,
                                                       disk_view_io)
from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable, pooled_lookup

ROWS, DIM, CHUNK = 600, 4, 32
OPT = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
RECORD = 24  # bytes of one row on disk
PLACE = "rank:0/cpu"


class EngineOwner:
    """The kernel's part a view needs: the device cache written back through the fetch engine."""

    def __init__(self, table: TieredTable, engine: FetchEngine | None = None) -> None:
        self.engine, self.table = engine or FetchEngine(), table
        self.flushes = self.writes = 0

    def before_host_access(self) -> None:
        self.engine.flush([self.table])
        self.flushes += 1

    def after_host_write(self) -> None:
        self.writes += 1


@pytest.fixture(scope="module")
def pg(tmp_path_factory):
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _disk(tmp_path, name: str, rows: int, host_rows: int, init: torch.Tensor | None = None) -> TieredTable:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return TieredTable.on_disk(name, rows, DIM, OPT, num_slots=40, directory=tmp_path,
                               host_cache_bytes=host_rows * RECORD, initial_weight=init)


def _init() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))


def _train(table: TieredTable, owner: EngineOwner, seed: int = 1) -> None:
    """Training steps whose updates stay dirty in the device cache."""
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(0, table.num_rows, (36,), generator=g), torch.arange(0, 37, 3), None,
                torch.randn(12, DIM, generator=g)) for _ in range(6)]
    anchor = torch.empty(0, requires_grad=True)
    run_lookahead(table, owner.engine, batches, 1, lambda i, tb, b: pooled_lookup(tb, anchor).backward(b[3]))
    assert table.has_dirty()


def _trained(tmp_path, name: str = "t", host_rows: int = 80):
    """A trained disk table, its owner, and what it holds (the same run in DRAM)."""
    table = _disk(tmp_path, name, ROWS, host_rows, _init())
    owner = EngineOwner(table)
    _train(table, owner)
    ref = TieredTable(name, _init(), OPT, num_slots=40)
    ref_owner = EngineOwner(ref)
    _train(ref, ref_owner)
    ref_owner.before_host_access()
    return table, owner, ref.host_weight.clone(), ref.host_state["momentum1"].clone()


def _torchrec_state_dict(parts, pg, prefix: str = "ebc."):
    """What ``BaseBatchedEmbeddingBag.state_dict`` builds for table ``t`` whose row shards
    ``parts`` = [(owner, store, store_start, global_offset, rows)] are on this rank: the weight
    through TorchRec's ``get_state_dict``, and the row-wise state as TorchRec's fused
    optimizer shards it (1-D, ``[offset]``/``[rows]``)."""
    shards = [ShardMetadata([off, 0], [n, DIM], PLACE) for _, _, _, off, n in parts]
    glob = ShardedTensorMetadata(shards, torch.Size([ROWS, DIM]), TensorProperties(dtype=torch.float32))
    tables = [ShardedEmbeddingTable(num_embeddings=ROWS, embedding_dim=DIM, name="t", local_rows=n, local_cols=DIM,
                                    local_metadata=md, global_metadata=glob)
              for md, (_, _, _, _, n) in zip(shards, parts)]
    weights = [disk_view(o, s, 0, start, n, chunk_rows=CHUNK) for o, s, start, _, n in parts]
    sd = get_state_dict(tables, weights, pg, prefix=prefix)
    states = [Shard(disk_view(o, s, 1, start, n, chunk_rows=CHUNK), ShardMetadata([off], [n], PLACE))
              for o, s, start, off, n in parts]
    sd[f"{prefix}t.momentum1"] = ShardedTensor._init_from_local_shards_and_global_metadata(
        states, ShardedTensorMetadata([sh.metadata for sh in states], torch.Size([ROWS]),
                                      TensorProperties(dtype=torch.float32)), process_group=pg)
    return sd


def _reset(*stores):
    for s in stores:
        disk_view_io(s).reset()


def test_a_sharded_tensor_of_disk_views_is_read_and_loaded(tmp_path, pg):
    table, owner, want_w, want_s = _trained(tmp_path)
    try:
        _reset(table)
        sd = _torchrec_state_dict([(owner, table, 0, 0, 250), (owner, table, 250, 250, 350)], pg)
        st = sd["ebc.t.weight"]
        assert isinstance(st, ShardedTensor) and st.size() == (ROWS, DIM)
        assert all(isinstance(sh.tensor, DiskRowsView) for sh in st.local_shards())
        assert owner.flushes == 0 and disk_view_io(table).read_calls == 0  # built without a read
        # Read: each local shard's values, as training left them.
        got = [sh.tensor.clone() for sh in st.local_shards()]
        assert torch.equal(got[0], want_w[:250]) and torch.equal(got[1], want_w[250:])
        mom = sd["ebc.t.momentum1"].local_shards()
        assert torch.equal(mom[1].tensor.clone(), want_s[250:]) and not table.has_dirty()
        io_counts = disk_view_io(table)
        assert io_counts.max_rows_per_read == CHUNK and io_counts.rows_read == ROWS + 350
        # Load, as TorchRec's KeyedOptimizer.load_state_dict copies shards: in place, per shard.
        _train(table, owner, seed=2)  # (dirty rows again: the load must win over them)
        new_w = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(9))
        new_s = torch.rand(ROWS, generator=torch.Generator().manual_seed(10))
        _reset(table)
        for sh in st.local_shards():
            off, n = sh.metadata.shard_offsets[0], sh.metadata.shard_sizes[0]
            sh.tensor.detach().copy_(new_w[off:off + n])
        for sh in mom:
            off, n = sh.metadata.shard_offsets[0], sh.metadata.shard_sizes[0]
            sh.tensor.detach().copy_(new_s[off:off + n])
        assert io_counts.rows_read == 0 and io_counts.rows_written == 2 * ROWS
        assert io_counts.max_rows_per_write == CHUNK and owner.writes == 4
        got_w, got_s = table.read_host_rows(0, ROWS)
        assert torch.equal(got_w, new_w) and torch.equal(got_s, new_s)
        resident = table.resident_rows().sort().values
        assert resident.numel() and torch.equal(_lookup(table, resident), new_w[resident])  # the cache took it
    finally:
        table.close()


def _lookup(table: TieredTable, rows: torch.Tensor) -> torch.Tensor:
    engine, anchor, out = FetchEngine(), torch.empty(0, requires_grad=True), []
    batch = (rows, torch.arange(rows.numel() + 1), None, torch.zeros(rows.numel(), DIM))

    def step(i, tb, b):
        pooled = pooled_lookup(tb, anchor)
        out.append(pooled.detach().clone())
        pooled.backward(b[3])

    run_lookahead(table, engine, [batch], 0, step)
    engine.flush([table])
    return out[0]


def test_dcp_save_and_load_stream_in_chunks_and_reshard(tmp_path, pg):
    table, owner, want_w, want_s = _trained(tmp_path / "a", host_rows=80)
    ckpt = tmp_path / "ckpt"
    # Loaded into another sharding: two stores (global rows [0, 200) and [200, 600)), other
    # host caches, each with updates of its own in its device cache.
    first = _disk(tmp_path / "b", "t0", 200, host_rows=60)
    second = _disk(tmp_path / "b", "t1", 400, host_rows=150)
    try:
        sd = _torchrec_state_dict([(owner, table, 0, 0, 250), (owner, table, 250, 250, 350)], pg)
        _reset(table)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(ckpt)), planner=StreamingSavePlanner(),
                 process_group=pg)
        saved = disk_view_io(table)
        assert owner.flushes >= 1 and not table.has_dirty()
        assert saved.rows_read == 2 * ROWS  # each row of each component read once
        assert saved.max_rows_per_read == CHUNK and saved.max_rows_materialized == CHUNK  # never a shard at once
        meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        chunks = meta["ebc.t.weight"].chunks
        assert len(chunks) == -(-250 // CHUNK) + -(-350 // CHUNK) and max(c.sizes[0] for c in chunks) == CHUNK
        assert len(meta["ebc.t.momentum1"].chunks) == len(chunks)

        owners = [EngineOwner(first), EngineOwner(second)]
        for o in owners:
            _train(o.table, o, seed=3)
        sd2 = _torchrec_state_dict([(owners[0], first, 0, 0, 200), (owners[1], second, 0, 200, 400)], pg)
        _reset(first, second)
        dcp.load(sd2, storage_reader=SafeFileSystemReader(str(ckpt)), process_group=pg)  # (the app's reader)
        for store, lo, n in ((first, 0, 200), (second, 200, 400)):
            got_w, got_s = store.read_host_rows(0, n)
            assert torch.equal(got_w, want_w[lo:lo + n]) and torch.equal(got_s, want_s[lo:lo + n])  # bit-exact
            loaded = disk_view_io(store)
            assert loaded.rows_read == 0 and loaded.rows_written == 2 * n  # each row written once, nothing read
            assert 0 < loaded.max_rows_per_write <= CHUNK and loaded.max_rows_materialized == 0
        resident = second.resident_rows().sort().values
        assert torch.equal(_lookup(second, resident), want_w[200:][resident])  # the next lookup sees the load
    finally:
        for t in (table, first, second):
            t.close()


def test_the_default_planner_reads_a_whole_shard_and_its_checkpoint_still_loads(tmp_path, pg):
    """Why ``StreamingSavePlanner``: DCP's default planner writes a ShardedTensor's local shard
    as one item, so the whole shard is assembled in DRAM (read in chunks, but held at once).
    Such a checkpoint still loads into disk views with bounded writes (DCP's reader holds each
    saved piece itself)."""
    table, owner, want_w, want_s = _trained(tmp_path / "a")
    target = _disk(tmp_path / "b", "t", ROWS, host_rows=50)
    try:
        sd = _torchrec_state_dict([(owner, table, 0, 0, 250), (owner, table, 250, 250, 350)], pg)
        _reset(table)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ckpt")), planner=DefaultSavePlanner(),
                 process_group=pg)
        assert disk_view_io(table).max_rows_per_read == CHUNK
        assert disk_view_io(table).max_rows_materialized == 350  # the larger local shard, whole
        target_owner = EngineOwner(target)  # (views hold their owner weakly: the kernel keeps it)
        sd2 = _torchrec_state_dict([(target_owner, target, 0, 0, ROWS)], pg)
        _reset(target)
        dcp.load(sd2, storage_reader=dcp.FileSystemReader(str(tmp_path / "ckpt")), process_group=pg)
        got_w, got_s = target.read_host_rows(0, ROWS)
        assert torch.equal(got_w, want_w) and torch.equal(got_s, want_s)
        assert disk_view_io(target).max_rows_per_write == CHUNK and disk_view_io(target).rows_read == 0
    finally:
        table.close()
        target.close()


def test_a_view_as_a_state_dict_value_streams_with_the_default_planner(tmp_path, pg):
    """A view that is itself a state-dict value answers DCP's chunking protocol (as DTensor
    does): the stock planners save and load it in row chunks."""
    table, owner, want_w, want_s = _trained(tmp_path / "a")
    target = _disk(tmp_path / "b", "t", ROWS, host_rows=50)
    try:
        sd = {"w": disk_view(owner, table, 0, 0, ROWS, chunk_rows=CHUNK),
              "s": disk_view(owner, table, 1, 0, ROWS, chunk_rows=CHUNK)}
        _reset(table)
        # (two writer threads: value accesses are serialized)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ckpt"), thread_count=2), process_group=pg)
        assert disk_view_io(table).max_rows_materialized == CHUNK and disk_view_io(table).rows_read == 2 * ROWS
        target_owner = EngineOwner(target)
        sd2 = {"w": disk_view(target_owner, target, 0, 0, ROWS, chunk_rows=CHUNK),
               "s": disk_view(target_owner, target, 1, 0, ROWS, chunk_rows=CHUNK)}
        _reset(target)
        dcp.load(sd2, storage_reader=dcp.FileSystemReader(str(tmp_path / "ckpt")), process_group=pg)
        got_w, got_s = target.read_host_rows(0, ROWS)
        assert torch.equal(got_w, want_w) and torch.equal(got_s, want_s)
        assert disk_view_io(target).max_rows_per_write == CHUNK and disk_view_io(target).rows_read == 0
    finally:
        table.close()
        target.close()
