"""The disk tier's scratch directories: a rank killed before it could remove its directory
(SIGKILL, a lost node's process) leaves it behind; the next run on the same host removes the
directories of processes that no longer exist, and nothing else."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from torchrec_proactive.integration.disk_tier import ScratchDirectory


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_directories_of_dead_processes_on_this_host_are_removed(tmp_path: Path) -> None:
    host = socket.gethostname()
    killed = tmp_path / "rank0-killed"
    killed.mkdir()
    (killed / "t0.rows").write_bytes(b"\0" * 4096)
    (killed / ScratchDirectory.OWNER_FILE).write_text(f"{host} {_dead_pid()}\n")
    alive = tmp_path / "rank1-alive"
    alive.mkdir()
    (alive / ScratchDirectory.OWNER_FILE).write_text(f"{host} {os.getpid()}\n")
    elsewhere = tmp_path / "rank0-other-host"  # (a shared filesystem: another host's process)
    elsewhere.mkdir()
    (elsewhere / ScratchDirectory.OWNER_FILE).write_text(f"not-{host} {_dead_pid()}\n")
    unknown = tmp_path / "rank0-no-owner"  # not made by ScratchDirectory: not ours to judge
    unknown.mkdir()
    user_dir = tmp_path / "data"
    user_dir.mkdir()

    scratch = ScratchDirectory(tmp_path, "t0", rank=0)
    assert not killed.exists()
    assert alive.exists() and elsewhere.exists() and unknown.exists() and user_dir.exists()
    assert (scratch.path / ScratchDirectory.OWNER_FILE).read_text().split() == [host, str(os.getpid())]
    scratch.remove()
    assert not scratch.path.exists()
