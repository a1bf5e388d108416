"""`kill -9` in the middle of a checkpoint write leaves the previous checkpoint loadable."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchrec_proactive.app.checkpoint import Checkpointer

WRITER = r"""
import os, sys, torch, torch.distributed as dist, logging
from pathlib import Path
from torchrec_proactive.app.checkpoint import Checkpointer
from torchrec_proactive.launch import free_port
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
ck = Checkpointer(Path(sys.argv[1]), rank=0, world_size=1, keep=3, log=logging.getLogger("w"))
step = 0
while True:
    step += 1
    # ~64 MB per save, so a kill lands inside a write most of the time
    payload = {"step": step, "weights": torch.full((16 * 1024 * 1024,), float(step))}
    ck.save(step, payload, {"config": {}})
    print(f"SAVED {step}", flush=True)
"""


@pytest.mark.parametrize("delay_s", [0.02, 0.11, 0.23, 0.37])
def test_kill_9_during_checkpoint_write_keeps_previous_checkpoint(tmp_path: Path, delay_s: float):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        saved = 0
        while saved < 1:  # at least one complete checkpoint first
            line = proc.stdout.readline()
            assert line, "writer died before its first checkpoint"
            if line.startswith("SAVED"):
                saved = int(line.split()[1])
        time.sleep(delay_s)  # somewhere inside the next save
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    ck = Checkpointer(tmp_path, rank=0, world_size=1, keep=3, log=logging.getLogger("t"))
    latest = ck.latest()
    assert latest is not None, "the previous complete checkpoint must survive"
    state = ck.load(latest, {}, "cpu")
    assert state["step"] >= saved
    assert torch.equal(state["weights"], torch.full((16 * 1024 * 1024,), float(state["step"])))
