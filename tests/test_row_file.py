"""The disk tier's file (store/row_file.py): whole pages at aligned offsets with O_DIRECT
where the filesystem allows it, many requests in flight, and every fault one
``DiskTierError`` naming the table and the file."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from torchrec_proactive.store import glibc_aio, row_file
from torchrec_proactive.store.row_file import BLOCK, DiskTierError, PageLayout, RowFile, aligned_buffer

from .io_faults import inject, io_backend  # noqa: F401 (a fixture)


def test_layout_packs_whole_rows_per_page():
    small = PageLayout(row_bytes=516)  # dim 128 fp32 + a row-wise state
    assert (small.rows_per_page, small.page_bytes) == (7, BLOCK)
    pages, offsets = small.locate(np.array([0, 6, 7, 15]))
    assert pages.tolist() == [0, 0, 1, 2] and offsets.tolist() == [0, 6 * 516, 0, 516]
    big = PageLayout(row_bytes=5000)
    assert (big.rows_per_page, big.page_bytes) == (1, 2 * BLOCK)
    assert small.num_pages(700) == 100 and big.num_pages(3) == 3


def test_pages_written_are_read_back_in_flight_together(tmp_path, io_backend):
    with RowFile(tmp_path / "t.rows", num_rows=1000, row_bytes=40, table="t", io_threads=8,
                 max_run_pages=2) as f:
        assert f.o_direct, f.fallback_reason  # ext4 under the test's tmp dir
        assert f.io_backend == io_backend
        pages = np.array([0, 1, 2, 5, 6, 9])
        data = aligned_buffer(pages.size * BLOCK)
        data[:] = np.random.default_rng(0).integers(0, 256, data.size, dtype=np.uint8)
        w = f.write_pages(pages, data)
        w.wait()
        assert (w.pages, w.requests) == (6, 4)  # runs [0,1] [2] [5,6] [9] at 2 pages a request
        out = aligned_buffer(pages.size * BLOCK)
        f.read_pages(pages, out).wait()
        assert np.array_equal(out, data)
        assert f.bytes_read == f.bytes_written == 6 * BLOCK
        untouched = aligned_buffer(BLOCK)
        f.read_pages([3], untouched).wait()
        assert not untouched.any()  # a new file reads zeros
    assert not (tmp_path / "t.rows").exists()  # scratch: removed at close


def test_bad_requests_are_refused_naming_table_and_file(tmp_path):
    with RowFile(tmp_path / "t.rows", num_rows=10, row_bytes=100, table="t") as f:
        buf = aligned_buffer(BLOCK)
        with pytest.raises(DiskTierError, match=r"table 't': disk tier file .*t\.rows has no page 1 "):
            f.read_pages([1], buf)
        with pytest.raises(DiskTierError, match="not sorted and unique"):
            f.read_pages([0, 0], aligned_buffer(2 * BLOCK))
        with pytest.raises(DiskTierError, match="not aligned"):
            f.read_pages([0], np.zeros(2 * BLOCK + 1, dtype=np.uint8)[1:])


def test_directories_that_cannot_hold_the_file(tmp_path):
    with pytest.raises(DiskTierError, match=r"table 'emb': .* cannot be created: .*missing is not a directory"):
        RowFile(tmp_path / "missing" / "t.rows", 10, 100, table="emb")
    (tmp_path / "plain").write_text("x")
    with pytest.raises(DiskTierError, match="is not a directory"):
        RowFile(tmp_path / "plain" / "t.rows", 10, 100, table="emb")
    (tmp_path / "old.rows").write_bytes(b"\0" * 100)
    with pytest.raises(DiskTierError, match=r"exists with 100 bytes, not the 4096 .*remove it"):
        RowFile(tmp_path / "old.rows", 10, 100, table="emb")


def test_a_full_disk_is_one_line_at_creation_and_mid_run(tmp_path, monkeypatch, io_backend):
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(row_file.os, "posix_fallocate", full)
    with pytest.raises(DiskTierError, match=r"table 't': .* cannot hold its 4096 bytes: the disk is full"):
        RowFile(tmp_path / "t.rows", 10, 100, table="t")
    assert not (tmp_path / "t.rows").exists()
    monkeypatch.setattr(row_file.os, "posix_fallocate", real)

    def full_disk(offset, got):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with RowFile(tmp_path / "t.rows", 10, 100, table="t") as f:
        inject(monkeypatch, io_backend, write=full_disk)
        with pytest.raises(DiskTierError, match=r"write failed at byte 0 \(4096 bytes\): the disk is full"):
            f.write_pages([0], aligned_buffer(BLOCK)).wait()


def test_a_file_truncated_replaced_or_removed_under_the_job(tmp_path):
    path = tmp_path / "t.rows"
    with RowFile(path, num_rows=100, row_bytes=100, table="t") as f:
        os.truncate(path, BLOCK)
        with pytest.raises(DiskTierError, match=r"truncated under the running job \(4096 of 12288 bytes\)"):
            f.read_pages([2], aligned_buffer(BLOCK))
    with RowFile(path, num_rows=100, row_bytes=100, table="t", direct=False) as f:
        assert not f.o_direct and "not asked for" in f.fallback_reason
        other = tmp_path / "other"
        other.write_bytes(b"\0" * f.size)
        os.replace(other, path)
        with pytest.raises(DiskTierError, match="replaced under the running job"):
            f.read_pages([0], aligned_buffer(BLOCK))
        path.unlink()
        with pytest.raises(DiskTierError, match="removed under the running job"):
            f.write_pages([0], aligned_buffer(BLOCK))


def test_a_short_read_is_an_error_not_zeros(tmp_path, monkeypatch, io_backend):
    with RowFile(tmp_path / "t.rows", 100, 100, table="t") as f:
        inject(monkeypatch, io_backend, read=lambda offset, got: 1000)
        with pytest.raises(DiskTierError, match=r"short read at byte 8192: 1000 of 4096 bytes"):
            f.read_pages([2], aligned_buffer(BLOCK)).wait()


def test_the_backend_is_chosen_by_argument_or_environment_and_a_bad_name_names_its_source(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHREC_PROACTIVE_DISK_IO", "threads")
    with RowFile(tmp_path / "a.rows", 10, 100, table="t") as f:
        assert f.io_backend == "threads"
    with RowFile(tmp_path / "b.rows", 10, 100, table="t", io_backend="auto") as f:
        assert f.io_backend == ("aio" if glibc_aio.available() else "threads")
    monkeypatch.setenv("TORCHREC_PROACTIVE_DISK_IO", "uring")
    with pytest.raises(ValueError, match=r"^\$TORCHREC_PROACTIVE_DISK_IO='uring': expected one of auto, aio, threads$"):
        RowFile(tmp_path / "c.rows", 10, 100, table="t")
    with pytest.raises(ValueError, match=r"^io_backend='x': expected one of"):
        RowFile(tmp_path / "c.rows", 10, 100, table="t", io_backend="x")
    assert not list(tmp_path.glob("c.rows"))


@pytest.mark.skipif(not glibc_aio.available(), reason="glibc's POSIX AIO is Linux/glibc only")
def test_aio_moves_a_batch_in_one_call_over_distinct_descriptors(tmp_path):
    """What the aio backend is for: a batch of requests is one foreign call (no Python per
    request), dealt over as many descriptors as requests may be in flight (glibc serves one
    descriptor's requests one at a time)."""
    with RowFile(tmp_path / "t.rows", num_rows=30000, row_bytes=40, table="t", io_threads=16,
                 io_backend="aio") as f:
        aio = f._aio
        assert aio.lanes == 16 and len(set(aio._fds.tolist())) == 16
        pages = np.arange(0, 200, 2)  # 100 pages, none adjacent: 100 requests
        data = aligned_buffer(pages.size * BLOCK)
        data[:] = np.random.default_rng(1).integers(0, 256, data.size, dtype=np.uint8)
        f.write_pages(pages, data).wait()
        out = aligned_buffer(pages.size * BLOCK)
        calls = aio.calls
        batch = f.read_pages(pages, out)
        batch.wait()
        assert np.array_equal(out, data) and batch.requests == 100
        assert aio.calls == calls + 1 and aio.requests_per_call_max == 100
        # (in flight: the batch counts as min(requests, descriptors))
        assert f.reads_in_flight_max == 16 and f.pages_read == 100
        # The same bytes as one os.preadv per page.
        one = aligned_buffer(BLOCK)
        for i, p in enumerate(pages[:5].tolist()):
            assert os.preadv(f._fd, [memoryview(one)], p * BLOCK) == BLOCK
            assert np.array_equal(one, out[i * BLOCK:(i + 1) * BLOCK])
    assert not (tmp_path / "t.rows").exists()
