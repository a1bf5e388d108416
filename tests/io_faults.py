"""Faults injected into the disk tier's requests on either I/O backend (store/row_file.py).

``io_backend``: a fixture running a test once per backend (``threads``: each request one
``os.preadv`` / ``os.pwritev``; ``aio``: batches through glibc's ``lio_listio``), chosen
through ``$TORCHREC_PROACTIVE_DISK_IO`` as a user would.

``inject(monkeypatch, backend, read=..., write=...)``: per request, after the kernel moved
it, ``hook(offset, got)`` returns the byte count the store is told (``got`` unchanged, fewer:
a short request) or raises ``OSError`` (a failed one; a write was made all the same, which
the store must not rely on). On ``threads`` it wraps ``os.preadv`` / ``os.pwritev``; on
``aio`` the results of ``GlibcAio.transfer``: the store's handling above either is the same
code, and both paths turn the results into its errors.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np
import pytest

from torchrec_proactive.store import glibc_aio, row_file

Hook = Callable[[int, int], int]


@pytest.fixture(params=["threads", "aio"])
def io_backend(request, monkeypatch) -> str:
    if request.param == "aio" and not glibc_aio.available():
        pytest.skip("glibc's POSIX AIO is Linux/glibc only")
    monkeypatch.setenv("TORCHREC_PROACTIVE_DISK_IO", request.param)
    return request.param


def inject(monkeypatch, backend: str, read: Optional[Hook] = None, write: Optional[Hook] = None
           ) -> Callable[[], None]:
    """Injects the hooks; returns what ends the injection (the kernel's requests again)."""
    if backend == "threads":
        reals = {}
        for name, hook in (("preadv", read), ("pwritev", write)):
            if hook is None:
                continue
            real = reals[name] = getattr(os, name)

            def call(fd, buffers, offset, _real=real, _hook=hook):
                return _hook(offset, _real(fd, buffers, offset))

            monkeypatch.setattr(row_file.os, name, call)
        return lambda: [monkeypatch.setattr(row_file.os, n, f) for n, f in reals.items()] and None
    real_transfer = glibc_aio.GlibcAio.transfer

    def transfer(self, is_write, buffer, requests):
        err, got = real_transfer(self, is_write, buffer, requests)
        hook = write if is_write else read
        if hook is not None:
            for i, offset in enumerate(np.asarray(requests, dtype=np.int64).reshape(-1, 3)[:, 0].tolist()):
                if err[i] == 0:
                    try:
                        got[i] = hook(offset, int(got[i]))
                    except OSError as e:
                        err[i], got[i] = e.errno, -1
        return err, got

    monkeypatch.setattr(glibc_aio.GlibcAio, "transfer", transfer)
    return lambda: monkeypatch.setattr(glibc_aio.GlibcAio, "transfer", real_transfer)
