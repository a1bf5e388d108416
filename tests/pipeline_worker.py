"""Rank-side code for pipeline behaviour tests: ordering, drain, eval, state-dict interop."""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from torchrec_proactive import ProactiveEmbeddingBagCollectionSharder, ProactiveTrainPipeline
from torchrec_proactive.fetch import LinkModel
from torchrec_proactive.planning import build_plan, combined_optimizer, shard_model

from .exactness_worker import LR, _params, _run
from .sparse_model import SparseModel, make_batch, make_tables

FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR}


def _proactive(tables, seed_state, sharding="row_wise", **sharder_kwargs):
    sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(FUSED), debug_checks=True, **sharder_kwargs)
    torch.manual_seed(0)
    model = SparseModel(tables)
    dmp = shard_model(model, sharder, build_plan(model, sharder, sharding), torch.device("cpu"))
    dmp.load_state_dict(copy.deepcopy(seed_state))
    return dmp, combined_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=LR))


def ordering(rank: int, world_size: int, depth: int, steps: int = 8) -> Dict[str, Any]:
    tables = make_tables(3, rows=3000, dim=8)
    seed_state = SparseModel(tables).state_dict()
    dmp, opt = _proactive(tables, seed_state, cache_load_factor=0.5,
                          link=LinkModel(bandwidth_gbps=0.02, latency_us=2000))
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth, trace=True)
    _run(pipe, [make_batch(tables, 32, seed=100 * rank + i) for i in range(steps)])
    records = [
        {"index": r.index, "issued": r.fetch_issued_at, "completed": r.fetch_completed_at,
         "lookup": r.lookup_started_at + r.stall_s, "stall": r.stall_s, "fetched": r.rows_fetched}
        for r in dmp.module.ebc.proactive_stats.records
    ]
    fwd = {e["batch"]: (e["start_s"], e["end_s"]) for e in pipe.tracer.events if str(e["name"]).startswith("fwd")}
    return {"records": records, "fwd": fwd, "events": pipe.tracer.events, "stats": pipe.stats()}


def drain(rank: int, world_size: int, num_batches: int, depth: int) -> Dict[str, Any]:
    tables = make_tables(2, rows=500, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=1.0)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth)
    outs = _run(pipe, [make_batch(tables, 8, seed=rank * 10 + i) for i in range(num_batches)])
    dmp.module.ebc.check_invariants(expect_drained=True)
    # A second epoch through the same pipeline works after draining.
    outs2 = _run(pipe, [make_batch(tables, 8, seed=rank * 10 + i) for i in range(num_batches)])
    dmp.module.ebc.check_invariants(expect_drained=True)
    return {"n": len(outs), "n2": len(outs2)}


def eval_and_stop_early(rank: int, world_size: int) -> Dict[str, Any]:
    """No-grad evaluation and an abandoned (reset) pipeline leak no pins."""
    tables = make_tables(2, rows=500, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=0.6)
    ebc = dmp.module.ebc
    batches = [make_batch(tables, 8, seed=rank * 10 + i) for i in range(6)]
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    it = iter(batches)
    pipe.progress(it)
    pipe.progress(it)  # stop with batches still in flight
    pipe.reset()
    ebc.check_invariants(expect_drained=True)
    dmp.eval()
    before = {k: v.clone() for k, v in _params(dmp).items()}
    eval_outs = _run(pipe, batches)
    ebc.check_invariants(expect_drained=True)
    unchanged = all(torch.equal(before[k], v) for k, v in _params(dmp).items())
    # A plain forward outside the pipeline (reactive at depth 0) also releases its pins.
    pipe.detach()
    ebc.set_prefetch_depth(0)
    with torch.no_grad():
        dmp(batches[0])
    ebc.check_invariants(expect_drained=True)
    return {"eval_n": len(eval_outs), "unchanged": unchanged}


def state_dict_interop(rank: int, world_size: int, sharding: str) -> Dict[str, Any]:
    tables = make_tables(3, rows=400, dim=8)
    torch.manual_seed(5)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_batch(tables, 16, seed=rank * 10 + i) for i in range(4)]
    # Train with the plugin (small cache, so dirty rows sit in the cache at the end).
    dmp, opt = _proactive(tables, seed_state, sharding=sharding, cache_load_factor=0.5)
    _run(ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2), batches)
    trained = dmp.state_dict()
    # ... load into stock TorchRec (fused kernel, all rows resident).
    stock_sharder = EmbeddingBagCollectionSharder(fused_params=dict(FUSED))
    torch.manual_seed(0)
    model = SparseModel(tables)
    stock = shard_model(model, stock_sharder, build_plan(model, stock_sharder, sharding, kernel="fused"), torch.device("cpu"))
    stock.load_state_dict(copy.deepcopy(trained))
    stock_params, ours = _params(stock), _params(dmp)
    to_stock = sorted(stock_params) == sorted(ours) and all(torch.equal(stock_params[k], ours[k]) for k in ours)
    shapes_match = all(stock_params[k].shape == ours[k].shape for k in ours)
    # ... and stock -> plugin: the loaded weights must be what the cache serves next.
    dmp2, _ = _proactive(tables, seed_state, sharding=sharding, cache_load_factor=0.5)
    dmp2.load_state_dict(copy.deepcopy(stock.state_dict()))
    dmp2.eval()
    stock.eval()
    with torch.no_grad():
        a = dmp2(batches[0])[1]
        b = stock(batches[0])[1]
    return {"to_stock": to_stock, "shapes_match": shapes_match, "from_stock_pred_diff": float((a - b).abs().max())}


def checkpoint_resume(rank: int, world_size: int, optimizer: str) -> Dict[str, Any]:
    """Model + optimizer state_dicts mid-training resume bit-identically (cache of 60%)."""
    from .exactness_worker import FUSED as ALL_FUSED

    tables = make_tables(3, rows=400, dim=8)
    torch.manual_seed(3)
    seed_state = SparseModel(tables).state_dict()
    batches = [make_batch(tables, 16, seed=rank * 10 + i) for i in range(7)]

    def build():
        sharder = ProactiveEmbeddingBagCollectionSharder(fused_params=dict(ALL_FUSED[optimizer]), cache_load_factor=0.6)
        torch.manual_seed(0)
        model = SparseModel(tables)
        dmp = shard_model(model, sharder, build_plan(model, sharder, "row_wise"), torch.device("cpu"))
        dmp.load_state_dict(copy.deepcopy(seed_state))
        return dmp, combined_optimizer(dmp, lambda p: torch.optim.Adagrad(p, lr=LR))

    dmp, opt = build()
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    _run(pipe, batches[:4])
    saved_model = copy.deepcopy(dmp.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    cont = _run(pipe, batches[4:])
    final = _params(dmp)

    dmp2, opt2 = build()
    dmp2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    opt2.set_optimizer_step(4)  # TorchRec/FBGEMM keep the step counter out of the state dict
    resumed = _run(ProactiveTrainPipeline(dmp2, opt2, torch.device("cpu"), prefetch_depth=1), batches[4:])
    final2 = _params(dmp2)
    return {
        "outputs_equal": all(torch.equal(a, b) for a, b in zip(cont, resumed)),
        "params_equal": all(torch.equal(final[k], final2[k]) for k in final),
        "state_keys": sorted(k for st in saved_opt["state"].values() for k in st)[:4],
    }


def deferred_batches_prepare_once(rank: int, world_size: int) -> Dict[str, Any]:
    """A prefetch that waits for pins is retried on the store only: its ids -> rows work
    (prepare_batch) runs once per batch and kernel, however many plans it takes."""
    tables = make_tables(2, rows=400, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=0.1)
    ebc = dmp.module.ebc
    calls = {"prepare": 0, "plan": 0}
    for kernel in ebc._proactive_kernels:  # count the calls of the real methods
        def counted(name, fn):
            def call(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return call
        kernel.prepare_batch = counted("prepare", kernel.prepare_batch)
        kernel.plan_prepared = counted("plan", kernel.plan_prepared)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=4)
    steps = 8
    _run(pipe, [make_batch(tables, 16, seed=rank * 10 + i) for i in range(steps)])
    ebc.check_invariants(expect_drained=True)
    return {"calls": calls, "kernels": len(ebc._proactive_kernels), "steps": steps, "stats": pipe.stats()}


def _pipeline_steps(pipe, it, n) -> List[torch.Tensor]:
    """``n`` progress calls (fewer if the iterator runs dry); each step's logits."""
    outs = []
    for _ in range(n):
        try:
            outs.append(pipe.progress(it).detach())
        except StopIteration:
            break
    return outs


def interleaved_validation(rank: int, world_size: int, load_factor: float, validation: str,
                           planner: str = "auto") -> Dict[str, Any]:
    """A training pipeline stops mid-epoch (its batches in flight), a second pipeline on the
    same model runs a validation pass, training resumes: the same as stock TorchRec doing
    the same with its own pipelines, at caches that force evictions."""
    from torchrec.distributed.train_pipeline import EvalPipelineSparseDist, TrainPipelineSparseDist

    tables = make_tables(3, rows=800, dim=8)
    torch.manual_seed(11)
    seed_state = SparseModel(tables).state_dict()
    train = [make_batch(tables, 16, seed=100 * rank + i) for i in range(10)]
    val = [make_batch(tables, 16, seed=5000 + 100 * rank + i) for i in range(4)]
    device = torch.device("cpu")

    def run(dmp, opt, make_train, make_val):
        pipe = make_train(dmp, opt)
        it = iter(train)
        outs = _pipeline_steps(pipe, it, 4)  # stops with k + 1 batches in flight
        dmp.eval()
        val_outs = []
        if validation == "plain_forward":  # TorchRec's way back to plain forwards, mid-epoch
            pipe.detach()
            with torch.no_grad():
                for b in val:
                    val_outs.append(dmp(b)[1])
        else:
            val_outs = _pipeline_steps(make_val(dmp, opt), iter(val), 100)
        dmp.train()
        outs += _pipeline_steps(pipe, it, 100)
        return outs, val_outs, _params(dmp)

    stock_sharder = EmbeddingBagCollectionSharder(fused_params=dict(FUSED))
    torch.manual_seed(0)
    model = SparseModel(tables)
    stock = shard_model(model, stock_sharder, build_plan(model, stock_sharder, "row_wise", kernel="fused"), device)
    stock.load_state_dict(copy.deepcopy(seed_state))
    sopt = combined_optimizer(stock, lambda p: torch.optim.SGD(p, lr=LR))
    stock_val = {"proactive": TrainPipelineSparseDist, "stock_train": TrainPipelineSparseDist,
                 "stock_eval": EvalPipelineSparseDist, "plain_forward": None}[validation]
    ref = run(stock, sopt, lambda d, o: TrainPipelineSparseDist(d, o, device),
              lambda d, o: stock_val(d, o, device))

    dmp, opt = _proactive(tables, seed_state, cache_load_factor=load_factor, planner=planner)
    ours_val = {"proactive": lambda d, o: ProactiveTrainPipeline(d, o, device, prefetch_depth=2),
                "stock_train": lambda d, o: TrainPipelineSparseDist(d, o, device),
                "stock_eval": lambda d, o: EvalPipelineSparseDist(d, o, device),
                "plain_forward": None}[validation]
    got = run(dmp, opt, lambda d, o: ProactiveTrainPipeline(d, o, device, prefetch_depth=2), ours_val)
    dmp.module.ebc.check_invariants(expect_drained=True)

    def diff(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b)) if a else 0.0

    return {"n": [len(x) for x in got[:2]], "n_ref": [len(x) for x in ref[:2]],
            "train_diff": diff(got[0], ref[0]), "val_diff": diff(got[1], ref[1]),
            "param_diff": max(float((got[2][k] - ref[2][k]).abs().max()) for k in ref[2]),
            "stats": dmp.module.ebc.proactive_stats.snapshot()}


def leaked_pins(rank: int, world_size: int) -> Dict[str, Any]:
    """Forwards whose backward never comes, a pipeline dropped without reset() and a load of
    the model and optimizer while another pipeline has batches in flight: no pin outlives
    its batch, nothing refuses, and the loads apply whole."""
    import gc

    tables = make_tables(2, rows=500, dim=8)
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), cache_load_factor=0.4)
    ebc = dmp.module.ebc
    store = ebc.proactive_kernels[0].store
    batches = [make_batch(tables, 16, seed=rank * 10 + i) for i in range(8)]
    out: Dict[str, Any] = {}
    # 1. After detach(), forwards with grad in train mode whose loss is dropped (a metric peek).
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    _run(pipe, batches[:3])
    pipe.detach()
    for b in batches[:6]:
        loss, _ = dmp(b)
        del loss
    out["in_flight_after_peeks"] = store.in_flight  # (releases what the dropped graphs left)
    out["pins_after_peeks"] = int(store.planner.pins.sum())
    out["slots"] = store.num_slots
    snapshot = copy.deepcopy(dmp.state_dict())
    dmp.load_state_dict(copy.deepcopy(snapshot))  # used to refuse: "batch(es) are in flight"
    out["load_after_peeks"] = True
    # 2. A pipeline dropped mid-epoch without reset(); a new one trains on.
    pipe2 = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    it = iter(batches)
    pipe2.progress(it)
    del pipe2, it
    gc.collect()
    pipe3 = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    _run(pipe3, batches[:4])
    ebc.check_invariants(expect_drained=True)
    out["drained_after_drop"] = True
    # 3. Loads while a live pipeline holds batches in flight apply whole: the next lookups
    #    read the loaded values (as stock's would).
    pipe4 = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    it = iter(batches)
    pipe4.progress(it)
    opt_state = copy.deepcopy(opt.state_dict())
    target = copy.deepcopy(dmp.state_dict())
    for k, v in target.items():
        for shard in (v.local_shards() if hasattr(v, "local_shards") else []):
            shard.tensor.fill_(0.5)
    dmp.load_state_dict(target)
    opt.load_state_dict(opt_state)
    loaded = _params(dmp)
    out["model_load_applied"] = all(bool((v == 0.5).all()) for k, v in loaded.items() if "ebc" in k)
    # The batch prefetched before the load is looked up with the loaded rows.
    dmp.eval()
    with torch.no_grad():
        pooled = dmp.module.ebc(batches[1].sparse_features).values()
    out["lookup_after_load_reads_loaded_rows"] = bool(((pooled == 0) | (pooled % 0.5 == 0)).all())
    dmp.train()
    pipe4.reset()
    ebc.check_invariants(expect_drained=True)
    return out


def per_table_stats(rank: int, world_size: int) -> Dict[str, Any]:
    """``stats(per_table=True)`` and ``reset_stats()`` on one rank: t0 and t1 (one dim) share
    a TorchRec group and so one store; t2 (another dim) has its own."""
    from torchrec import EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=500, feature_names=[f"f{i}"])
              for i, dim in enumerate((8, 8, 16))]
    dmp, opt = _proactive(tables, SparseModel(tables).state_dict(), sharding="table_wise", cache_load_factor=0.3)
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    _run(pipe, [make_batch(tables, 16, seed=i) for i in range(5)])
    before = {"total": pipe.stats(), "tables": pipe.stats(per_table=True)}
    pipe.reset_stats()
    reset = {"total": pipe.stats(), "tables": pipe.stats(per_table=True)}
    _run(pipe, [make_batch(tables, 16, seed=10 + i) for i in range(3)])
    after = {"total": pipe.stats(), "tables": pipe.stats(per_table=True)}
    return {"before": before, "reset": reset, "after": after}


@torch.fx.wrap
def _clip_dense(dense: torch.Tensor) -> torch.Tensor:
    # data-dependent Python (a host read): FX cannot trace it, but a wrapped function is one call
    return dense.clamp(-1e6, 1e6) if float(dense.abs().max()) > 1e6 else dense


class _DataDependentModel(SparseModel):
    """A forward with data-dependent Python on a tensor: ``wrapped`` puts it in a function
    decorated with ``torch.fx.wrap``, as the pipeline's error advises."""

    def __init__(self, tables, wrapped: bool) -> None:
        super().__init__(tables)
        self.wrapped = wrapped

    def forward(self, batch):
        dense = batch.dense_features
        if self.wrapped:
            dense = _clip_dense(dense)
        elif float(dense.abs().max()) > 1e6:
            dense = dense.clamp(-1e6, 1e6)
        pooled = self.ebc(batch.sparse_features).to_dict()
        x = torch.cat([pooled[f] for f in self.feature_names] + [dense], dim=1)
        logits = self.over(x).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def untraceable_forward(rank: int, world_size: int, wrapped: bool) -> Dict[str, Any]:
    """A model whose forward FX cannot trace: the pipeline's error says why and what to do;
    the same model with the data-dependent part in a ``torch.fx.wrap`` function trains."""
    tables = make_tables(2, rows=200, dim=8)
    model = _DataDependentModel(tables, wrapped)
    sharder = ProactiveEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                                   "learning_rate": LR}, cache_load_factor=0.2)
    dmp = shard_model(model, sharder, build_plan(model, sharder, "table_wise"), torch.device("cpu"))
    opt = combined_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=LR))
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    try:
        out = _run(pipe, [make_batch(tables, 8, seed=i) for i in range(4)])
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": type(e).__name__, "message": str(e), "cause": type(e.__cause__).__name__}
    return {"steps": len(out), "lead": pipe.stats()["prefetch_lead_lookups"]}


class _ReorderedInputModel(SparseModel):
    """Hands its EBC a KJT made in forward (its keys reordered), not the batch's own: TorchRec's
    pipeline cannot start that input's all-to-all ahead, so it leaves the module unpipelined."""

    def forward(self, batch):
        reordered = batch.sparse_features.permute([1, 0])  # (two features)
        pooled = self.ebc(reordered).to_dict()
        x = torch.cat([pooled[f] for f in self.feature_names] + [batch.dense_features], dim=1)
        logits = self.over(x).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def unpipelined_module(rank: int, world_size: int) -> Dict[str, Any]:
    """A proactive module TorchRec's pipeline leaves unpipelined trains, fetching at lookup;
    returns the warnings the pipeline gave and its counters."""
    import warnings

    tables = make_tables(2, rows=200, dim=8)
    model = _ReorderedInputModel(tables)
    sharder = ProactiveEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                                   "learning_rate": LR}, cache_load_factor=0.2)
    dmp = shard_model(model, sharder, build_plan(model, sharder, "table_wise"), torch.device("cpu"))
    opt = combined_optimizer(dmp, lambda p: torch.optim.SGD(p, lr=LR))
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _run(pipe, [make_batch(tables, 8, seed=i) for i in range(4)])
    ebc = dmp.module.ebc
    return {"steps": len(out), "warnings": [str(w.message) for w in caught if "pipelined" in str(w.message)],
            "lookups": ebc.proactive_stats.batches, "lead": ebc.proactive_stats.prefetch_lead_lookups}


class _TwoModuleModel(torch.nn.Module):
    """A user trial's model: a history table (``history``: an EC, or an EBC with
    ``history_as="ebc"``) and an EBC of ``user`` and ``cat``, both fed from one KJT, their
    outputs used in the other order than the modules were called."""

    def __init__(self, history_as: str) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

        meta = torch.device("meta")
        if history_as == "ec":
            self.history = EmbeddingCollection(tables=[EmbeddingConfig(
                name="t_history", embedding_dim=16, num_embeddings=4000, feature_names=["history"])], device=meta)
        else:
            self.history = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name="t_history", embedding_dim=16, num_embeddings=4000, feature_names=["history"])], device=meta)
        self.history_as = history_as
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_user", embedding_dim=16, num_embeddings=1000, feature_names=["user"]),
            EmbeddingBagConfig(name="t_cat", embedding_dim=16, num_embeddings=500, feature_names=["cat"])], device=meta)
        self.dense = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        self.over = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, batch):
        kjt = batch.sparse_features
        seq = self.history(kjt)
        pooled = self.ebc(kjt)
        user, cat = pooled["user"], pooled["cat"]
        if self.history_as == "ec":
            hist = seq["history"]
            values, lengths = hist.values(), hist.lengths()
            seg = torch.repeat_interleave(torch.arange(user.shape[0]), lengths)
            history = torch.zeros_like(user).index_add(0, seg, values)
        else:
            history = seq["history"]
        logits = self.over(torch.cat([self.dense(batch.dense_features), user, cat, history], dim=1)).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def _two_module_batch(g: torch.Generator):
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    hl = torch.randint(1, 9, (32,), generator=g)
    hist = ((torch.rand(int(hl.sum()), generator=g) ** 3) * 4000).long()
    user = ((torch.rand(32, generator=g) ** 2) * 1000).long()
    cl = torch.randint(1, 3, (32,), generator=g)
    cat = ((torch.rand(int(cl.sum()), generator=g) ** 2) * 500).long()
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["history", "user", "cat"], values=torch.cat([hist, user, cat]),
                                              lengths=torch.cat([hl, torch.ones(32, dtype=torch.long), cl]).int())
    return Batch(dense_features=torch.rand(32, 8, generator=g), sparse_features=kjt,
                 labels=(user % 3 == 0).float())


def modules_on_different_ranks(rank: int, world_size: int, depth: int, history_as: str,
                               load_factors: Dict[str, float]) -> Dict[str, Any]:
    """The user trial's two modules from one KJT, planned by TorchRec's planner (the history
    and cat tables table-wise on one rank, user column-wise on both), at ``depth``: the ranks
    must run the same collectives in the same order (gloo pairs them by order) whether a rank
    holds a module's kernels or not and whether its prefetches wait for cache room."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import CacheParams

    from torchrec_proactive import ProactiveEmbeddingCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
    torch.manual_seed(1234)
    model = _TwoModuleModel(history_as)
    sharders = [ProactiveEmbeddingBagCollectionSharder(fused_params=fused)]
    if history_as == "ec":
        sharders.insert(0, ProactiveEmbeddingCollectionSharder(fused_params=fused))
    types = {"t_history": "table_wise", "t_user": "column_wise", "t_cat": "table_wise"}
    constraints = {t: ParameterConstraints(compute_kernels=["fused_uvm_caching"], sharding_types=[st],
                                           cache_params=CacheParams(load_factor=load_factors[t]))
                   for t, st in types.items()}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders, device=torch.device("cpu"))
    opt = combined_optimizer(dmp, lambda p: torch.optim.Adagrad(p, lr=0.01))
    pipe = ProactiveTrainPipeline(dmp, opt, torch.device("cpu"), prefetch_depth=depth)
    g = torch.Generator().manual_seed(rank)
    out = _run(pipe, [_two_module_batch(g) for _ in range(10)])
    return {"steps": len(out), "deferred": pipe.stats()["deferred_batches"]}
