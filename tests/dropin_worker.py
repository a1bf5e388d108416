"""Rank-side code of the drop-in tests (issue #9): a TorchRec job written the TorchRec way.

Models, plans and optimizers are built the way TorchRec users build them (an
``EmbeddingBagCollection`` inside an ``nn.Module``, ``construct_module_sharding_plan`` or
the planner, ``DistributedModelParallel``, ``CombinedOptimizer`` of ``model.fused_optimizer``
and a ``KeyedOptimizerWrapper``), then run once with stock TorchRec and once with the
plugin, swapping only the sharder and the pipeline class.

Each ``check_*`` function returns plain observations (numbers, booleans, error strings);
the assertions live in tests/test_dropin.py. ``run_checks`` runs several checks in one
launch (spawning ranks costs ~10 s on the CI machine) and reports each one's outcome
separately, so one broken check does not hide the others.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import CacheParams, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveTrainPipeline
from torchrec_proactive.fetch import LinkModel

DEV = torch.device("cpu")
LR = 0.05
DENSE = 4
SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8}
RW_ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8}


# ---------------------------------------------------------------------- a user's model
def tables(n: int = 2, rows: int = 200, dim: int = 8, pooling: PoolingType = PoolingType.SUM,
           prefix: str = "t", feature_prefix: str = "f") -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"{prefix}{i}", embedding_dim=dim, num_embeddings=rows,
                           feature_names=[f"{feature_prefix}{i}"], pooling=pooling)
        for i in range(n)
    ]


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return torch.full_like(g, float("nan"))


class Model(nn.Module):
    """Sparse arch (one or two EBCs) + a linear over-arch; ``forward(Batch) -> (loss, logits)``.

    With two EBCs both receive the batch's whole KJT (TorchRec routes each its features).
    ``nan_grad_feature`` poisons the gradient of one feature's pooled embedding.
    """

    def __init__(self, configs: List[EmbeddingBagConfig], second: Optional[List[EmbeddingBagConfig]] = None,
                 device: torch.device = DEV) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(tables=configs, device=device)
        self.sparse_b = EmbeddingBagCollection(tables=second, device=device) if second else None
        cfgs = configs + (second or [])
        self.features = [f for c in cfgs for f in c.feature_names]
        width = sum(c.embedding_dim * len(c.feature_names) for c in cfgs) + DENSE
        self.over = nn.Linear(width, 1, device=device)
        self.nan_grad_feature: Optional[str] = None

    def forward(self, batch: Batch):
        pooled = self.sparse(batch.sparse_features).to_dict()
        if self.sparse_b is not None:
            pooled.update(self.sparse_b(batch.sparse_features).to_dict())
        parts = []
        for f in self.features:
            x = pooled[f]
            if f == self.nan_grad_feature:
                x = _NanGrad.apply(x)
            parts.append(x)
        logits = self.over(torch.cat(parts + [batch.dense_features], dim=1)).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def batch(configs: List[EmbeddingBagConfig], size: int, seed: int, max_len: int = 3) -> Batch:
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for c in configs:
        for f in c.feature_names:
            l = torch.randint(0, max_len + 1, (size,), generator=g)
            keys.append(f)
            lengths.append(l)
            values.append(torch.randint(0, c.num_embeddings, (int(l.sum()),), generator=g))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return Batch(dense_features=torch.randn(size, DENSE, generator=g), sparse_features=kjt,
                 labels=torch.randint(0, 2, (size,), generator=g).float())


def batches(configs, n: int, rank: int, size: int = 8, base: int = 0) -> List[Batch]:
    return [batch(configs, size, seed=base + 1000 * rank + i) for i in range(n)]


# ---------------------------------------------------------------------- TorchRec-style setup
def per_table(kind: str, names: List[str], kernel: str) -> Dict[str, Any]:
    out = {}
    for i, n in enumerate(names):
        if kind == "table_wise":
            out[n] = table_wise(rank=i % 2, compute_kernel=kernel)
        elif kind == "table_wise_rank0":
            out[n] = table_wise(rank=0, compute_kernel=kernel)
        elif kind == "row_wise":
            out[n] = row_wise(compute_kernel=kernel)
        elif kind == "column_wise":
            out[n] = column_wise(ranks=[0, 1], compute_kernel=kernel)
        elif kind == "table_row_wise":
            out[n] = table_row_wise(host_index=0)
        else:
            raise ValueError(kind)
    return out


def module_plan(ebc: EmbeddingBagCollection, sharding: str, kernel: str, sharder, world_size: int,
                load_factor: Optional[float] = None):
    names = [c.name for c in ebc.embedding_bag_configs()]
    mp = construct_module_sharding_plan(ebc, per_param_sharding=per_table(sharding, names, kernel),
                                        sharder=sharder, local_size=world_size, world_size=world_size,
                                        device_type="cpu")
    for ps in mp.values():
        ps.compute_kernel = kernel  # table_row_wise() takes no kernel
        if load_factor is not None and kernel == "fused_uvm_caching":
            ps.cache_params = CacheParams(load_factor=load_factor)
    return mp


def sharder_for(side: str, fused: Optional[Dict[str, Any]], **kwargs: Any):
    if side == "stock":
        return EmbeddingBagCollectionSharder(fused_params=dict(fused) if fused else None)
    return ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused) if fused else None, **kwargs)


def kernel_for(side: str) -> str:
    return "fused" if side == "stock" else "fused_uvm_caching"


def build(side: str, model: Model, sharding: str, fused: Optional[Dict[str, Any]], world_size: int,
          seed_state: Optional[Dict[str, torch.Tensor]] = None, **sharder_kwargs: Any):
    """DMP + CombinedOptimizer, the way TorchRec's DLRM example builds them."""
    sharder = sharder_for(side, fused, **sharder_kwargs)
    plan = {"sparse": module_plan(model.sparse, sharding, kernel_for(side), sharder, world_size)}
    if model.sparse_b is not None:
        plan["sparse_b"] = module_plan(model.sparse_b, sharding, kernel_for(side), sharder, world_size)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   device=DEV, plan=ShardingPlan(plan), sharders=[sharder])
    if seed_state is not None:
        dmp.load_state_dict(copy.deepcopy(seed_state))
    return dmp, optimizer_for(dmp)


def optimizer_for(dmp: DistributedModelParallel) -> CombinedOptimizer:
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    return CombinedOptimizer([dmp.fused_optimizer, dense])


def pipeline_for(side: str, dmp, opt, depth: int = 2):
    if side == "stock":
        return TrainPipelineSparseDist(dmp, opt, DEV)
    return ProactiveTrainPipeline(dmp, opt, DEV, prefetch_depth=depth)


def train(pipe, data) -> List[torch.Tensor]:
    it = iter(data)
    out = []
    while True:
        try:
            out.append(pipe.progress(it))
        except StopIteration:
            return out


def local(v: Any) -> torch.Tensor:
    if hasattr(v, "local_shards"):
        shards = v.local_shards()
        return torch.cat([s.tensor.detach().flatten() for s in shards]) if shards else torch.zeros(0)
    return v.detach().flatten() if isinstance(v, torch.Tensor) else torch.as_tensor(v).flatten()


def params(dmp) -> Dict[str, torch.Tensor]:
    return {k: local(v).clone() for k, v in dmp.state_dict().items()}


def max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max([float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a] + [0.0])


def out_diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max([float((x - y).abs().max()) for x, y in zip(a, b)] + [0.0])


def seed_model(configs, second=None) -> Model:
    torch.manual_seed(7)
    return Model(configs, second)


def fresh(configs, second=None) -> Model:
    torch.manual_seed(0)
    return Model(configs, second)


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------- checks
def check_planner(rank: int, world_size: int) -> Dict[str, Any]:
    """Finding 1: TorchRec's planner (with and without constraints) and DMP without a plan.

    ``collective_plan`` plans on rank 0 and broadcasts: an error there would leave the other
    ranks waiting in the broadcast. So each case is first planned locally (``plan``, same
    result on every rank) and only run collectively when that worked.
    """
    res: Dict[str, Any] = {}
    pg = dist.GroupMember.WORLD
    lf = 0.1
    big = tables(2, rows=50_000, dim=16)
    topology = lambda: Topology(world_size=world_size, compute_device="cpu")  # noqa: E731
    constraints = {c.name: ParameterConstraints(compute_kernels=["fused_uvm_caching"],
                                                cache_params=CacheParams(load_factor=lf)) for c in big}
    sharder = ProactiveEmbeddingBagCollectionSharder()
    try:
        planner = EmbeddingShardingPlanner(topology=topology(), constraints=constraints)
        planner.plan(Model(big, device=torch.device("meta")), [sharder])
        storage = {}
        for opt in planner._best_plan or []:  # noqa: SLF001 - the planner's chosen ShardingOptions
            storage[opt.name] = (sum(s.storage.hbm for s in opt.shards), sum(s.storage.ddr for s in opt.shards),
                                 opt.compute_kernel)
        res["storage"] = storage
        res["table_bytes"] = {c.name: c.num_embeddings * c.embedding_dim * 4 for c in big}
        # The same constraints on a CUDA topology (planning needs no GPU): TorchRec's storage
        # estimator has device memory there, and puts the cache in it. On CPU it has none.
        cuda_planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cuda"),
                                                constraints=constraints)
        cuda_planner.plan(Model(big, device=torch.device("meta")), [sharder])
        res["cuda_storage"] = {
            opt.name: (sum(s.storage.hbm for s in opt.shards), sum(s.storage.ddr for s in opt.shards), opt.compute_kernel)
            for opt in cuda_planner._best_plan or []  # noqa: SLF001
        }
        plan = EmbeddingShardingPlanner(topology=topology(), constraints=constraints).collective_plan(
            Model(big, device=torch.device("meta")), [sharder], pg)
        res["constrained_kernels"] = sorted({ps.compute_kernel for ps in plan.plan["sparse"].values()})
    except Exception as e:
        res["constrained_error"] = err(e)
    try:
        EmbeddingShardingPlanner(topology=topology()).plan(Model(big, device=torch.device("meta")), [sharder])
        EmbeddingShardingPlanner(topology=topology()).collective_plan(
            Model(big, device=torch.device("meta")), [sharder], pg)
        res["unconstrained_ok"] = True
    except Exception as e:
        res["unconstrained_error"] = err(e)
    small = tables(2, dim=8)
    ours = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(SGD))
    try:
        EmbeddingShardingPlanner(topology=topology()).plan(fresh(small), [ours])  # what DMP runs (collectively)
        dmp = DistributedModelParallel(fresh(small), device=DEV, sharders=[ours])
        out = train(ProactiveTrainPipeline(dmp, optimizer_for(dmp), DEV, prefetch_depth=1), batches(small, 3, rank))
        res["dmp_no_plan_steps"] = len(out)
    except Exception as e:
        res["dmp_no_plan_error"] = err(e)
    return res


def check_mean_pooling(rank: int, world_size: int, shardings: List[str]) -> Dict[str, Any]:
    """Finding 2: mean pooling vs stock, per sharding type."""
    configs = tables(2, dim=8, pooling=PoolingType.MEAN)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 3, rank)
    res = {}
    for sharding in shardings:
        runs = {}
        for side in ("stock", "proactive"):
            dmp, opt = build(side, fresh(configs), sharding, SGD, world_size, seed, cache_load_factor=0.5)
            runs[side] = (train(pipeline_for(side, dmp, opt), data), params(dmp))
        res[sharding] = {
            "first_out_diff": out_diff(runs["stock"][0][:1], runs["proactive"][0][:1]),
            "out_diff": out_diff(runs["stock"][0], runs["proactive"][0]),
            "param_diff": max_diff(runs["stock"][1], runs["proactive"][1]),
        }
    return res


def check_model_shapes(rank: int, world_size: int, shardings: List[str], weighted_kjt: bool = False) -> Dict[str, Any]:
    """Mixed dims, one table serving two features, sum and mean pooling, int32 ids, a cache
    smaller than a batch: vs stock and bit-identical across depths, per sharding type.

    ``weighted_kjt``: the KJT also carries per-id weights although the EBC is unweighted.
    Stock's sharded EBC hands them to FBGEMM, which weighs the sums and the means (a mean
    is ``sum(w * row) / length``); ours must do the same."""
    configs = [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=300, feature_names=["f0", "f0b"]),
        EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=200, feature_names=["f1"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=100, feature_names=["f2"]),
    ]
    seed = seed_model(configs).state_dict()
    data = []
    for b in batches(configs, 4, rank):
        kjt = b.sparse_features
        weights = None
        if weighted_kjt:
            g = torch.Generator().manual_seed(int(kjt.values().sum()))
            weights = torch.rand(kjt.values().numel(), generator=g) + 0.5
        ids32 = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().to(torch.int32),
                                  lengths=kjt.lengths().to(torch.int32), weights=weights)
        data.append(Batch(dense_features=b.dense_features, sparse_features=ids32, labels=b.labels))
    res = {}
    for sharding in shardings:
        dmp, opt = build("stock", fresh(configs), sharding, ADAGRAD, world_size, seed)
        stock = (train(pipeline_for("stock", dmp, opt), data), params(dmp))
        runs = {}
        for depth in (0, 2):
            dmp, opt = build("proactive", fresh(configs), sharding, ADAGRAD, world_size, seed, cache_load_factor=0.02)
            runs[depth] = (train(pipeline_for("proactive", dmp, opt, depth=depth), data), params(dmp))
        res[sharding] = {
            "n": len(runs[2][0]),
            "out_diff": out_diff(stock[0], runs[2][0]), "param_diff": max_diff(stock[1], runs[2][1]),
            "bitwise_across_depths": out_diff(runs[0][0], runs[2][0]) == 0.0 and max_diff(runs[0][1], runs[2][1]) == 0.0,
        }
    return res


def check_model_shapes_weighted_kjt(rank: int, world_size: int, shardings: List[str]) -> Dict[str, Any]:
    """``check_model_shapes`` with per-id weights on the KJT of the unweighted EBC."""
    return check_model_shapes(rank, world_size, shardings, weighted_kjt=True)


def check_two_ebcs_one_kjt(rank: int, world_size: int) -> Dict[str, Any]:
    """Finding 3: two EBCs fed from one KJT carrying every feature."""
    a = tables(2, prefix="a", feature_prefix="fa")
    b = tables(2, prefix="b", feature_prefix="fb")
    seed = seed_model(a, b).state_dict()
    data = batches(a + b, 3, rank)
    runs = {}
    for side in ("stock", "proactive"):
        try:
            dmp, opt = build(side, fresh(a, b), "row_wise", SGD, world_size, seed, cache_load_factor=0.5)
            runs[side] = (train(pipeline_for(side, dmp, opt), data), params(dmp))
        except Exception as e:
            return {"side": side, "error": err(e)}
    return {"out_diff": out_diff(runs["stock"][0], runs["proactive"][0]),
            "param_diff": max_diff(runs["stock"][1], runs["proactive"][1]), "n": len(runs["proactive"][0])}


def check_optimizer_in_backward(rank: int, world_size: int) -> Dict[str, Any]:
    """Finding 4: per-table fused optimizers from ``apply_optimizer_in_backward``."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    configs = tables(2, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 3, rank)
    res: Dict[str, Any] = {}
    runs = {}
    for side in ("stock", "proactive"):
        model = fresh(configs)
        apply_optimizer_in_backward(torch.optim.SGD, [model.sparse.embedding_bags["t0"].weight], {"lr": 0.1})
        # same kwargs for both: only the optimizer class tells the two tables apart
        apply_optimizer_in_backward(torch.optim.Adagrad, [model.sparse.embedding_bags["t1"].weight], {"lr": 0.1})
        # both tables on rank 0, no fused_params: the sharder reads the per-table optimizers
        dmp, opt = build(side, model, "table_wise_rank0", None, world_size, seed, cache_load_factor=0.5)
        runs[side] = (train(pipeline_for(side, dmp, opt), data), params(dmp))
        res[f"{side}_groups"] = len(dmp.fused_optimizer.param_groups)
    p_stock, p_ours = runs["stock"][1], runs["proactive"][1]
    res["param_diff"] = {k: max_diff({k: p_stock[k]}, {k: p_ours[k]}) for k in p_stock if "embedding_bags" in k}
    res["out_diff"] = out_diff(runs["stock"][0], runs["proactive"][0])
    return res


def _opt_layout(sd: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for k, v in sd["state"].items():
        for name, t in v.items():
            out[f"{k}/{name}"] = {"type": type(t).__name__,
                                  "shape": list(t.size()) if hasattr(t, "size") else None}
    return out


def _opt_values(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    return {f"{k}/{n}": local(t).clone() for k, v in sd["state"].items() for n, t in v.items()}


def check_optimizer_state_dict_and_dcp(rank: int, world_size: int, ckpt_dir: str) -> Dict[str, Any]:
    """Finding 5: fused optimizer state_dict layout vs stock, and a DCP checkpoint both ways."""
    import torch.distributed.checkpoint as dcp

    configs = tables(2, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 6, rank)
    res: Dict[str, Any] = {}
    sides = {}
    for side in ("stock", "proactive"):
        dmp, opt = build(side, fresh(configs), "row_wise", RW_ADAGRAD, world_size, seed, cache_load_factor=0.5)
        pipe = pipeline_for(side, dmp, opt)
        train(pipe, data[:3])
        sd = opt.state_dict()
        sides[side] = {"layout": _opt_layout(sd), "values": _opt_values(sd)}
        path = os.path.join(ckpt_dir, side)
        dcp.save({"model": dmp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
        out = train(pipe, data[3:])
        sides[side]["cont"] = (out, params(dmp))
    res["stock_layout"] = sides["stock"]["layout"]
    res["ours_layout"] = sides["proactive"]["layout"]
    common = set(sides["stock"]["values"]) & set(sides["proactive"]["values"])
    res["state_value_diff"] = max(
        [float((sides["stock"]["values"][k] - sides["proactive"]["values"][k]).abs().max()) for k in common] + [0.0])
    # Resume from each checkpoint into each implementation.
    for src in ("stock", "proactive"):
        for dst in ("stock", "proactive"):
            key = f"{src}_to_{dst}"
            try:
                dmp, opt = build(dst, fresh(configs), "row_wise", RW_ADAGRAD, world_size, None, cache_load_factor=0.5)
                state = {"model": dmp.state_dict(), "optim": opt.state_dict()}
                dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, src))
                dmp.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
                out = train(pipeline_for(dst, dmp, opt), data[3:])
                ref_out, ref_params = sides[dst]["cont"]
                p = params(dmp)
                res[key] = {"out_diff": out_diff(ref_out, out), "param_diff": max_diff(ref_params, p),
                            "bitwise": all(torch.equal(x, y) for x, y in zip(ref_out, out))
                            and sorted(p) == sorted(ref_params) and all(torch.equal(p[k], ref_params[k]) for k in p)}
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                res[key] = {"error": err(e)[:400]}
    return res


def check_load_dense_only(rank: int, world_size: int) -> Dict[str, Any]:
    """Finding 6: a ``strict=False`` load of dense weights only keeps the trained rows."""
    configs = tables(2, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 4, rank)
    dense_keys = [k for k in seed if k.startswith("over.")]
    got = {}
    init = None
    for load in (False, True):
        dmp, opt = build("proactive", fresh(configs), "row_wise", SGD, world_size, seed, num_slots={"t0": 50, "t1": 50})
        if init is None:
            init = {k: v for k, v in params(dmp).items() if "embedding_bags" in k}
        train(pipeline_for("proactive", dmp, opt), data)
        if load:
            dmp.load_state_dict({k: seed[k].clone() for k in dense_keys}, strict=False)
        got[load] = {k: v for k, v in params(dmp).items() if "embedding_bags" in k}
    return {"sparse_diff_after_load": max_diff(got[False], got[True]), "trained": max_diff(got[False], init)}


def check_optimizer_state_mid_training(rank: int, world_size: int) -> Dict[str, Any]:
    """Finding 7: optimizer state read between ``progress`` calls, queued write-backs included.

    A slow emulated link, a small cache and depth 2 leave dirty victims' write-backs queued
    in fetch tickets when ``progress`` returns. The state is read every 4th step only (a
    read flushes the cache, which would leave no dirty victims to queue) and compared with
    a depth-0 run over an in-process copy, where nothing is ever queued.
    """
    configs = tables(2, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 12, rank, size=4)
    snaps = {}
    for name, kwargs, depth in (("ref", {}, 0),
                                ("link", {"link": LinkModel(bandwidth_gbps=0.002, latency_us=100_000)}, 2)):
        dmp, opt = build("proactive", fresh(configs), "row_wise", RW_ADAGRAD, world_size, seed,
                         num_slots={"t0": 24, "t1": 24}, **kwargs)
        pipe = ProactiveTrainPipeline(dmp, opt, DEV, prefetch_depth=depth)
        it = iter(data)
        steps = []
        for i in range(len(data)):
            pipe.progress(it)
            if i % 4 == 3:
                steps.append(_opt_values(opt.state_dict()))
        snaps[name] = steps
    return {"diff_at_steps_4_8_12": [max_diff(a, b) for a, b in zip(snaps["ref"], snaps["link"])]}


def check_plain_forwards(rank: int, world_size: int) -> Dict[str, Any]:
    """Finding 8: plain ``model(batch)`` after ``pipeline.detach()``; eval without no_grad."""
    configs = tables(2, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 3, rank)
    evals = batches(configs, 3, rank, base=500)
    res: Dict[str, Any] = {}
    outs = {}
    for side in ("stock", "proactive"):
        dmp, opt = build(side, fresh(configs), "row_wise", SGD, world_size, seed, cache_load_factor=0.5)
        pipe = pipeline_for(side, dmp, opt)
        train(pipe, data)
        try:
            model = pipe.detach()
            model.eval()
            with torch.no_grad():
                outs[side] = [model(b)[1] for b in evals]
        except Exception as e:
            res[f"{side}_detach_error"] = err(e)
    if len(outs) == 2:
        res["detach_eval_diff"] = out_diff(outs["stock"], outs["proactive"])
    # eval mode, grad enabled, no pipeline at all; the cache holds a handful of rows. Table t0
    # on rank 0 and t1 on rank 1 see the very same ids (f1 = f0, same batch on every rank),
    # so a failure, if any, happens in the same forward on both ranks (no rank is left
    # waiting in a collective).
    dmp, opt = build("proactive", fresh(configs), "table_wise", SGD, world_size, seed, num_slots={"t0": 16, "t1": 16})
    dmp.eval()
    n = 0
    try:
        for i in range(30):
            b = batch(configs[:1], 4, seed=9000 + i)
            kjt = b.sparse_features
            b.sparse_features = KeyedJaggedTensor.from_lengths_sync(
                keys=["f0", "f1"], values=torch.cat([kjt.values(), kjt.values()]),
                lengths=torch.cat([kjt.lengths(), kjt.lengths()]))
            dmp(b)
            n += 1
        res["eval_forwards"] = n
    except Exception as e:
        res["eval_error"] = f"after {n} forwards: {err(e)}"
    try:
        dmp.load_state_dict(copy.deepcopy(seed))
        res["load_after_eval_ok"] = True
    except Exception as e:
        res["load_after_eval_error"] = err(e)
    return res


def check_progress_after_error(rank: int, world_size: int) -> Dict[str, Any]:
    """Finding 9d: ``progress()`` again after an error without ``reset()``, then ``reset()``."""
    configs = tables(2, dim=8)
    seed = seed_model(configs).state_dict()
    good = batches(configs, 6, rank)
    bad = batch(configs, 8, seed=77)
    bad.sparse_features = KeyedJaggedTensor.from_lengths_sync(
        keys=bad.sparse_features.keys(), values=torch.full_like(bad.sparse_features.values(), 10_000),
        lengths=bad.sparse_features.lengths())
    data = good[:3] + [bad] + good[3:]
    dmp, opt = build("proactive", fresh(configs), "row_wise", SGD, world_size, seed, cache_load_factor=0.5)
    pipe = pipeline_for("proactive", dmp, opt)
    it = iter(data)
    calls: List[str] = []
    notes: List[List[str]] = []  # what the traceback adds under each error (PEP 678 notes)
    for _ in range(8):
        try:
            pipe.progress(it)
            calls.append("ok")
        except StopIteration:
            calls.append("stop")
            break
        except Exception as e:
            calls.append(err(e)[:300])
            notes.append(list(getattr(e, "__notes__", [])))
    res: Dict[str, Any] = {"calls": calls, "notes": notes}
    try:
        pipe.reset()
        snapshot = copy.deepcopy(dmp.state_dict())
        fresh_data = batches(configs, 3, rank, base=300)
        out = train(pipe, fresh_data)
        ref, ref_opt = build("proactive", fresh(configs), "row_wise", SGD, world_size, None, cache_load_factor=0.5)
        ref.load_state_dict(snapshot)
        ref_out = train(pipeline_for("proactive", ref, ref_opt), fresh_data)
        res["after_reset_out_diff"] = out_diff(ref_out, out)
        res["after_reset_param_diff"] = max_diff(params(ref), params(dmp))
    except Exception as e:
        res["after_reset_error"] = err(e)
    return res


def check_nan_grad_one_table(rank: int, world_size: int) -> Dict[str, Any]:
    """Finding 9f: a NaN gradient in one table refuses the whole batch (no table changes).

    Plain forward/backward (no pipeline). Row-wise: every rank holds a shard of both tables,
    so every rank meets the NaN in the same backward.
    """
    configs = tables(2, dim=8)
    seed = seed_model(configs).state_dict()
    dmp, opt = build("proactive", fresh(configs), "row_wise", SGD, world_size, seed, cache_load_factor=0.5)
    for b in batches(configs, 2, rank):
        opt.zero_grad()
        loss, _ = dmp(b)
        loss.backward()
        opt.step()
    before = {k: v for k, v in params(dmp).items() if "embedding_bags" in k}
    dmp.module.nan_grad_feature = "f0"  # t0 runs its backward last: t1 updates first
    error = None
    try:
        opt.zero_grad()
        loss, _ = dmp(batch(configs, 8, seed=50 + rank))
        loss.backward()
    except Exception as e:
        error = err(e)
    after = {k: v for k, v in params(dmp).items() if "embedding_bags" in k}
    return {"error": error, "changed": {k: max_diff({k: before[k]}, {k: after[k]}) for k in before}}


def check_fetch_threads(rank: int, world_size: int) -> Dict[str, Any]:
    """Finding 9h: a dropped sharded model leaves no ``proactive-fetch`` thread behind."""
    configs = tables(2, dim=8)

    def live() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "proactive-fetch" and t.is_alive())

    for _ in range(3):  # engines of earlier checks in this process are collected first
        gc.collect()
    start = live()
    dmp, opt = build("proactive", fresh(configs), "row_wise", SGD, world_size, None, cache_load_factor=0.5,
                     link=LinkModel(bandwidth_gbps=1.0, latency_us=10))
    train(pipeline_for("proactive", dmp, opt), batches(configs, 2, rank))
    during = live()
    del dmp, opt
    for _ in range(3):
        gc.collect()
    return {"start": start, "during": during, "after": live()}


CHECKS: Dict[str, Callable[..., Dict[str, Any]]] = {
    name[len("check_"):]: fn for name, fn in dict(globals()).items() if name.startswith("check_")
}


def run_checks(rank: int, world_size: int, checks: Dict[str, Dict[str, Any]],
               registry: Optional[Dict[str, Callable[..., Any]]] = None) -> Dict[str, Any]:
    """Runs ``{check name: kwargs}`` in order (from ``registry``, default this module's
    ``CHECKS``); each outcome is ``{"ok": result}`` or ``{"error": text}``."""
    registry = CHECKS if registry is None else registry
    out: Dict[str, Any] = {}
    for name, kwargs in checks.items():
        print(f"[rank {rank}] check {name}", file=sys.stderr, flush=True)
        try:
            out[name] = {"ok": registry[name](rank=rank, world_size=world_size, **kwargs)}
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # e.g. DCP's CheckpointException
            out[name] = {"error": f"{err(e)}\n{traceback.format_exc()[-3000:]}"}
            # Shown in the test log if a peer is then left waiting in a collective.
            print(f"[rank {rank}] check {name} failed: {out[name]['error']}", file=sys.stderr, flush=True)
        dist.barrier()
    return out
