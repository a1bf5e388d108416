"""One table shard's rows on local disk: the bottom tier for tables larger than host memory.

Layout. A fixed stride, no key-value store: TorchRec tables have a fixed ``num_embeddings``
and a row's place never changes. Rows (weights, then each optimizer state: one record) are
packed whole into *pages* of the disk's block size (4 KiB), ``rows_per_page`` to a page; a
row larger than a block gets pages of its own, rounded up. Every read and write moves whole
pages, at page-aligned offsets, from page-aligned buffers - what ``O_DIRECT`` demands, and
what keeps the page cache from faking an SSD. Where the filesystem refuses ``O_DIRECT``
(tmpfs, some overlays) the file is opened buffered and ``o_direct`` / ``fallback_reason``
say so; nothing else changes.

I/O. A random 4 KiB read costs ~100 us on NVMe and several hundred here, and only ~64 in
flight reach the disk's reads/s, so requests go in batches with up to ``io_threads``
(default 64) in flight. Runs of consecutive pages go as one request. Two backends
(``io_backend``; ``RowFile.io_backend`` says which one a file got):

* ``"aio"`` (the default where it exists: Linux, glibc): a batch is one call of glibc's
  ``lio_listio`` (``glibc_aio``), which releases the GIL while glibc's threads run it - no
  Python per request, so the training thread does not queue for the GIL behind the I/O;
* ``"threads"``: a pool of ``io_threads`` Python threads, each request one ``os.preadv`` /
  ``os.pwritev`` (which release the GIL but take it back after every request).

``"auto"`` picks the first available; the environment variable
``TORCHREC_PROACTIVE_DISK_IO`` (``auto``, ``aio`` or ``threads``) sets the default.

:meth:`RowFile.read_pages` / :meth:`RowFile.write_pages` return an :class:`IOBatch` at once;
its ``wait`` raises the first failure. :meth:`RowFile.read_runs` / :meth:`RowFile.write_runs`
move a caller's list of runs on the calling thread (all in flight together with ``aio``, one
after another with ``threads``: :meth:`RowFile.shares` says how to split work across the
pool, :meth:`RowFile.submit` puts a share on it), for a caller that orders requests itself
(the host cache). Counters: requests, pages and bytes moved, and reads in flight
(``reads_in_flight_max``; the mean, over reads, of the reads in flight when one starts:
``reads_in_flight_mean``; with ``aio`` a batch counts as ``min(its requests,
in_flight_limit)`` in flight from its start to its end).

Faults are :class:`DiskTierError` naming the table, the file and what happened: a directory
that cannot hold the file, a full disk, a short read, a file truncated or replaced under the
job (checked against the identity the file had when opened: ``check_identity``, two
``stat`` calls, made once per batch of requests and again to explain a short read).

The order of moves is not this module's business: the store's one owner of data moves
issues reads and writes so that a page is written before any later read of it.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from . import glibc_aio
from .errors import ProactiveError

__all__ = ["BLOCK", "DiskTierError", "IOBatch", "IO_BACKENDS", "PageLayout", "Run", "RowFile", "aligned_buffer",
           "default_io_backend"]

#: The I/O unit: page size and alignment of every read, write and buffer.
BLOCK = 4096

#: What ``io_backend`` takes (see the module docstring).
IO_BACKENDS = ("auto", "aio", "threads")
_IO_ENV = "TORCHREC_PROACTIVE_DISK_IO"

#: One request: ``(first file page, first buffer page, pages)``.
Run = Tuple[int, int, int]
_T = TypeVar("_T")

#: With ``aio``, requests a share of work moves in one call at most (bounds its arrays).
_AIO_SHARE_RUNS = 4096


def default_io_backend() -> str:
    """``io_backend`` when none is given: ``$TORCHREC_PROACTIVE_DISK_IO`` or ``"auto"``."""
    return os.environ.get(_IO_ENV, "auto").strip().lower() or "auto"


class DiskTierError(ProactiveError, OSError):
    """The disk tier cannot do what was asked: one line naming the table, the file and why."""


@dataclass(frozen=True)
class PageLayout:
    """Where rows live in the file: ``rows_per_page`` whole rows per page of ``page_bytes``."""

    row_bytes: int
    block: int = BLOCK

    @property
    def rows_per_page(self) -> int:
        return max(1, self.block // self.row_bytes)

    @property
    def page_bytes(self) -> int:
        if self.row_bytes <= self.block:
            return self.block
        return -(-self.row_bytes // self.block) * self.block

    def num_pages(self, num_rows: int) -> int:
        return -(-num_rows // self.rows_per_page)

    def locate(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Per row, its page and its byte offset within the page."""
        rows = np.asarray(rows, dtype=np.int64)
        rpp = self.rows_per_page
        return rows // rpp, (rows % rpp) * self.row_bytes


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed ``uint8`` array of ``nbytes`` (rounded up to ``BLOCK``) at a page-aligned
    address (an anonymous mapping), as ``O_DIRECT`` needs; it keeps its mapping alive."""
    size = max(BLOCK, -(-nbytes // BLOCK) * BLOCK)
    mapping = mmap.mmap(-1, size)
    return np.frombuffer(mapping, dtype=np.uint8)


class IOBatch:
    """Reads or writes in flight. ``wait()`` returns once all landed, raising the first
    failure; ``done()`` polls. ``pages`` and ``requests``: what it moves and in how many
    calls."""

    def __init__(self, futures: List["Future[None]"], pages: int, requests: int) -> None:
        self._futures = futures
        self.pages = pages
        self.requests = requests

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        error: Optional[BaseException] = None
        for f in self._futures:
            e = f.exception()
            if e is not None and error is None:
                error = e
        if error is not None:
            raise error


def _runs(pages: np.ndarray, max_run: int, slots: Optional[np.ndarray] = None) -> List[Tuple[int, int, int]]:
    """``(first page, first buffer page, count)`` of runs of pages consecutive in the file and
    in the buffer (``slots[i]``: the buffer page of ``pages[i]``; default ``i``), each at most
    ``max_run`` pages."""
    runs: List[Tuple[int, int, int]] = []
    if pages.size == 0:
        return runs
    slots = np.arange(pages.size, dtype=np.int64) if slots is None else slots
    breaks = np.flatnonzero((np.diff(pages) != 1) | (np.diff(slots) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [pages.size]))
    for s, e in zip(starts.tolist(), ends.tolist()):
        for at in range(s, e, max_run):
            runs.append((int(pages[at]), int(slots[at]), min(max_run, e - at)))
    return runs


class RowFile:
    """A table shard's rows in one file at ``path`` (see the module docstring).

    Args:
        path: the file; its directory must exist and be writable. Created (sized, zeroed)
            when missing; an existing file of the wrong size is refused.
        num_rows / row_bytes: the shard's rows and the bytes of one row's record.
        table: the table's name, for messages.
        io_threads: reads and writes in flight at most (the pool's size; default 64, what
            this machine's disk needs for its reads/s).
        direct: try ``O_DIRECT`` (default); ``o_direct`` says whether it was obtained.
        max_run_pages: the longest run of pages one request moves.
        io_backend: ``"auto"`` (default: ``$TORCHREC_PROACTIVE_DISK_IO`` or ``"auto"``),
            ``"aio"`` or ``"threads"`` (see the module docstring); ``io_backend`` says which
            one the file got.
    """

    def __init__(self, path: os.PathLike | str, num_rows: int, row_bytes: int, table: str,
                 io_threads: int = 64, direct: bool = True, max_run_pages: int = 32,
                 io_backend: Optional[str] = None) -> None:
        backend = default_io_backend() if io_backend is None else io_backend
        if backend not in IO_BACKENDS:
            source = f"${_IO_ENV}" if io_backend is None else "io_backend"
            raise ValueError(f"{source}={backend!r}: expected one of {', '.join(IO_BACKENDS)}")
        if backend == "aio" and not glibc_aio.available():
            raise DiskTierError(f"table '{table}': io_backend 'aio' needs glibc's POSIX AIO (Linux with glibc), which "
                                f"this platform lacks; use 'auto' or 'threads'")
        self.path = Path(path)
        self.table = table
        self.num_rows = int(num_rows)
        self.layout = PageLayout(int(row_bytes))
        self._page_bytes = self.layout.page_bytes
        self.num_pages = self.layout.num_pages(self.num_rows)
        self.size = self.num_pages * self.layout.page_bytes
        self.max_run_pages = max(1, int(max_run_pages))
        self.o_direct = False
        self.fallback_reason: Optional[str] = None
        self._check_directory()
        created = not self.path.exists()
        self._fd = self._open(direct)
        try:
            if created:
                self._allocate()
            elif os.fstat(self._fd).st_size != self.size:
                raise self._error(f"exists with {os.fstat(self._fd).st_size} bytes, not the {self.size} its "
                                  f"{self.num_rows} rows of {row_bytes} bytes take; remove it or choose another tier.dir")
        except BaseException:
            os.close(self._fd)
            raise
        st = os.fstat(self._fd)
        self._identity = (st.st_dev, st.st_ino)
        self._threads = max(1, int(io_threads))
        self._aio: Optional[glibc_aio.GlibcAio] = None
        if backend in ("auto", "aio") and glibc_aio.available():
            self._aio = glibc_aio.GlibcAio(self._fd, self._threads)
        self.io_backend = "aio" if self._aio is not None else "threads"
        # With aio the pool runs shares of work (each one call for many requests), not
        # requests: a few threads, one per batch moving at once.
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix=f"rowfile-{table}")
        self._lock = threading.Lock()
        self.reads = self.writes = self.bytes_read = self.bytes_written = 0
        self.pages_read = self.pages_written = 0
        # Reads in flight: now, at most, and summed over reads as each starts (for the mean).
        self._reads_now = 0
        self.reads_in_flight_max = 0
        self._reads_in_flight_sum = 0

    # ------------------------------------------------------------------ set-up
    def _error(self, what: str, cause: Optional[BaseException] = None) -> DiskTierError:
        err = DiskTierError(f"table '{self.table}': disk tier file {self.path} {what}")
        if cause is not None:
            err.__cause__ = cause
        return err

    def _check_directory(self) -> None:
        parent = self.path.parent
        if not parent.is_dir():
            raise self._error(f"cannot be created: {parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise self._error(f"cannot be created: {parent} is not writable")

    def _open(self, direct: bool) -> int:
        flags = os.O_RDWR | os.O_CREAT
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                self.o_direct = True
                return fd
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise self._error(f"cannot be opened: {e.strerror}", e) from e
                self.fallback_reason = f"the filesystem of {self.path.parent} refuses O_DIRECT (EINVAL): buffered I/O"
        elif direct:
            self.fallback_reason = "this platform has no O_DIRECT: buffered I/O"
        else:
            self.fallback_reason = "O_DIRECT not asked for: buffered I/O"
        try:
            return os.open(self.path, flags, 0o600)
        except OSError as e:
            raise self._error(f"cannot be opened: {e.strerror}", e) from e

    def _allocate(self) -> None:
        """Sizes the file; ``posix_fallocate`` reserves the blocks, so a full disk is found
        now, not in the middle of a run."""
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, 0, max(self.size, 1))
            else:
                os.ftruncate(self._fd, self.size)
        except OSError as e:
            os.ftruncate(self._fd, 0)
            self._unlink()
            why = "the disk is full" if e.errno == errno.ENOSPC else e.strerror
            raise self._error(f"cannot hold its {self.size} bytes: {why}", e) from e

    def _unlink(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass

    # ------------------------------------------------------------------ I/O
    def check_identity(self) -> None:
        """Raises if the file under ``path`` was replaced, removed or truncated since it was
        opened (a write would go to a file nobody reads, a read would return short)."""
        if self._fd < 0:
            raise self._error("is closed")
        try:
            st = os.stat(self.path)
        except FileNotFoundError as e:
            raise self._error("was removed under the running job", e) from e
        if (st.st_dev, st.st_ino) != self._identity:
            raise self._error("was replaced under the running job (another file has its name now)")
        size = os.fstat(self._fd).st_size
        if size < self.size:
            raise self._error(f"was truncated under the running job ({size} of {self.size} bytes)")

    def _check_pages(self, pages: np.ndarray) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            bad = int(pages.min()) if pages.min() < 0 else int(pages.max())
            raise self._error(f"has no page {bad} (pages [0, {self.num_pages}))")
        if pages.size > 1 and not np.all(pages[1:] > pages[:-1]):
            raise self._error("was asked for pages that are not sorted and unique")
        return pages

    def _views(self, buffer: np.ndarray, at: int, count: int) -> memoryview:
        pb = self._page_bytes
        return memoryview(buffer[at * pb: (at + count) * pb])

    @property
    def reads_in_flight_mean(self) -> float:
        """Mean, over the reads made, of the reads in flight as each started (itself included)."""
        return self._reads_in_flight_sum / self.reads if self.reads else 0.0

    def _read_failed(self, offset: int, want: int, err: int) -> DiskTierError:
        e = OSError(err, os.strerror(err))
        return self._error(f"read failed at byte {offset} ({want} bytes): {e.strerror}", e)

    def _short_read(self, offset: int, want: int, got: int) -> DiskTierError:
        try:
            self.check_identity()  # (names what happened to the file, when it can be seen)
        except DiskTierError as e:
            return e
        return self._error(f"short read at byte {offset}: {got} of {want} bytes (truncated under the running job?)")

    def _write_failed(self, offset: int, want: int, err: int) -> DiskTierError:
        e = OSError(err, os.strerror(err))
        why = "the disk is full" if err == errno.ENOSPC else e.strerror
        return self._error(f"write failed at byte {offset} ({want} bytes): {why}", e)

    def _reads_start(self, in_flight: int, reads: int) -> None:
        """``reads`` start, adding ``in_flight`` to the reads in flight (each of them sees the
        new count; never more than ``in_flight_limit``: with ``aio``, calls that overlap share
        the file's descriptors)."""
        with self._lock:
            self._reads_now += in_flight
            now = min(self._reads_now, self.in_flight_limit)
            self.reads_in_flight_max = max(self.reads_in_flight_max, now)
            self._reads_in_flight_sum += now * reads

    def read_run(self, buffer: np.ndarray, first: int, at: int, count: int) -> None:
        """Reads pages ``[first, first + count)`` into pages ``[at, at + count)`` of ``buffer``
        (an ``aligned_buffer``), on the calling thread: one request (``os.preadv``, whatever
        the backend). Raises ``DiskTierError`` for a failed or short read (a short one names
        a truncation or a replacement of the file when ``check_identity`` finds one)."""
        want = count * self._page_bytes
        offset = first * self._page_bytes
        self._reads_start(1, 1)
        got = -1
        try:
            got = os.preadv(self._fd, [self._views(buffer, at, count)], offset)
        except OSError as e:
            raise self._read_failed(offset, want, e.errno or errno.EIO) from e
        finally:
            with self._lock:
                self._reads_now -= 1
                self.reads += 1
                if got == want:
                    self.bytes_read += want
                    self.pages_read += count
        if got != want:
            raise self._short_read(offset, want, got)

    def submit(self, fn: Callable[..., None], *args: object) -> "Future[None]":
        """Runs ``fn(*args)`` on the I/O pool (first in, first started)."""
        if self._pool is None:
            raise self._error("is closed")
        return self._pool.submit(fn, *args)

    @property
    def io_threads(self) -> int:
        return self._threads

    @property
    def in_flight_limit(self) -> int:
        """Requests of this file in flight at most: ``io_threads``, or with ``aio`` the
        descriptors it got (fewer where the process ran out of them)."""
        return self._aio.lanes if self._aio is not None else self._threads

    def shares(self, runs: List[_T]) -> List[List[_T]]:
        """``runs`` split into the shares of work to run on the pool at once: with ``aio``
        one share per few thousand runs (one call moves a share's requests, all in flight
        together); with ``threads`` one per thread, each going through its share of the
        requests (a future per request would cost more Python than a 4 KiB read)."""
        if not runs:
            return []
        if self._aio is not None:
            return [runs[i: i + _AIO_SHARE_RUNS] for i in range(0, len(runs), _AIO_SHARE_RUNS)]
        return [runs[i::self._threads] for i in range(min(self._threads, len(runs)))]

    def read_runs(self, buffer: np.ndarray, runs: Sequence[Run]) -> List[Optional[DiskTierError]]:
        """Reads each run ``(first file page, first buffer page, pages)`` into ``buffer`` on
        the calling thread (with ``aio`` all in flight together, with ``threads`` one after
        another) and returns, per run, ``None`` or its ``DiskTierError``."""
        if self._aio is None:
            return self._one_by_one(self.read_run, buffer, runs)
        return self._aio_runs(False, buffer, runs)

    def write_run(self, buffer: np.ndarray, first: int, at: int, count: int) -> None:
        """Writes pages ``[at, at + count)`` of ``buffer`` to pages ``[first, first + count)``,
        on the calling thread: one request (``os.pwritev``). Raises ``DiskTierError`` (a full
        disk says so)."""
        want = count * self._page_bytes
        offset = first * self._page_bytes
        try:
            got = os.pwritev(self._fd, [self._views(buffer, at, count)], offset)
        except OSError as e:
            raise self._write_failed(offset, want, e.errno or errno.EIO) from e
        if got != want:
            raise self._error(f"short write at byte {offset}: {got} of {want} bytes")
        with self._lock:
            self.writes += 1
            self.bytes_written += want
            self.pages_written += count

    def write_runs(self, buffer: np.ndarray, runs: Sequence[Run]) -> List[Optional[DiskTierError]]:
        """Writes each run ``(first file page, first buffer page, pages)`` from ``buffer``, as
        :meth:`read_runs` reads; per run, ``None`` or its ``DiskTierError``."""
        if self._aio is None:
            return self._one_by_one(self.write_run, buffer, runs)
        return self._aio_runs(True, buffer, runs)

    @staticmethod
    def _one_by_one(move: Callable[[np.ndarray, int, int, int], None], buffer: np.ndarray,
                    runs: Sequence[Run]) -> List[Optional[DiskTierError]]:
        out: List[Optional[DiskTierError]] = []
        for first, at, count in runs:
            try:
                move(buffer, first, at, count)
                out.append(None)
            except DiskTierError as e:
                out.append(e)
        return out

    def _aio_runs(self, write: bool, buffer: np.ndarray, runs: Sequence[Run]) -> List[Optional[DiskTierError]]:
        """One ``lio_listio`` call for ``runs``; the same errors, counters and one line per
        failed run as the one-request methods."""
        if not runs:
            return []
        aio = self._aio
        if self._fd < 0 or aio is None:
            raise self._error("is closed")
        pb = self._page_bytes
        r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        want = r[:, 2] * pb
        requests = np.stack((r[:, 0] * pb, r[:, 1] * pb, want), axis=1)
        n = len(runs)
        lanes = min(n, self.in_flight_limit)
        if not write:
            self._reads_start(lanes, n)
        try:
            err, got = aio.transfer(write, buffer, requests)
        finally:
            if not write:
                with self._lock:
                    self._reads_now -= lanes
        ok = (err == 0) & (got == want)
        with self._lock:
            moved, pages = int(want[ok].sum()), int(r[ok, 2].sum())
            if write:
                self.writes += int(np.count_nonzero(ok))
                self.bytes_written += moved
                self.pages_written += pages
            else:
                self.reads += n
                self.bytes_read += moved
                self.pages_read += pages
        out: List[Optional[DiskTierError]] = [None] * n
        for i in np.flatnonzero(~ok).tolist():
            offset, w, e, g = int(requests[i, 0]), int(want[i]), int(err[i]), int(got[i])
            if e != 0:
                out[i] = self._write_failed(offset, w, e) if write else self._read_failed(offset, w, e)
            elif write:
                out[i] = self._error(f"short write at byte {offset}: {g} of {w} bytes")
            else:
                out[i] = self._short_read(offset, w, g)
        return out

    def _submit(self, move: Callable[[np.ndarray, Sequence[Run]], List[Optional[DiskTierError]]], pages: np.ndarray,
                buffer: np.ndarray, slots: Optional[np.ndarray] = None) -> IOBatch:
        pages = self._check_pages(pages)
        if slots is not None:
            slots = np.asarray(slots, dtype=np.int64)
            if slots.shape != pages.shape or (slots.size and slots.min() < 0):
                raise self._error(f"was given {slots.size} buffer pages for {pages.size} file pages")
        need = (int(slots.max()) + 1 if slots is not None and slots.size else pages.size) * self.layout.page_bytes
        if buffer.dtype != np.uint8 or buffer.size < need:
            raise self._error(f"was given a buffer of {buffer.size} bytes where {need} are needed")
        if self.o_direct and buffer.ctypes.data % BLOCK:
            raise self._error(f"was given a buffer at an address not aligned to {BLOCK} bytes (use aligned_buffer)")
        self.check_identity()
        runs = _runs(pages, self.max_run_pages, slots)

        def run_share(share: List[Run]) -> None:
            for error in move(buffer, share):
                if error is not None:
                    raise error

        futures = [self._pool.submit(run_share, share) for share in self.shares(runs)]
        return IOBatch(futures, int(pages.size), len(runs))

    def read_pages(self, pages: Sequence[int] | np.ndarray, buffer: np.ndarray,
                   slots: Optional[Sequence[int] | np.ndarray] = None) -> IOBatch:
        """Reads ``pages`` (sorted, unique) into ``buffer`` (an ``aligned_buffer``): page i
        into its page ``slots[i]`` (default: consecutive pages), all in flight at once."""
        return self._submit(self.read_runs, np.asarray(pages), buffer, None if slots is None else np.asarray(slots))

    def write_pages(self, pages: Sequence[int] | np.ndarray, buffer: np.ndarray,
                    slots: Optional[Sequence[int] | np.ndarray] = None) -> IOBatch:
        """Writes pages of ``buffer`` (``slots[i]``, default consecutive) to ``pages``
        (sorted, unique)."""
        return self._submit(self.write_runs, np.asarray(pages), buffer, None if slots is None else np.asarray(slots))

    def close(self, remove: bool = True, wait: bool = True) -> None:
        """Ends the I/O (waiting for what is in flight, unless ``wait`` is False: then what
        has not started is cancelled) and, by default, removes the file: the tier is
        scratch, its truth is in checkpoints."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=not wait)
        aio, self._aio = getattr(self, "_aio", None), None
        if aio is not None:
            aio.close()
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            # Only our own file is removed: one put in its place under the job is not ours.
            ours = False
            if remove:
                try:
                    st = os.stat(self.path)
                    ours = (st.st_dev, st.st_ino) == getattr(self, "_identity", None)
                except OSError:
                    pass
            os.close(fd)
            if ours:
                self._unlink()

    def __enter__(self) -> "RowFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RowFile(table={self.table!r}, path={str(self.path)!r}, rows={self.num_rows}, "
                f"rows_per_page={self.layout.rows_per_page}, pages={self.num_pages}, o_direct={self.o_direct}, "
                f"io_backend={self.io_backend!r})")
