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
    assert role.num_replicas == 2 and role.entrypoint == "bash"
    cmd = role.args[-1]
    assert "torchrun" in cmd and "--nnodes 2" in cmd and "--nproc_per_node 4" in cmd
    assert cmd.endswith("-m torchrec_proactive.cli train experiment=ci_tiny train.batch_size=32")
    assert role.env["NCCL_DEBUG"] == "INFO"


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
