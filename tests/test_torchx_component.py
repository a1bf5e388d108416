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
    # the result is the job's last line (torchx's own status lines aside), as `train --help` says
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("train/0 ")]
    assert lines and lines[-1].startswith("train/0 [0]:{"), lines[-3:]
    assert json.loads(lines[-1].split(":", 1)[1])["steps"] == 8
    # under torchrun (no Hydra record) rank 0 keeps the launch's overrides and config
    assert "train.max_steps=8" in (out / "launches" / "001" / "overrides.yaml").read_text()
    assert (out / "launches" / "001" / "config.yaml").is_file()
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


def test_kubernetes_spec_has_the_resources_volumes_and_rendezvous() -> None:
    """Kubernetes stays a dry run (no cluster here): the Volcano job torchx would submit has
    one task per node with its GPUs, CPUs and memory, the data and checkpoint volumes, and a
    c10d rendezvous every node points at the first node's pod."""
    pytest.importorskip("kubernetes", reason="torchx's Kubernetes scheduler needs the kubernetes client "
                                             "(requirements: kubernetes==25.3.0)")
    from kubernetes.client import ApiClient
    from torchx.schedulers.kubernetes_scheduler import create_scheduler

    app = train("experiment=kaggle_proactive", "data.root=/data/criteo", "train.output_dir=/ckpt/run1", j="2x8",
                gpu=8, cpu=32, memMB=256000, image="registry/proactive:1", max_restarts=1, rdzv_port=29501,
                mounts=["type=bind", "src=/mnt/criteo", "dst=/data", "type=volume", "src=ckpt-pvc", "dst=/ckpt"])
    info = create_scheduler("test").submit_dryrun(app, cfg={"queue": "default"})
    job = ApiClient().sanitize_for_serialization(info.request.resource)
    assert job["kind"] == "Job" and job["spec"]["queue"] == "default"
    tasks = job["spec"]["tasks"]
    assert [t["name"] for t in tasks] == ["train-0", "train-1"] and all(t["replicas"] == 1 for t in tasks)
    # c10d rendezvous on the first node's pod: it hosts the store (TORCHX_RANK0_HOST=localhost);
    # the others reach it by the host list Volcano's svc plugin sets for task train-0
    assert "svc" in job["spec"]["plugins"]
    endpoint_vars = ["TORCHX_RANK0_HOST", "VC_TRAIN_0_HOSTS"]
    for task, var in zip(tasks, endpoint_vars):
        pod = task["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == "registry/proactive:1"
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "8" and limits["cpu"] == "32000m" and limits["memory"] == "256000M"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/data"]]["hostPath"]["path"] == "/mnt/criteo"
        assert volumes[mounts["/ckpt"]]["persistentVolumeClaim"]["claimName"] == "ckpt-pvc"
        command = container["command"][-1]
        assert command.startswith("torchrun --max-restarts 1 --rdzv_backend c10d "
                                  f"--rdzv_endpoint ${{{var}:=localhost}}:29501")
        assert "--nnodes 2 --nproc_per_node 8" in command
        assert command.endswith("-m torchrec_proactive.cli train experiment=kaggle_proactive data.root=/data/criteo "
                                "train.output_dir=/ckpt/run1")
        assert {"containerPort": 29501, "name": "c10d"} in container["ports"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env.get("TORCHX_RANK0_HOST") == ("localhost" if var == "TORCHX_RANK0_HOST" else None)
