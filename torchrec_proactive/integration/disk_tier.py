"""Tables planned ``key_value`` (TorchRec's SSD vocabulary), served from the three-tier store.

A user plans a table larger than host memory as stock TorchRec would offload it to SSD::

    ParameterConstraints(compute_kernels=["key_value"],
                         key_value_params=KeyValueParams(ssd_storage_directory="/mnt/nvme",
                                                         l2_cache_size=4))

and the proactive sharder serves it from one :class:`TieredTable` per lookup group: a device
cache (the plan's ``CacheParams(load_factor=...)``) over a bounded DRAM host cache (TorchRec's
``l2_cache_size``, in GB per group, or this project's finer per-table
``host_cache_bytes``) over a file of the shard's rows under ``ssd_storage_directory``.

This module only turns the plan's words into a :class:`DiskTierSpec` per table and a place
for each group's file; the store does the rest (``TieredTable.on_disk``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

from torchrec.distributed.embedding_types import EmbeddingComputeKernel

from ..store.row_file import DiskTierError

_LOG = logging.getLogger(__name__)

KEY_VALUE = EmbeddingComputeKernel.KEY_VALUE.value
#: A group's host cache when neither ``l2_cache_size`` nor ``host_cache_bytes`` gives one
#: (at most the group's own bytes).
DEFAULT_HOST_CACHE_BYTES = 1 << 30
#: The key this project adds to a disk table's fused params so that TorchRec's grouping keeps
#: tables of different directories (or on disk and in DRAM) in different groups; removed
#: before any kernel sees the params.
GROUP_KEY = "proactive_disk_directory"


@dataclass(frozen=True)
class DiskTierSpec:
    """Where a table's rows live when it is planned ``key_value``.

    Attributes:
        directory: the plan's ``ssd_storage_directory`` (``@local_rank`` replaced by the
            rank's local rank, TorchRec's convention). Each group's file goes in a fresh
            sub-directory of it, removed when the module is closed or collected.
        host_cache_bytes: this table's share of its group's host cache (the sharder's
            ``host_cache_bytes``), or None.
        l2_cache_gb: the plan's ``l2_cache_size`` (GB, per group, TorchRec's meaning), or None.
    """

    directory: str
    host_cache_bytes: Optional[int] = None
    l2_cache_gb: Optional[float] = None


def spec_from_plan(table: str, key_value_params: Any, host_cache_bytes: Optional[int]) -> DiskTierSpec:
    """The spec of a table the plan put on ``key_value``; one clear line when the plan
    cannot say where its rows go."""
    directory = getattr(key_value_params, "ssd_storage_directory", None)
    if not directory:
        raise ValueError(
            f"table '{table}': planned {KEY_VALUE!r} without a directory for its rows; give "
            f"ParameterConstraints(key_value_params=KeyValueParams(ssd_storage_directory=DIR))")
    if host_cache_bytes is not None and int(host_cache_bytes) < 1:
        raise ValueError(f"table '{table}': host_cache_bytes={host_cache_bytes} must be >= 1")
    l2 = getattr(key_value_params, "l2_cache_size", None)
    return DiskTierSpec(str(directory), None if host_cache_bytes is None else int(host_cache_bytes),
                        None if l2 is None else float(l2))


def resolve_directory(directory: str, local_rank: int) -> Path:
    """TorchRec's ``@local_rank`` placeholder, filled in."""
    return Path(directory.replace("@local_rank", str(local_rank)))


def host_cache_need(refusal: str) -> Optional[Tuple[int, int]]:
    """``(bytes, tables)`` from the store's refusal of a group's host cache (``"table 'a+b':
    ... give the host cache at least R rows (B bytes)"``): the bytes the group's one host
    cache needs, and how many tables share it (the store is named after them, joined by
    '+'); None where the message gives no size."""
    need = re.search(r"at least \d+ rows \((\d+) bytes\)", refusal)
    if need is None:
        return None
    store = re.search(r"table '([^']+)'", refusal)
    return int(need.group(1)), len(store.group(1).split("+")) if store else 1


def host_cache_advice(refusal: str) -> str:
    """What to set when a group's host cache was too small, from the store's refusal: the
    sharder's ``host_cache_bytes`` is per table, and a group's host cache is its tables'
    shares summed."""
    advice = "raise host_cache_bytes (or KeyValueParams.l2_cache_size)"
    need = host_cache_need(refusal)
    if need is None:
        return advice
    total, n = need
    if n == 1:
        return f"{advice} to at least {total} bytes (leave headroom: batches vary)"
    return (f"{advice} to at least {-(-total // n)} bytes for each of its {n} tables (a group's host cache is "
            f"its tables' shares summed; leave headroom: batches vary)")


def group_host_cache_bytes(specs: Mapping[str, DiskTierSpec]) -> int:
    """A group's host cache: the sum of its tables' ``host_cache_bytes`` when every table
    gives one; else the plan's ``l2_cache_size`` (GB per group, as TorchRec reads it; 0 or
    unset: the default); else ``DEFAULT_HOST_CACHE_BYTES``. The store holds at most the
    group's rows whatever is given."""
    values = list(specs.values())
    if values and all(s.host_cache_bytes is not None for s in values):
        want = sum(int(s.host_cache_bytes or 0) for s in values)
    elif any(s.l2_cache_gb for s in values):
        want = int(max(s.l2_cache_gb or 0 for s in values) * (1 << 30))
    else:
        want = DEFAULT_HOST_CACHE_BYTES
    return max(1, want)


class ScratchDirectory:
    """A fresh directory for one group's file under the plan's directory, removed at
    :meth:`remove` (idempotent). Creating it is where a missing or unwritable directory is
    found: one line naming the table and the path.

    It names its owner (host and process id) in :attr:`OWNER_FILE`, so that the directories
    of ranks killed before they could remove theirs (SIGKILL, a lost node) are removed by
    the next process that makes one under the same parent on the same host; directories of
    live processes, of other hosts (a shared filesystem) and without an owner are left."""

    OWNER_FILE = ".torchrec-proactive-owner"

    def __init__(self, parent: Path, tables: str, rank: int) -> None:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            _remove_orphans(parent)
            self.path = Path(tempfile.mkdtemp(prefix=f"rank{rank}-", dir=parent))
            (self.path / self.OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        except OSError as e:
            raise DiskTierError(f"table '{tables}': cannot create its rows' directory under {parent}: "
                                f"{e.strerror or e}") from None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __repr__(self) -> str:
        return f"ScratchDirectory({os.fspath(self.path)!r})"


def _remove_orphans(parent: Path) -> None:
    """Removes the scratch directories under ``parent`` whose owner ran on this host and no
    longer exists (see :class:`ScratchDirectory`), saying so once per directory."""
    host = socket.gethostname()
    for path in parent.glob("rank*-*"):
        try:
            owner_host, pid = (path / ScratchDirectory.OWNER_FILE).read_text().split()
            if owner_host != host or _alive(int(pid)):
                continue
        except (OSError, ValueError):
            continue  # no owner file, or not ours to judge
        _LOG.warning("torchrec-proactive: removing %s, the disk tier's scratch directory of process %s on this "
                     "host, which ended without removing it", path, pid)
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # (another user's live process)
    return True
