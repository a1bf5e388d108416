"""The torchx component: it builds the expected AppDef, torchx finds it next to its own
builtins, and ``torchx run -s local_cwd`` launches a tiny 2-rank job that succeeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchx import specs
from torchx.specs.finder import get_component, get_components

from torchrec_proactive.components import train

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # torchx and torchrun of this environment


def test_component_builds_appdef() -> None:
    app = train("experiment=ci_tiny", "train.batch_size=32", j="2x4", env={"NCCL_DEBUG": "INFO"})
    assert isinstance(app, specs.AppDef)
    (role,) = app.roles
    assert role.name == "train", "the role (and the Slurm jobs train-0, train-1) is named after what it does"
    assert role.num_replicas == 2 and role.entrypoint == "bash"
    cmd = role.args[-1]
    assert "torchrun" in cmd and "--nnodes 2" in cmd and "--nproc_per_node 4" in cmd
    assert cmd.endswith("-m torchrec_proactive.cli train experiment=ci_tiny train.batch_size=32")
    assert role.env["NCCL_DEBUG"] == "INFO"


def test_component_max_restarts_reaches_torchrun() -> None:
    (role,) = train("experiment=ci_tiny", j="2x1", max_restarts=2).roles
    assert role.args[-1].startswith("torchrun --max-restarts 2 --rdzv_backend c10d")
    (role,) = train("experiment=ci_tiny", j="2x1").roles
    assert "--max-restarts" not in role.args[-1]


def test_component_is_registered_next_to_builtins() -> None:
    names = set(get_components())
    assert "proactive.train" in names
    assert {"dist.ddp", "utils.echo"} <= names, "registering ours must not hide torchx's builtins"
    assert get_component("proactive.train").fn is train


@pytest.mark.multiprocess
def test_torchx_local_cwd_runs_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1")
    cmd = [
        str(BIN / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}",
        "proactive.train", "-j", "1x2",
        "experiment=ci_tiny", f"data.root={tmp_path / 'data'}", f"train.output_dir={out}",
        "train.epochs=1", "train.max_steps=8",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "SUCCEEDED" in log, log
    for rank in (0, 1):
        records = [json.loads(line) for line in (out / f"rank_{rank}" / "metrics.jsonl").read_text().splitlines()]
        assert max(r["step"] for r in records if r["kind"] == "step") == 8
        assert any(r["kind"] == "eval" for r in records)
    manifest = json.loads((out / "checkpoints" / "step_00000008" / "MANIFEST.json").read_text())
    # A torch.distributed.checkpoint directory written by both ranks (their per-rank values
    # in the manifest, the tensors in DCP's files).
    assert manifest["world_size"] == 2 and len(manifest["ranks"]) == 2
    assert (out / "checkpoints" / "step_00000008" / ".metadata").is_file()


@pytest.mark.multiprocess
def test_torchx_shows_the_root_cause_of_a_failed_rank(tmp_path: Path) -> None:
    """The one-line config error is what torchx reports (torchelastic's error file), not
    torchrun's ``ChildFailedError`` with ``structured_error_msg: <NONE>``."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1")
    cmd = [
        str(BIN / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}",
        "proactive.train", "-j", "1x1", "experiment=ci_tiny", f"train.output_dir={tmp_path / 'run'}",
        "prefetch.detph=4",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    # torchx's status: the rank's one line as the structured error (was <NONE>)
    structured = log[log.index("structured_error_msg:"):]
    assert "prefetch.detph is not a config key" in " ".join(structured.split()), log[-4000:]
    # torchrun's summary, which is what a Slurm job's log shows: the line as the root cause
    root_cause = log[log.index("Root Cause (first observed failure)"):]
    assert "traceback : torchrec-proactive train: error: prefetch.detph is not a config key" in root_cause, log[-4000:]
    assert "train/0 " in log, "the role is named train"
