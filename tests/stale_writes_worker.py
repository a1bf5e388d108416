"""Rank-side code of issue #40's tests (items 1-3): nothing the user does to the tensors a
module handed out, whenever they were taken, may discard training.

Each check builds the same job twice - stock TorchRec (``fused``, every row resident) and
the plugin (``fused_uvm_caching``, a small cache, batches in flight) - with the helpers of
tests/dropin_worker.py, does the same thing on both and returns plain observations;
tests/test_stale_writes.py asserts on them.

* ``stale_writes``: tensors taken *before training* (``named_parameters()``, ``state_dict()``,
  the optimizer's ``state_dict()``, TorchRec's registered ``embedding_bags[t].weight``), then
  several steps, then a write of some rows through one of them, then more steps. Stock
  writes into its live tables; the plugin's host tier is behind its cache for the rows
  trained since, and must change exactly the rows written and keep every other update.
* ``reset_keeps_state``: ``reset_parameters()`` mid-training re-initialises the weights only;
  the optimizer state (cached, not yet written back) must survive, as it does in stock.
* ``eval_mode_training``: ``model.eval()`` (to freeze dropout/BatchNorm) and a manual
  training loop: FBGEMM updates the tables in backward whatever the module's mode.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from .dropin_worker import (
    RW_ADAGRAD,
    batches,
    build,
    fresh,
    local,
    max_diff,
    out_diff,
    params,
    pipeline_for,
    run_checks as run_dropin_checks,
    seed_model,
    tables,
)

ADAM = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.01, "eps": 1e-8}


def _progress(pipe, it, n: int) -> List[torch.Tensor]:
    return [pipe.progress(it)[1].detach().clone() for _ in range(n)]


def _drain(pipe, it) -> List[torch.Tensor]:
    out = []
    while True:
        try:
            out.append(pipe.progress(it)[1].detach().clone())
        except StopIteration:
            return out


def _opt_state(opt) -> Dict[str, torch.Tensor]:
    """The optimizer's tensors by key (fresh state dict: the live values)."""
    out = {}
    for key, per_param in opt.state_dict()["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor) or hasattr(value, "local_shards"):
                out[f"{key}.{name}"] = local(value).clone()
    return out


def _shard(v: Any) -> torch.Tensor:
    """The tensor itself (a view of the table's storage), not a copy: a ShardedTensor's one
    local shard, or a plain tensor."""
    if hasattr(v, "local_shards"):
        shards = v.local_shards()
        return shards[0].tensor if shards else torch.zeros(0)
    return v


def _table_param(named: Dict[str, Any], table: str) -> torch.Tensor:
    (name,) = [n for n in named if n.endswith(f"embedding_bags.{table}.weight")]
    return named[name]


def _write(path: str, early: Dict[str, Any], dmp) -> str:
    """The user's write through a tensor taken before training; returns what it touched."""
    with torch.no_grad():
        if path == "named_parameters_rows":
            t = _shard(_table_param(early["named_parameters"], "t0"))
            t[:40].zero_()
        elif path == "named_parameters_copy":
            t = _shard(_table_param(early["named_parameters"], "t1"))
            t.copy_(torch.full_like(t, 0.25))
        elif path == "state_dict_row":
            t = _shard(early["state_dict"][[k for k in early["state_dict"] if k.endswith("t1.weight")][0]])
            t[3:9].zero_()
        elif path == "registered_attribute":
            t = _shard(dmp.module.sparse.embedding_bags["t0"].weight)
            if t.numel():
                t[0].zero_()
        elif path == "numpy_rows":
            t = _shard(_table_param(early["named_parameters"], "t1"))
            t.numpy()[10:30] = 0.5
        elif path == "data_rows":
            t = _shard(dmp.module.sparse.embedding_bags["t1"].weight)
            if t.numel():
                t.data[50:60] = -0.25
        elif path == "scale_table":
            t = _shard(_table_param(early["named_parameters"], "t0"))
            t.mul_(0.5)
        elif path == "optimizer_state":
            state = early["optimizer_state_dict"]["state"]
            key = [k for k in state if k.endswith("t0.weight")][0]
            for value in state[key].values():
                if hasattr(value, "local_shards"):
                    for shard in value.local_shards():
                        shard.tensor.zero_()
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    value.zero_()
        else:
            raise ValueError(path)
    return path


def check_stale_writes(rank: int, world_size: int, paths: List[str], sharding: str, depth: int = 2,
                       load_factor: float = 0.2) -> Dict[str, Any]:
    configs = tables(2, rows=200, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 12, rank, size=16)
    out: Dict[str, Any] = {}
    for path in paths:
        sides: Dict[str, Dict[str, Any]] = {}
        for side in ("stock", "proactive"):
            kwargs = {} if side == "stock" else {"cache_load_factor": load_factor}
            dmp, opt = build(side, fresh(configs), sharding, RW_ADAGRAD, world_size, seed, **kwargs)
            early = {"named_parameters": dict(dmp.named_parameters()), "state_dict": dmp.state_dict(),
                     "optimizer_state_dict": opt.state_dict()}
            pipe = pipeline_for(side, dmp, opt, depth=depth)
            it = iter(data)
            before = _progress(pipe, it, 5)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _write(path, early, dmp)
                after = _drain(pipe, it)
            sides[side] = {"out": before + after, "params": params(dmp), "opt": _opt_state(opt),
                           "warnings": [str(w.message) for w in caught if "in place" in str(w.message)]}
        s, p = sides["stock"], sides["proactive"]
        out[path] = {"n_out": (len(s["out"]), len(p["out"])), "out_diff": out_diff(s["out"], p["out"]),
                     "param_diff": max_diff(s["params"], p["params"]), "opt_diff": max_diff(s["opt"], p["opt"]),
                     "warnings": p["warnings"]}
    return out


def check_stale_reads(rank: int, world_size: int, sharding: str, load_factor: float = 0.2) -> Dict[str, Any]:
    """Tensors taken before training, read after it once something wrote the cache back (a
    fresh ``state_dict()``): stock's live values. (Before a write-back they show the host
    tier as of the last one, as the docstrings say.)"""
    configs = tables(2, rows=200, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 8, rank, size=16)
    read: Dict[str, Dict[str, torch.Tensor]] = {}
    for side in ("stock", "proactive"):
        kwargs = {} if side == "stock" else {"cache_load_factor": load_factor}
        dmp, opt = build(side, fresh(configs), sharding, RW_ADAGRAD, world_size, seed, **kwargs)
        early = {k: _shard(v) for k, v in dmp.state_dict().items() if k.endswith(".weight") and "embedding" in k}
        _drain(pipeline_for(side, dmp, opt, depth=2), iter(data))
        dmp.state_dict()
        read[side] = {k: v.clone() for k, v in early.items()}
    return {"early_vs_stock_live": max_diff(read["stock"], read["proactive"])}


def check_reset_keeps_state(rank: int, world_size: int, sharding: str, load_factor: float = 0.2) -> Dict[str, Any]:
    configs = tables(2, rows=200, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 10, rank, size=16)
    sides: Dict[str, Dict[str, Any]] = {}
    for side in ("stock", "proactive"):
        kwargs = {} if side == "stock" else {"cache_load_factor": load_factor}
        dmp, opt = build(side, fresh(configs), sharding, RW_ADAGRAD, world_size, seed, **kwargs)
        pipe = pipeline_for(side, dmp, opt, depth=2)
        it = iter(data)
        before = _progress(pipe, it, 4)
        torch.manual_seed(11 + rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dmp.module.sparse.reset_parameters()
            after_reset = params(dmp)
            state_after_reset = _opt_state(opt)
            rest = _drain(pipe, it)
        sides[side] = {"out": before + rest, "params": params(dmp), "opt": _opt_state(opt),
                       "after_reset": after_reset, "state_after_reset": state_after_reset,
                       "warnings": [str(w.message) for w in caught if "tables" in str(w.message)]}
    s, p = sides["stock"], sides["proactive"]
    return {"out_diff": out_diff(s["out"], p["out"]), "param_diff": max_diff(s["params"], p["params"]),
            "opt_diff": max_diff(s["opt"], p["opt"]),
            "reset_param_diff": max_diff(s["after_reset"], p["after_reset"]),
            "reset_state_diff": max_diff(s["state_after_reset"], p["state_after_reset"]),
            "stock_state_max": max(float(v.abs().max()) for v in s["state_after_reset"].values() if v.numel()),
            "warnings": p["warnings"]}


def check_eval_mode_training(rank: int, world_size: int, sharding: str, fused: str = "rowwise_adagrad",
                             load_factor: float = 0.2) -> Dict[str, Any]:
    """``model.eval()`` then a manual loop (forward, backward, step), as users freezing
    dropout do; then a pipeline in eval mode, which stock runs without a backward."""
    configs = tables(2, rows=200, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 6, rank, size=16, base=50)
    params_by_side: Dict[str, Dict[str, torch.Tensor]] = {}
    eval_pipe_by_side: Dict[str, Dict[str, torch.Tensor]] = {}
    for side in ("stock", "proactive"):
        kwargs = {} if side == "stock" else {"cache_load_factor": load_factor}
        dmp, opt = build(side, fresh(configs), sharding, RW_ADAGRAD if fused == "rowwise_adagrad" else ADAM,
                         world_size, seed, **kwargs)
        initial = params(dmp)
        dmp.eval()
        for b in data:
            opt.zero_grad()
            loss, _ = dmp(b)
            loss.backward()
            opt.step()
        params_by_side[side] = params(dmp)
        if side == "proactive":
            trained = max_diff(params_by_side[side], initial)
        # An evaluation pipeline over the model in eval mode updates nothing (stock's too).
        pipe = pipeline_for(side, dmp, opt, depth=2)
        _drain(pipe, iter(batches(configs, 4, rank, size=16, base=90)))
        eval_pipe_by_side[side] = params(dmp)
    return {"param_diff": max_diff(params_by_side["stock"], params_by_side["proactive"]),
            "trained": trained,
            "eval_pipeline_changed": max_diff(params_by_side["proactive"], eval_pipe_by_side["proactive"]),
            "eval_pipeline_diff": max_diff(eval_pipe_by_side["stock"], eval_pipe_by_side["proactive"])}


CHECKS = {
    "stale_writes": check_stale_writes,
    "stale_reads": check_stale_reads,
    "reset_keeps_state": check_reset_keeps_state,
    "eval_mode_training": check_eval_mode_training,
}


def run_checks(rank: int, world_size: int, checks: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """``{check: kwargs}`` -> ``{check: {"ok": ...} | {"error": ...}}`` (tests/dropin_worker.py's runner)."""
    return run_dropin_checks(rank, world_size, checks, registry=CHECKS)
