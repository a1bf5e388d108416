"""torchx components of torchrec-proactive (registered as ``proactive`` in setup.cfg).

    torchx run -s local_cwd proactive.train -j 1x2 experiment=ci_tiny
    torchx run -s slurm --scheduler_args partition=gpu proactive.train -j 2x8 --gpu 8 experiment=kaggle_proactive
    torchx run -s kubernetes --scheduler_args queue=default proactive.train -j 2x8 --gpu 8 --image <img> ...

Components are plain functions returning an ``AppDef``; torchx lints their source (typed
arguments, docstring), so annotations here stay runtime types (no ``from __future__``).
"""

from typing import Dict, List, Optional

import torchx
import torchx.components.dist as dist_components
from torchx import specs


def train(
    *script_args: str,
    j: str = "1x2",
    image: str = torchx.IMAGE,
    name: str = "proactive/dlrm",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 8192,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    max_restarts: int = 0,
    rdzv_port: int = 29500,
    mounts: Optional[List[str]] = None,
) -> specs.AppDef:
    """Trains DLRM/DCNv2 on Criteo with proactive cold-row fetching on ``nnodes x nproc_per_node`` ranks.

    Each node runs ``torchrun ... -m torchrec_proactive.cli train <script_args>``; every
    rank composes ``conf/`` with the same Hydra overrides (the run checks that they agree).
    The role is named ``train`` (Slurm jobs ``train-0``, ``train-1``, ...).

    Args:
        script_args: Hydra overrides, e.g. ``experiment=kaggle_proactive data.root=/data/criteo``
        j: ``{nnodes}x{nproc_per_node}`` (``[{min_nnodes}:]{nnodes}x{nproc_per_node}`` for elastic)
        image: container image (local_cwd ignores it and runs in the current directory)
        name: job name, ``{experiment}/{run}``
        cpu: CPUs per node
        gpu: GPUs per node (ranks per node should not exceed it)
        memMB: host memory per node in MB
        h: a registered named resource (wins over cpu, gpu and memMB)
        env: extra environment variables, e.g. ``NCCL_DEBUG=INFO``
        max_retries: scheduler retries of a failed job (resume with ``train.resume=true``)
        max_restarts: torchrun restarts of the whole worker group when a rank fails, in the
            same allocation (resume with ``train.resume=true``)
        rdzv_port: port of the c10d rendezvous on the first node (multi-node only)
        mounts: volumes, e.g. ``type=bind,src=/data,dst=/data`` (see the scheduler's docs)
    """
    app = dist_components.ddp(
        "train",
        *script_args,
        m="torchrec_proactive.cli",
        j=j,
        image=image,
        name=name,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        h=h,
        env=env,
        max_retries=max_retries,
        rdzv_port=rdzv_port,
        mounts=mounts,
    )
    (role,) = app.roles
    role.name = "train"  # ddp names the role after the module (``cli``)
    if max_restarts:
        # ddp has no knob for torchrun's --max-restarts; its command is ``bash -c "torchrun ..."``
        flag, command = role.args
        if not command.startswith("torchrun "):
            raise RuntimeError(f"torchx's ddp component changed: its command starts {command[:40]!r}, not torchrun")
        role.args = [flag, command.replace("torchrun ", f"torchrun --max-restarts {max_restarts} ", 1)]
    return app
