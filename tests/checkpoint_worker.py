"""Rank-side code of the resharding checkpoint tests (importable by spawned ranks): a
proactive DLRM-style model trained and saved with the app's ``Checkpointer`` on one world
size, loaded on another, compared table by table and state entry by state entry."""

from __future__ import annotations

import copy
import logging
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_proactive import (
    ProactiveEmbeddingBagCollectionSharder,
    ProactiveEmbeddingCollectionSharder,
    ProactiveTrainPipeline,
)
from torchrec_proactive.app.checkpoint import Checkpointer, restore_param_groups
from torchrec_proactive.planning import build_plan, combined_optimizer, shard_model

from .sequence_model import SequenceModel, make_pooled_tables, make_sequence_batch, make_sequence_tables
from .sparse_model import SparseModel, make_batch, make_tables

FUSED = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
         "adam": EmbOptimType.ADAM}


def _model(world_size: int, optimizer: str, sharding: str, seed: int, model: str = "sparse"):
    """A proactive model and its optimizer; ``model="sequence"``: sequence tables (an
    EmbeddingCollection) beside pooled ones, each with its proactive sharder."""
    fused = {"optimizer": FUSED[optimizer], "learning_rate": 0.05, "eps": 1e-3}
    if model == "sequence":
        tables = (make_sequence_tables(), make_pooled_tables())
        torch.manual_seed(seed)
        net = SequenceModel(*tables)
        sharder = [ProactiveEmbeddingCollectionSharder(fused_params=dict(fused), cache_load_factor=0.1),
                   ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), cache_load_factor=0.1)]
    else:
        tables = make_tables(4, rows=300, dim=8, shared_feature=True)
        torch.manual_seed(seed)
        net = SparseModel(tables)
        sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=fused, cache_load_factor=0.1)
    dmp = shard_model(net, sharder, build_plan(net, sharder, sharding), torch.device("cpu"))
    # Adam keeps dense state (created lazily, at the first step).
    opt = combined_optimizer(dmp, lambda params: torch.optim.Adam(params, lr=0.01))
    return tables, dmp, opt


def _whole(state: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """Every tensor of a (nested) state dict as one whole array on every rank: the local
    shards of each ShardedTensor gathered from all ranks (one collective, so ranks that list
    their keys in another order still agree) and put at their offsets."""
    plain: Dict[str, np.ndarray] = {}
    shards: Dict[str, Any] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}.{k}" if prefix else str(k), v)
        elif hasattr(value, "local_shards"):
            shards[prefix] = (tuple(value.size()), [(list(s.metadata.shard_offsets), s.tensor.detach().numpy().copy())
                                                    for s in value.local_shards()])
        elif isinstance(value, torch.Tensor):
            plain[prefix] = value.detach().numpy().copy()

    visit("", state)
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shards)
    out = dict(plain)
    for rank_shards in everyone:
        for key, (size, pieces) in rank_shards.items():
            for offsets, array in pieces:
                full = out.setdefault(key, np.zeros(size, dtype=array.dtype))
                full[tuple(slice(o, o + n) for o, n in zip(offsets, array.shape))] = array
    return out


def _state(dmp, opt) -> Dict[str, Any]:
    opt.save_param_groups(True)  # the app's checkpoints carry them (lr ...) when the optimizer gives them
    sd = opt.state_dict()
    return {"model": dmp.state_dict(), "optimizer": dict(sd)}


def save(rank: int, world_size: int, root: str, optimizer: str, sharding: str, model: str = "sparse") -> Dict[str, Any]:
    tables, dmp, opt = _model(world_size, optimizer, sharding, seed=0, model=model)
    pipeline = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    make = (lambda i: make_sequence_batch(*tables, 16, seed=100 * rank + i)) if model == "sequence" else (
        lambda i: make_batch(tables, 16, seed=100 * rank + i))
    batches = iter([make(i) for i in range(5)])
    while True:
        try:
            pipeline.progress(batches)
        except StopIteration:
            break
    state = _state(dmp, opt)
    payload = {"model": state["model"], "optimizer": {"state": state["optimizer"]["state"]},
               "param_groups": state["optimizer"]["param_groups"], "position": {"step": 5}, "rng": {"x": rank}}
    ck = Checkpointer(root, rank, world_size, keep=2, log=logging.getLogger("ckpt"))
    path = ck.save(5, payload, {"config": {"model.dim": 8}}, per_rank=("param_groups", "rng"))
    return {"path": str(path), "whole": _whole(_state(dmp, opt)), "num_entries": len(state["optimizer"]["state"]),
            "empty_entries": sum(1 for v in state["optimizer"]["state"].values() if isinstance(v, dict) and not v)}


def load(rank: int, world_size: int, path: str, optimizer: str, sharding: str, model: str = "sparse") -> Dict[str, Any]:
    # Another initialisation, so that only the checkpoint can make the tables equal.
    _, dmp, opt = _model(world_size, optimizer, sharding, seed=7, model=model)
    ck = Checkpointer(path.rsplit("/", 1)[0], rank, world_size, keep=2, log=logging.getLogger("ckpt"))
    opt.init_state()  # Adam's dense state exists only after a step (the Trainer does the same)
    opt.zero_grad()
    template = _state(dmp, opt)
    state = ck.load(path, {"model.dim": 8}, "cpu", template=template)
    dmp.load_state_dict(state["model"])
    optim = template["optimizer"]
    optim["param_groups"] = restore_param_groups(optim["param_groups"],
                                                 [r["param_groups"] for r in state["saved_ranks"]])
    opt.load_state_dict(optim)
    return {"whole": _whole(_state(dmp, opt)), "position": state["position"], "rng": state["rng"]}


def save_each(rank: int, world_size: int, root: str, optimizers: List[str], sharding: str) -> Dict[str, Any]:
    """:func:`save` once per fused optimizer, each into ``root/<optimizer>`` (one launch)."""
    return {name: save(rank, world_size, f"{root}/{name}", name, sharding) for name in optimizers}


def load_each(rank: int, world_size: int, paths: Dict[str, str], sharding: str) -> Dict[str, Any]:
    """:func:`load` of each ``{optimizer: checkpoint}`` into a model sharded ``sharding``; a
    refusal (a user error, raised on every rank alike) is returned as ``{"refused": message}``."""
    from torchrec_proactive.app.errors import UserError

    out: Dict[str, Any] = {}
    for name, path in paths.items():
        try:
            out[name] = load(rank, world_size, path, name, sharding)
        except UserError as e:
            out[name] = {"refused": str(e)}
    return out


def save_then_load_each(rank: int, world_size: int, root: str, optimizers: List[str], save_sharding: str,
                        load_sharding: str) -> Dict[str, Any]:
    """:func:`save_each` sharded ``save_sharding``, then :func:`load_each` of those checkpoints
    sharded ``load_sharding``, in one launch (starting ranks costs more than the case); with
    ``snapshots``: what the files under ``root`` were after the save and after the loads
    (rank 0, every rank past the same point), for a check that loading writes nothing."""
    import hashlib
    from pathlib import Path

    import torch.distributed as dist

    def snapshot() -> Dict[str, str]:
        dist.barrier()
        files = sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.name.endswith(".log"))
        out = {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() for p in files} if rank == 0 else {}
        dist.barrier()
        return out

    saved = save_each(rank, world_size, root, optimizers, save_sharding)
    before = snapshot()
    loaded = load_each(rank, world_size, {name: res["path"] for name, res in saved.items()}, load_sharding)
    return {"saved": saved, "loaded": loaded, "snapshots": (before, snapshot())}


def app_run(rank: int, world_size: int, root: str, out: str, overrides: List[str]) -> Dict[str, Any]:
    """``torchrec-proactive train`` on this rank (the DLRM example app), then the whole tables
    and optimizer state of its last checkpoint."""
    from pathlib import Path

    from torchrec_proactive.app.entry import rank_main

    base = ["experiment=ci_tiny", f"data.root={root}/data", "optimizer=adam", "optimizer.embedding_lr=0.02",
            "optimizer.dense_lr=0.005", f"train.output_dir={root}/{out}"]
    summary = rank_main(rank, world_size, "train", base + overrides)
    reader = Checkpointer(Path(root), rank, world_size, keep=2, log=logging.getLogger("test"))
    saved = reader.load(Path(summary["last_checkpoint"]), None, "cpu")  # whole tensors
    return {"summary": summary,
            "whole": {k: v.numpy().copy() for k, v in _flat({"model": saved["model"],
                                                              "optimizer": saved["optimizer"]}).items()}}


def _flat(state: Dict[str, Any], prefix: str = "") -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def app_resume_loads(rank: int, world_size: int, root: str, out: str) -> Dict[str, Any]:
    """Resumes the app's run in ``out`` with this world size, stopping right after the load
    (max_steps = the checkpoint's step: nothing trains), and returns the live model's and
    optimizer's whole tensors as the Trainer loaded them."""
    from torchrec_proactive.app.compose import compose_config
    from torchrec_proactive.app.train import build_run

    base = ["experiment=ci_tiny", f"data.root={root}/data", "optimizer=adam", "optimizer.embedding_lr=0.02",
            "optimizer.dense_lr=0.005", f"train.output_dir={root}/{out}", "train.resume=true"]
    trainer = build_run(compose_config(base))
    trainer.resume()
    return {"step": trainer.pos.step,
            "whole": _whole({"model": trainer.dmp.state_dict(),
                             "optimizer": {"state": trainer.optimizer.state_dict()["state"]}})}
