"""Rank-side code of the sequence-table (``EmbeddingCollection``) tests (importable by
spawned ranks): the same batches through stock TorchRec and through the proactive sharders
at several depths, on plans of each sharding type (``planning.build_plan``)."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from torchrec_proactive import (
    ProactiveEmbeddingBagCollectionSharder,
    ProactiveEmbeddingCollectionSharder,
    ProactiveTrainPipeline,
)
from torchrec_proactive.planning import build_plan, combined_optimizer, shard_model

from .exactness_worker import FUSED, LR, _params, _run
from .sequence_model import SequenceModel, make_pooled_tables, make_sequence_batch, make_sequence_tables


def _eval(dmp, batches) -> List[torch.Tensor]:
    """TorchRec's evaluation pipeline over ``batches`` (``model.eval()``, no grad): the logits."""
    from torchrec.distributed.train_pipeline import EvalPipelineSparseDist

    dmp.eval()
    pipe = EvalPipelineSparseDist(dmp, None, torch.device("cpu"))  # type: ignore[arg-type]
    out = [o if isinstance(o, torch.Tensor) else o[1] for o in _run(pipe, batches)]  # (it returns the logits)
    dmp.train()
    return out


def build(sharders: List[Any], model_fn, sharding: str, kernel: str, seed_state: Dict[str, torch.Tensor],
          load_factor: Optional[float] = None) -> "tuple[DistributedModelParallel, Any]":
    """``model_fn()`` sharded as ``sharding`` (every table) with ``kernel``, loaded from
    ``seed_state``; ``sharders``: one for the EC, one for the EBC."""
    torch.manual_seed(0)
    model = model_fn()
    plan = build_plan(model, sharders, sharding, kernel=kernel, cache_load_factor=load_factor)
    dmp = shard_model(model, sharders, plan, torch.device("cpu"))
    dmp.load_state_dict(copy.deepcopy(seed_state))
    return dmp, combined_optimizer(dmp, lambda params: torch.optim.SGD(params, lr=LR))


def train_and_compare(rank: int, world_size: int, sharding: str, optimizer: str, depths: List[int],
                      load_factor: float = 0.2, mixed: bool = True, steps: int = 6, batch_size: int = 16,
                      compare_stock: bool = True, planner: str = "auto") -> Dict[str, Any]:
    """Stock (kernel ``fused``, ``TrainPipelineSparseDist``) against proactive at each depth
    (``fused_uvm_caching`` at ``load_factor``); ``mixed``: pooled tables beside the histories."""
    seq_tables = make_sequence_tables()
    pooled_tables = make_pooled_tables() if mixed else None

    def model_fn() -> SequenceModel:
        return SequenceModel(seq_tables, pooled_tables)

    torch.manual_seed(123)
    seed_state = model_fn().state_dict()
    batches = [make_sequence_batch(seq_tables, pooled_tables, batch_size, seed=1000 * rank + i) for i in range(steps)]
    fused = FUSED[optimizer]
    result: Dict[str, Any] = {"rank": rank}
    ref = None
    evals = [make_sequence_batch(seq_tables, pooled_tables, batch_size, seed=5000 + 1000 * rank + i) for i in range(2)]
    if compare_stock:
        dmp, opt = build([EmbeddingCollectionSharder(fused_params=dict(fused)),
                          EmbeddingBagCollectionSharder(fused_params=dict(fused))], model_fn, sharding, "fused",
                         seed_state)
        ref = (_run(TrainPipelineSparseDist(dmp, opt, torch.device("cpu")), batches), _params(dmp), _eval(dmp, evals))
    runs = {}
    for k in depths:
        sharders = [ProactiveEmbeddingCollectionSharder(fused_params=dict(fused), debug_checks=True, planner=planner),
                    ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused), debug_checks=True, planner=planner)]
        dmp, opt = build(sharders, model_fn, sharding, "fused_uvm_caching", seed_state, load_factor)
        assert set(dmp.module.ec.planners().values()) == ({"device"} if planner == "device" else {"host"})
        pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=k)
        out = _run(pipe, batches)
        dmp.module.ec.check_invariants(expect_drained=True)
        stats = pipe.stats()
        runs[k] = {"out": out, "params": _params(dmp), "stats": stats, "eval": _eval(dmp, evals),
                   "ec_kernels": len(dmp.module.ec.proactive_kernels),
                   "ec_rows_requested": sum(s["rows_requested"] for s in dmp.module.ec.table_stats().values())}
    base = runs[depths[0]]
    result["n_out"] = len(base["out"])
    result["ec_kernels"] = base["ec_kernels"]
    result["ec_rows_requested"] = {k: r["ec_rows_requested"] for k, r in runs.items()}
    result["hit_rate"] = {k: r["stats"]["hit_rate"] for k, r in runs.items()}
    result["lead"] = {k: r["stats"]["prefetch_lead_lookups"] / max(r["stats"]["batches"], 1) for k, r in runs.items()}
    result["rows_fetched_at_lookup"] = {k: r["stats"]["rows_fetched_at_lookup"] for k, r in runs.items()}
    result["bitwise_equal_across_depths"] = all(
        all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(r["out"], base["out"]))
        and sorted(r["params"]) == sorted(base["params"])
        and all(torch.equal(r["params"][n], base["params"][n]) for n in base["params"])
        for r in runs.values())
    if ref is not None:
        result["same_keys_as_stock"] = sorted(ref[1]) == sorted(base["params"])
        result["max_param_diff_vs_stock"] = max(float((base["params"][n] - ref[1][n]).abs().max()) for n in ref[1])
        result["max_loss_diff_vs_stock"] = max(float((a[0] - b[0]).abs()) for a, b in zip(base["out"], ref[0]))
        # after training: TorchRec's EvalPipelineSparseDist, as stock's model evaluates
        result["max_eval_diff_vs_stock"] = max(float((a - b).abs().max()) for a, b in zip(base["eval"], ref[2]))
    return result


def bad_history_id(rank: int, world_size: int) -> Dict[str, Any]:
    """An out-of-range id in a history feature: refused before its input all-to-all with one
    line naming the feature and its table, the model unchanged; the next batch trains."""
    from torchrec_proactive.store import IdOutOfRangeError

    seq_tables, pooled_tables = make_sequence_tables(), make_pooled_tables()
    fused = FUSED["rowwise_adagrad"]
    torch.manual_seed(123)
    seed_state = SequenceModel(seq_tables, pooled_tables).state_dict()
    sharders = [ProactiveEmbeddingCollectionSharder(fused_params=dict(fused)),
                ProactiveEmbeddingBagCollectionSharder(fused_params=dict(fused))]
    dmp, opt = build(sharders, lambda: SequenceModel(seq_tables, pooled_tables), "row_wise", "fused_uvm_caching",
                     seed_state, 0.2)
    good = make_sequence_batch(seq_tables, pooled_tables, 8, seed=rank)
    kjt = good.sparse_features
    values = kjt.values().clone()
    start = sum(kjt.length_per_key()[:kjt.keys().index("h0_b")])
    values[start] = seq_tables[0].num_embeddings + 5  # rank-local: every rank sends one
    bad = type(good)(dense_features=good.dense_features, labels=good.labels,
                     sparse_features=type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths()))
    before = _params(dmp)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    try:
        _run(pipe, [bad])
        message = None
    except IdOutOfRangeError as e:
        message = str(e)
    unchanged = all(torch.equal(v, before[k]) for k, v in _params(dmp).items())
    pipe.reset()
    trained = len(_run(ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2), [good, good]))
    return {"message": message, "unchanged": unchanged, "trained_after": trained}


def case(rank: int, world_size: int, kind: str, **kwargs: Any) -> Dict[str, Any]:
    """One of this module's checks by name (several kinds in one launch)."""
    return {"train": train_and_compare, "bad_id": bad_history_id}[kind](rank=rank, world_size=world_size, **kwargs)
