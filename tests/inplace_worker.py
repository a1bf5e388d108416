"""Rank-side code of issue #25's tests: in-place writes and pin lifetime, the TorchRec way.

Each check builds the same job twice - stock TorchRec (``fused``, every row resident) and
the plugin (``fused_uvm_caching`` through our sharder, a small cache) - with the helpers of
tests/dropin_worker.py, runs the same user actions on both and returns plain observations;
tests/test_inplace_and_pins.py asserts on them.

* In-place writes: ``dcp.load`` into ``model.state_dict()`` / ``optimizer.state_dict()``
  (no ``load_state_dict``), and zeroing a table through ``named_parameters()``, both while
  the pipeline holds prefetched batches. Stock reads what was written at its next lookup.
* Pins without the garbage collector (``gc.disable()`` for the whole check): forwards whose
  loss is dropped, then training; and a forward whose backward comes after the next forward.
"""

from __future__ import annotations

import gc
import os
from typing import Any, Dict, List

import torch

from .dropin_worker import (
    RW_ADAGRAD,
    batches,
    build,
    fresh,
    out_diff,
    max_diff,
    params,
    pipeline_for,
    run_checks as run_dropin_checks,
    seed_model,
    tables,
)


def _table_wise(world_size: int) -> str:
    return "table_wise" if world_size > 1 else "table_wise_rank0"


def _progress(pipe, it, n: int) -> List[torch.Tensor]:
    return [pipe.progress(it)[1].detach().clone() for _ in range(n)]


def _ebc(dmp):
    return dmp.module.sparse


def _stores(dmp) -> List[Any]:
    return [k.store for k in getattr(_ebc(dmp), "proactive_kernels", [])]


def _eval_logits(dmp, pipe, b) -> torch.Tensor:
    pipe.detach()
    dmp.eval()
    with torch.no_grad():
        _, logits = dmp(b)
    dmp.train()
    return logits.clone()


def check_inplace_writes(rank: int, world_size: int, ckpt_dir: str, depth: int, load_factor: float,
                         sharding: str) -> Dict[str, Any]:
    """``dcp.load`` in place mid-flight, then zeroing a table through ``named_parameters()``."""
    import torch.distributed.checkpoint as dcp

    configs = tables(2, rows=200, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 12, rank, size=16)
    probe = batches(configs, 1, rank, size=16, base=500)[0]
    sides: Dict[str, Dict[str, Any]] = {}
    for side in ("stock", "proactive"):
        kwargs = {} if side == "stock" else {"cache_load_factor": load_factor}
        dmp, opt = build(side, fresh(configs), sharding, RW_ADAGRAD, world_size, seed, **kwargs)
        pipe = pipeline_for(side, dmp, opt, depth=depth)
        it = iter(data)
        out = _progress(pipe, it, 3)
        path = os.path.join(ckpt_dir, f"{side}_{depth}_{load_factor}_{sharding}")
        dcp.save({"model": dmp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
        out += _progress(pipe, it, 3)
        # The user's resume: DCP reads into the state dicts' own tensors, and that is all.
        state = {"model": dmp.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=path)
        out += _progress(pipe, it, 3)
        after_load = params(dmp)
        # Zero one table in place through named_parameters(), batches still in flight.
        zeroed = []
        for name, p in dmp.named_parameters():
            if name.endswith("t0.weight"):
                with torch.no_grad():
                    p.zero_()
                zeroed.append(name)
        rest = []
        while True:
            try:
                rest.append(pipe.progress(it)[1].detach().clone())
            except StopIteration:
                break
        sides[side] = {"out": out + rest, "after_load": after_load, "final": params(dmp),
                       "zeroed": zeroed, "eval": _eval_logits(dmp, pipe, probe)}
        # A table zeroed in place between plain forwards reads as zeros at the next lookup.
        for name, p in dmp.named_parameters():
            if name.endswith("t1.weight"):
                with torch.no_grad():
                    p.zero_()
        dmp.eval()
        with torch.no_grad():
            pooled = _ebc(dmp)(probe.sparse_features).to_dict()
        dmp.train()
        sides[side]["t1_pooled_abs_max"] = float(pooled["f1"].abs().max())
    s, p = sides["stock"], sides["proactive"]
    return {
        "zeroed": p["zeroed"], "n_out": (len(s["out"]), len(p["out"])),
        "out_diff": out_diff(s["out"], p["out"]),
        "after_load_param_diff": max_diff(s["after_load"], p["after_load"]),
        "final_param_diff": max_diff(s["final"], p["final"]),
        "eval_diff": float((s["eval"] - p["eval"]).abs().max()),
        "t1_pooled_abs_max": (s["t1_pooled_abs_max"], p["t1_pooled_abs_max"]),
    }


def _dropped_loss_run(rank: int, world_size: int, load_factor: float, dropped: int, collect: bool) -> Dict[str, Any]:
    configs = tables(2, rows=1000, dim=8)
    seed = seed_model(configs).state_dict()
    data = batches(configs, 10, rank, size=32, base=100)
    peeks = batches(configs, dropped, rank, size=32, base=300)
    dmp, opt = build("proactive", fresh(configs), _table_wise(world_size), RW_ADAGRAD, world_size, seed,
                     cache_load_factor=load_factor)
    stores = _stores(dmp)
    in_flight_after_peek: List[int] = []
    for b in peeks:
        loss, _ = dmp(b)  # a metric peek: the loss (and its graph) is dropped
        del loss
        if collect:
            gc.collect()
        in_flight_after_peek.append(sum(s._in_flight for s in stores))
    in_flight_before_flush = sum(s._in_flight for s in stores)
    dmp.state_dict()  # a flush ends the pins of a forward whose backward has not come
    in_flight_after_flush = sum(s._in_flight for s in stores)
    before = _ebc(dmp).proactive_stats.snapshot()  # (the peeks' own lookups are not training's)
    pipe = pipeline_for("proactive", dmp, opt, depth=2)
    it = iter(data)
    pinned: List[int] = []
    while True:
        try:
            pipe.progress(it)
        except StopIteration:
            break
        pinned.append(max(s.pinned_slots() for s in stores) if stores else 0)
    after = _ebc(dmp).proactive_stats.snapshot()
    stats = {k: after[k] - before[k] for k in after}
    return {
        "in_flight_after_peek": in_flight_after_peek, "in_flight_before_flush": in_flight_before_flush,
        "in_flight_after_flush": in_flight_after_flush, "max_pinned": max(pinned or [0]),
        "slots": min(s.num_slots for s in stores) if stores else 0, "n_stores": len(stores),
        "stats": {k: stats.get(k) for k in ("deferred_batches", "overflow_rows", "rows_fetched",
                                              "rows_fetched_at_lookup", "hits", "batches")},
        "params": params(dmp), "in_flight_end": sum(s._in_flight for s in stores),
    }


def check_pins_without_gc(rank: int, world_size: int, load_factor: float, dropped: int) -> Dict[str, Any]:
    """The same job with the cycle collector off, and on with a collection after each peek:
    pins, counters and parameters must not depend on it."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        no_gc = _dropped_loss_run(rank, world_size, load_factor, dropped, collect=False)
        clean = _dropped_loss_run(rank, world_size, load_factor, 0, collect=False)
    finally:
        if was_enabled:
            gc.enable()
    with_gc = _dropped_loss_run(rank, world_size, load_factor, dropped, collect=True)
    return {
        "no_gc": {k: v for k, v in no_gc.items() if k != "params"},
        "clean_stats": clean["stats"],
        "with_gc_stats": with_gc["stats"],
        "gc_independent": no_gc["stats"] == with_gc["stats"]
        and all(torch.equal(no_gc["params"][k], with_gc["params"][k]) for k in no_gc["params"]),
    }


def check_late_backward(rank: int, world_size: int, load_factor: float, planner: str = "host") -> Dict[str, Any]:
    """Two training forwards, then one backward of their summed losses (the second forward
    ends the first one's pins): parameters as stock's."""
    configs = tables(2, rows=200, dim=8)
    seed = seed_model(configs).state_dict()
    pairs = [batches(configs, 2, rank, size=16, base=700 + 10 * i) for i in range(4)]
    res: Dict[str, Any] = {}
    gc.disable()
    try:
        for side in ("stock", "proactive"):
            kwargs = {} if side == "stock" else {"cache_load_factor": load_factor, "planner": planner}
            dmp, opt = build(side, fresh(configs), _table_wise(world_size), RW_ADAGRAD, world_size, seed, **kwargs)
            for a, b in pairs:
                opt.zero_grad()
                loss_a, _ = dmp(a)
                loss_b, _ = dmp(b)
                (loss_a + loss_b).backward()
                opt.step()
            res[side] = params(dmp)
            if side == "proactive":
                stores = _stores(dmp)
                res["late_updates"] = sum(s.stats.late_updates for s in stores)
                res["in_flight_end"] = sum(s._in_flight for s in stores)
                for s in stores:
                    s.check_invariants(expect_drained=True)
    finally:
        gc.enable()
    return {"param_diff": max_diff(res["stock"], res["proactive"]), "late_updates": res["late_updates"],
            "in_flight_end": res["in_flight_end"]}


CHECKS = {
    "inplace_writes": check_inplace_writes,
    "pins_without_gc": check_pins_without_gc,
    "late_backward": check_late_backward,
    "late_backward_device_planner": check_late_backward,
}


def run_checks(rank: int, world_size: int, checks: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """``{check: kwargs}`` -> ``{check: {"ok": ...} | {"error": ...}}`` (tests/dropin_worker.py's runner)."""
    return run_dropin_checks(rank, world_size, checks, registry=CHECKS)
