"""Rank-side code of the optimizer-semantics tests against stock TorchRec (importable by
spawned ranks): the same model, batches and fused params through stock TorchRec's fused
kernel (FBGEMM's CPU TBE) and through proactive tables, compared loss for loss and row for row."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from torchrec import EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.embedding_configs import DataType

from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveTrainPipeline
from torchrec_proactive.planning import build_plan, combined_optimizer, shard_model

from .exactness_worker import _params, _run
from .sparse_model import SparseModel, make_batch


def _tables(data_type: str, rows: int = 400) -> List[EmbeddingBagConfig]:
    dtype = {"fp32": DataType.FP32, "fp16": DataType.FP16}[data_type]
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows,
                           feature_names=[f"f{i}"] + (["f0_b"] if i == 0 else []), data_type=dtype)
        for i in range(3)
    ]


def _build(sharder, sharding: str, kernel: str, tables, seed_state, lr_gamma: Optional[float]):
    torch.manual_seed(0)
    model = SparseModel(tables)
    plan = build_plan(model, sharder, sharding, kernel=kernel)
    dmp = shard_model(model, sharder, plan, torch.device("cpu"))
    dmp.load_state_dict(copy.deepcopy(seed_state))
    opt = combined_optimizer(dmp, lambda params: torch.optim.SGD(params, lr=0.05))
    # A scheduler over the combined optimizer changes the fused tables' learning rate through
    # their param groups, as TorchRec users do.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=lr_gamma) if lr_gamma else None
    return dmp, opt, sched


def _train(pipeline, batches, sched, opt=None, hyper: Optional[Dict[str, float]] = None) -> List[torch.Tensor]:
    """The logits of every step (what a TorchRec pipeline's ``progress`` returns); ``hyper``
    goes to ``opt.update_hyper_parameters`` after the fourth step."""
    it = iter(batches)
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(it).detach().clone())
        except StopIteration:
            return outputs
        if sched is not None:
            sched.step()
        if hyper and len(outputs) == 4:
            opt.update_hyper_parameters(dict(hyper))


def train_vs_stock(rank: int, world_size: int, fused: Dict[str, Any], data_type: str = "fp32",
                   sharding: str = "table_wise", steps: int = 10, load_factor: float = 0.1, depth: int = 2,
                   lr_gamma: Optional[float] = None, hyper: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    """Trains stock TorchRec and proactive tables on the same batches; returns the largest difference of any step's logits, of any table entry (and of any fused optimizer state entry)."""
    tables = _tables(data_type)
    torch.manual_seed(123)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_batch(tables, 24, seed=1000 * rank + i) for i in range(steps)]
    # Stock TorchRec wants FBGEMM's enums (the test passes plain values across processes).
    fused = dict(fused, optimizer=EmbOptimType(fused["optimizer"]))
    if "weight_decay_mode" in fused:
        fused["weight_decay_mode"] = WeightDecayMode(int(fused["weight_decay_mode"]))

    stock = EmbeddingBagCollectionSharder(fused_params=dict(fused))
    dmp, opt, sched = _build(stock, sharding, "fused", tables, seed_state, lr_gamma)
    stock_out = _train(TrainPipelineSparseDist(dmp, opt, torch.device("cpu")), batches, sched, opt, hyper)
    stock_params = _params(dmp)
    stock_state = _flat_state(opt)
    stock_lr = [g["lr"] for g in opt.param_groups]

    sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), cache_load_factor=load_factor,
                                                      debug_checks=True)
    dmp, opt, sched = _build(sharder, sharding, "fused_uvm_caching", tables, seed_state, lr_gamma)
    out = _train(ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth), batches, sched, opt,
                 hyper)
    params = _params(dmp)
    state = _flat_state(opt)
    dmp.module.ebc.check_invariants(expect_drained=True)
    table_keys = [k for k in stock_params if "embedding_bags" in k]
    return {
        "rank": rank,
        "steps": len(out),
        "out_diff": max(float((a - b).abs().max()) for a, b in zip(out, stock_out)),
        "same_keys": sorted(params) == sorted(stock_params) and sorted(state) == sorted(stock_state),
        "dtypes": sorted({str(params[k].dtype) for k in table_keys}),
        "stock_dtypes": sorted({str(stock_params[k].dtype) for k in table_keys}),
        "table_diff": max(float((params[k].float() - stock_params[k].float()).abs().max()) for k in table_keys),
        "state_diff": max([float((state[k].float() - stock_state[k].float()).abs().max()) for k in stock_state] or [0.0]),
        "eps": [k.optimizer_config.eps for k in dmp.module.ebc.proactive_kernels],
        "lrs": [g["lr"] for g in opt.param_groups],
        "stock_lrs": stock_lr,
    }


def _flat_state(opt) -> Dict[str, torch.Tensor]:
    """Every tensor of the fused optimizer's state (ShardedTensors as their local shards)."""
    out: Dict[str, torch.Tensor] = {}
    for key, entry in opt.state_dict()["state"].items():
        if not isinstance(entry, dict):
            continue
        for name, value in entry.items():
            if not torch.is_tensor(value) or "embedding_bags" not in str(key):
                continue
            shards = value.local_shards() if hasattr(value, "local_shards") else None
            if shards is None:
                out[f"{key}.{name}"] = value.detach().clone()
            else:
                for i, s in enumerate(shards):
                    out[f"{key}.{name}#{i}"] = s.tensor.detach().clone()
    return out


def adam_counter(rank: int, world_size: int, eval_between: bool) -> Dict[str, Any]:
    """Two training steps with Adam, and between them either an eval forward (run A) or
    ``set_optimizer_step(2)`` (run B). FBGEMM advances the step counter on every forward, so
    both runs take their second update at step 3 and must end with the same tables."""
    tables = _tables("fp32")
    torch.manual_seed(123)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_batch(tables, 24, seed=1000 * rank + i) for i in range(3)]
    sharder = ProactiveEmbeddingBagCollectionSharder(
        fused_params={"optimizer": "adam", "learning_rate": 0.05, "eps": 1e-8, "weight_decay": 0.1},
        cache_load_factor=0.5)
    dmp, opt, _ = _build(sharder, "table_wise", "fused_uvm_caching", tables, seed_state, None)
    loss, _ = dmp(batches[0])
    loss.backward()
    if eval_between:
        dmp.eval()
        with torch.no_grad():
            dmp(batches[2])
        dmp.train()
    else:
        opt.set_optimizer_step(2)
    loss, _ = dmp(batches[1])
    loss.backward()
    kernels = dmp.module.ebc._proactive_kernels  # noqa: SLF001 - test inspection
    # Plain lists: tensors sent through the result queue need the rank alive until received.
    return {"params": {k: v.tolist() for k, v in _params(dmp).items()}, "steps": [k.store.step for k in kernels]}
