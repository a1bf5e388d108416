"""Batches of positional reads and writes as one foreign call: glibc's POSIX AIO
(``lio_listio``) through ctypes, with no Python per request.

Why not Python threads. The disk tier moves some 10^4 pages a second. A pool of Python
threads calling ``os.preadv`` takes the GIL back after every request, so the training thread,
which drops and retakes the GIL around every tensor op, queues behind dozens of I/O threads
for each one. Measured on this project's 2-core machine (random 4 KiB ``O_DIRECT`` reads at a
paced 10k reads/s beside a loop of 500 small tensor ops): the loop took 4.8-5.6x its time
alone with 64 Python I/O threads, and 1.3x with this module, which releases the GIL once per
batch while glibc's own threads (no Python) do the reads.

glibc serves the requests of one file descriptor one at a time, in order, so a file is given
``lanes`` duplicates of its descriptor and requests are dealt across them: ``lanes`` requests
of a file in flight at most. glibc's thread pool is per process (``aio_init`` sizes it once,
before the first request: :data:`MAX_THREADS`).

``available()`` is True on Linux with glibc and 64-bit pointers, where ``struct aiocb`` has the
layout declared in :data:`AIOCB` (the same on x86_64 and aarch64); elsewhere the caller keeps
its thread pool.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import sys
import threading
from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = ["AIOCB", "GlibcAio", "MAX_THREADS", "available"]

#: glibc's ``struct aiocb`` on LP64 Linux (168 bytes): the fields this module sets or reads, at
#: their offsets (``aio_sigevent`` at 32 and glibc's private fields are left zero).
AIOCB = np.dtype({"names": ["fildes", "opcode", "reqprio", "buf", "nbytes", "error", "ret", "offset"],
                  "formats": [np.int32, np.int32, np.int32, np.uint64, np.uint64, np.int32, np.int64, np.int64],
                  "offsets": [0, 4, 8, 16, 24, 112, 120, 128], "itemsize": 168})
_LIO_READ, _LIO_WRITE, _LIO_WAIT = 0, 1, 0
#: glibc's AIO threads at most, for the whole process (requests in flight at once).
MAX_THREADS = 64
#: ``error`` of a request glibc did not queue: untouched (-1; glibc sets EINPROGRESS when it
#: queues one), or EAGAIN where it tried and could not (a read or write of a regular file
#: never ends with EAGAIN itself).
_NOT_QUEUED = -1


def _unqueued(cbs: np.ndarray) -> np.ndarray:
    return (cbs["error"] == _NOT_QUEUED) | (cbs["error"] == errno.EAGAIN)


class _AioInit(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("aio_threads", "aio_num", "aio_locks", "aio_usedba", "aio_debug",
                                                  "aio_numusers", "aio_idle_time", "aio_reserved")]


_lib: Optional[ctypes.CDLL] = None
_lib_lock = threading.Lock()
_lib_tried = False


def _load() -> Optional[ctypes.CDLL]:
    """glibc's AIO functions (in libc from glibc 2.34, in librt before), initialised once."""
    global _lib, _lib_tried
    with _lib_lock:
        if _lib_tried:
            return _lib
        _lib_tried = True
        if (not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc"
                or ctypes.sizeof(ctypes.c_void_p) != 8):
            return None
        for library in ("c", "rt"):
            path = ctypes.util.find_library(library)
            try:
                lib = ctypes.CDLL(path, use_errno=True)
                for symbol in ("lio_listio", "aio_init", "aio_error", "aio_suspend"):
                    getattr(lib, symbol)  # (AttributeError where this library lacks one)
            except (OSError, AttributeError, TypeError):
                continue
            lib.lio_listio.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            lib.lio_listio.restype = ctypes.c_int
            lib.aio_error.argtypes = [ctypes.c_void_p]
            lib.aio_error.restype = ctypes.c_int
            lib.aio_suspend.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            lib.aio_suspend.restype = ctypes.c_int
            lib.aio_init.argtypes = [ctypes.c_void_p]
            lib.aio_init.restype = None
            # Before any request (later calls are ignored by glibc): threads that exit after a
            # second idle, so an idle job holds none.
            lib.aio_init(ctypes.byref(_AioInit(aio_threads=MAX_THREADS, aio_num=4 * MAX_THREADS, aio_idle_time=1)))
            _lib = lib
            return lib
        return None


def available() -> bool:
    """Whether glibc's AIO can serve files here (see the module docstring)."""
    return _load() is not None


class GlibcAio:
    """Batches of requests on one open file (its descriptor and ``lanes - 1`` duplicates).

    Args:
        fd: the file's descriptor (not owned; the duplicates are, closed by :meth:`close`).
        lanes: requests of this file in flight at most (fewer when the process runs out of
            descriptors: ``lanes`` says how many it got).
    """

    def __init__(self, fd: int, lanes: int) -> None:
        lib = _load()
        if lib is None:
            raise RuntimeError("glibc's POSIX AIO is not available on this platform")
        self._lib = lib
        fds = [fd]
        try:
            while len(fds) < max(1, int(lanes)):
                fds.append(os.dup(fd))
        except OSError as e:
            if e.errno != errno.EMFILE:
                for extra in fds[1:]:
                    os.close(extra)
                raise
        self._fds = np.array(fds, dtype=np.int32)
        self.lanes = len(fds)
        self.calls = 0  # lio_listio calls
        self.requests_per_call_max = 0

    def transfer(self, write: bool, buffer: np.ndarray, requests: Sequence[Tuple[int, int, int]]
                 ) -> Tuple[np.ndarray, np.ndarray]:
        """Runs ``requests`` - ``(file byte offset, buffer byte offset, bytes)`` each - all in
        flight together, and returns when every one has ended: per request, its ``errno`` (0:
        none) and the bytes it moved. The GIL is released while they run."""
        n = len(requests)
        cbs = np.zeros(n, dtype=AIOCB)
        if n == 0:
            return cbs["error"].copy(), cbs["ret"].copy()
        req = np.asarray(requests, dtype=np.int64).reshape(n, 3)
        cbs["fildes"] = self._fds[np.arange(n) % self._fds.size]
        cbs["opcode"] = _LIO_WRITE if write else _LIO_READ
        cbs["buf"] = np.uint64(buffer.ctypes.data) + req[:, 1].astype(np.uint64)
        cbs["nbytes"] = req[:, 2].astype(np.uint64)
        cbs["offset"] = req[:, 0]
        cbs["error"] = _NOT_QUEUED
        cbs["ret"] = -1
        ptrs = np.uint64(cbs.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(AIOCB.itemsize)
        self.calls += 1
        self.requests_per_call_max = max(self.requests_per_call_max, n)
        if self._lib.lio_listio(_LIO_WAIT, ptrs.ctypes.data, n, None) != 0:
            # EIO: all ended, some failed (their own errno says why). EINTR: a signal ended
            # the wait, not the requests. EAGAIN: some were not queued.
            self._wait_queued(cbs, ptrs)
            self._run_unqueued(write, buffer, cbs, req)
        return cbs["error"].copy(), cbs["ret"].copy()

    def _wait_queued(self, cbs: np.ndarray, ptrs: np.ndarray) -> None:
        lib = self._lib
        for i in np.flatnonzero(~_unqueued(cbs)).tolist():
            one = np.array([ptrs[i]], dtype=np.uint64)
            while lib.aio_error(ctypes.c_void_p(int(ptrs[i]))) == errno.EINPROGRESS:
                lib.aio_suspend(one.ctypes.data, 1, None)

    @staticmethod
    def _run_unqueued(write: bool, buffer: np.ndarray, cbs: np.ndarray, req: np.ndarray) -> None:
        """Requests glibc could not queue, one by one on this thread."""
        for i in np.flatnonzero(_unqueued(cbs)).tolist():
            offset, at, nbytes = (int(v) for v in req[i])
            view = memoryview(buffer[at: at + nbytes])
            fd = int(cbs["fildes"][i])
            try:
                got = os.pwritev(fd, [view], offset) if write else os.preadv(fd, [view], offset)
                cbs["error"][i], cbs["ret"][i] = 0, got
            except OSError as e:
                cbs["error"][i], cbs["ret"][i] = e.errno or errno.EIO, -1

    def close(self) -> None:
        fds, self._fds = self._fds, np.empty(0, dtype=np.int32)
        for fd in fds[1:].tolist():
            try:
                os.close(fd)
            except OSError:
                pass
