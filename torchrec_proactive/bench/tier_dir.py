"""The scratch directory of ``bench --tier ssd``: made before anything heavy runs, removed
afterwards whatever happens (a finished run, an error, Ctrl-C, SIGTERM).

A bad ``--tier-dir`` is a user's mistake: one line naming the option and the path, exit 2,
before the bench imports torch or writes a byte. Stdlib only.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, List, Optional

__all__ = ["TierDirError", "TierDir", "terminate_as_interrupt", "filesystem_of", "MEMORY_FILESYSTEMS"]

#: Filesystems that keep files in memory: a table file there measures memory, not a disk.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")

OPTION = "--tier-dir"


class TierDirError(ValueError):
    """``--tier-dir`` cannot hold the bench's files: the one line to print."""


class TierDir:
    """A new directory for one run's table files, inside ``base`` (``--tier-dir``; default
    the system's temporary directory). ``base`` is created when missing (and removed again
    afterwards, with any parents created for it, when empty). :meth:`remove` deletes the
    run's directory and everything in it; it is idempotent.

    Raises :class:`TierDirError` (one line naming the option and the path) when ``base``
    cannot be created or written."""

    def __init__(self, base: Optional[os.PathLike | str] = None) -> None:
        self.given = base is not None
        self.base = Path(base) if base is not None else Path(tempfile.gettempdir())
        self._created: List[Path] = []  # directories made for ``base``, deepest last
        self._make_base()
        try:
            self.path = Path(tempfile.mkdtemp(prefix="torchrec-proactive-ssd-", dir=self.base))
        except OSError as e:
            self._remove_created()
            raise self._error(f"cannot be written ({e.strerror or e})") from None

    def _error(self, why: str) -> TierDirError:
        name = OPTION if self.given else "the temporary directory (set --tier-dir or TMPDIR)"
        return TierDirError(f"{name} {self.base}: {why}")

    def _make_base(self) -> None:
        base = self.base
        if base.is_dir():
            if not os.access(base, os.W_OK | os.X_OK):
                raise self._error("cannot be written (permission denied)")
            return
        if base.exists():
            raise self._error("is not a directory")
        missing: List[Path] = []
        p = base
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        try:
            base.mkdir(parents=True)
        except OSError as e:
            raise self._error(f"cannot be created ({e.strerror or e})") from None
        self._created = list(reversed(missing))

    def _remove_created(self) -> None:
        for d in reversed(self._created):
            try:
                d.rmdir()  # only when empty: someone else's files stay
            except OSError:
                break
        self._created = []

    def remove(self) -> bool:
        """Deletes the run's directory (and ``base`` where this made it, when empty);
        returns whether the run's directory is gone."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._remove_created()
        return not self.path.exists()

    def free_bytes(self) -> int:
        """Bytes free on the directory's filesystem (for the user, not root)."""
        return shutil.disk_usage(self.path).free


def filesystem_of(path: os.PathLike | str) -> Optional[str]:
    """The type of the filesystem holding ``path`` (``/proc/mounts``: the longest mount point
    above it), or None where that cannot be read."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        return None
    return kind


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``KeyboardInterrupt`` in the main thread meanwhile, so that a killed
    bench unwinds through its ``finally`` blocks and removes its files as Ctrl-C does."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
