"""The disk tier's file (store/row_file.py): whole pages at aligned offsets with O_DIRECT
where the filesystem allows it, many requests in flight, and every fault one
``DiskTierError`` naming the table and the file."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from torchrec_proactive.store import row_file
from torchrec_proactive.store.row_file import BLOCK, DiskTierError, PageLayout, RowFile, aligned_buffer


def test_layout_packs_whole_rows_per_page():
    small = PageLayout(row_bytes=516)  # dim 128 fp32 + a row-wise state
    assert (small.rows_per_page, small.page_bytes) == (7, BLOCK)
    pages, offsets = small.locate(np.array([0, 6, 7, 15]))
    assert pages.tolist() == [0, 0, 1, 2] and offsets.tolist() == [0, 6 * 516, 0, 516]
    big = PageLayout(row_bytes=5000)
    assert (big.rows_per_page, big.page_bytes) == (1, 2 * BLOCK)
    assert small.num_pages(700) == 100 and big.num_pages(3) == 3


def test_pages_written_are_read_back_in_flight_together(tmp_path):
    with RowFile(tmp_path / "t.rows", num_rows=1000, row_bytes=40, table="t", io_threads=8,
                 max_run_pages=2) as f:
        assert f.o_direct, f.fallback_reason  # ext4 under the test's tmp dir
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


def test_a_full_disk_is_one_line_at_creation_and_mid_run(tmp_path, monkeypatch):
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(row_file.os, "posix_fallocate", full)
    with pytest.raises(DiskTierError, match=r"table 't': .* cannot hold its 4096 bytes: the disk is full"):
        RowFile(tmp_path / "t.rows", 10, 100, table="t")
    assert not (tmp_path / "t.rows").exists()
    monkeypatch.setattr(row_file.os, "posix_fallocate", real)

    def pwritev(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with RowFile(tmp_path / "t.rows", 10, 100, table="t") as f:
        monkeypatch.setattr(row_file.os, "pwritev", pwritev)
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


def test_a_short_read_is_an_error_not_zeros(tmp_path, monkeypatch):
    with RowFile(tmp_path / "t.rows", 100, 100, table="t") as f:
        monkeypatch.setattr(row_file.os, "preadv", lambda fd, buffers, offset: 1000)
        with pytest.raises(DiskTierError, match=r"short read at byte 8192: 1000 of 4096 bytes"):
            f.read_pages([2], aligned_buffer(BLOCK)).wait()
