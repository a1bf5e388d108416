"""Fused optimizer semantics as FBGEMM's, parameter by parameter: against FBGEMM's CPU TBE (the
kernel stock TorchRec runs on CPU) wherever that kernel implements the rule, against FBGEMM's
CUDA formula where it does not (Adam, max_norm, stochastic rounding), and against stock
TorchRec end to end. docs/optimizers.md has the table these tests pin down."""

from __future__ import annotations

import struct

import pytest
import torch

from torchrec_proactive.fetch import FetchEngine, InlineTransport
from torchrec_proactive.launch import run_ranks
from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable
from torchrec_proactive.store.optimizers import (
    WeightDecayMode,
    rounding_bits,
    stochastic_round_fp16,
    update_rows,
)

from . import optimizer_worker
from .test_store import DIM, ROWS, train_store, zipf_batches


def _cpu_tbe(optim: OptimType, **kwargs):
    """FBGEMM's CPU TBE over one ROWS x DIM table with the given TBE arguments."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType(optim.value), **kwargs
    )


def _train_both(optim: OptimType, fused: dict, tbe_kwargs: dict, batches, dtype=torch.float32, slots: int = 60):
    """The same batches through FBGEMM's CPU TBE and through a store configured from the same
    fused params; returns (store, tbe)."""
    tbe = _cpu_tbe(optim, **fused, **tbe_kwargs)
    init = tbe.split_embedding_weights()[0].detach().clone()
    assert init.dtype == dtype
    cfg = OptimizerConfig.from_fused_params({"optimizer": optim.value, **fused})
    table = TieredTable("t", init.clone(), cfg, num_slots=slots)
    train_store(table, FetchEngine(InlineTransport()), batches, depth=1)
    for values, offsets, _, grad in batches:
        tbe(values, offsets).backward(grad)
    FetchEngine().flush([table])
    return table, tbe


def _assert_same_as_tbe(table, tbe, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(table.host_weight, tbe.split_embedding_weights()[0].detach(), rtol=rtol, atol=atol)
    if "momentum1" in table.host_state:
        torch.testing.assert_close(table.host_state["momentum1"].view(-1), tbe.split_optimizer_states()[0][0].view(-1),
                                   rtol=1e-5, atol=1e-7)


# (optimizer, weight_decay_mode, table dtype). Row-wise Adagrad's L2 and DECOUPLE modes are
# compared on FP16 tables: FBGEMM's CPU kernel runs FP32 tables that no second feature shares
# through its fbgemm fast path, which passes weight_decay=0 (its CUDA kernels and its generic
# CPU path, FP16 tables included, apply the mode; we follow them).
WEIGHT_DECAY_CASES = {
    "sgd": (OptimType.EXACT_SGD, WeightDecayMode.L2, torch.float32),  # ignored whatever the mode
    "adagrad": (OptimType.EXACT_ADAGRAD, WeightDecayMode.L2, torch.float32),  # ignored whatever the mode
    "rowwise-default-mode": (OptimType.EXACT_ROWWISE_ADAGRAD, None, torch.float32),  # NONE: ignored
    "rowwise-l2": (OptimType.EXACT_ROWWISE_ADAGRAD, WeightDecayMode.L2, torch.float16),
    "rowwise-decouple": (OptimType.EXACT_ROWWISE_ADAGRAD, WeightDecayMode.DECOUPLE, torch.float16),
}


@pytest.mark.parametrize("case", list(WEIGHT_DECAY_CASES))
def test_weight_decay_per_optimizer_matches_fbgemm_cpu_tbe(case):
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode as FbgemmMode

    optim, mode, dtype = WEIGHT_DECAY_CASES[case]
    fused = {"learning_rate": 0.1, "eps": 1e-3, "weight_decay": 0.3}
    if mode is not None:
        fused["weight_decay_mode"] = FbgemmMode(int(mode))
    precision = {"weights_precision": SparseType.FP16} if dtype == torch.float16 else {}
    table, tbe = _train_both(optim, fused, precision, zipf_batches(8, seed=11), dtype=dtype)
    # FP16: within one FP16 step (FBGEMM's C++ may fuse the multiply-add of the new row).
    _assert_same_as_tbe(table, tbe, **({"rtol": 2**-10, "atol": 2**-24} if dtype == torch.float16 else {}))
    undecayed, _ = _train_both(optim, {"learning_rate": 0.1, "eps": 1e-3}, precision, zipf_batches(8, seed=11),
                               dtype=dtype)
    ignored = mode is None or optim is not OptimType.EXACT_ROWWISE_ADAGRAD
    assert torch.equal(undecayed.host_weight, table.host_weight) == ignored


@pytest.mark.parametrize("optim", [OptimType.EXACT_SGD, OptimType.EXACT_ADAGRAD, OptimType.EXACT_ROWWISE_ADAGRAD])
def test_gradient_clipping_matches_fbgemm_cpu_tbe(optim):
    # The batches' output gradients are N(0, 1): a bound of 0.3 clamps most of them.
    fused = {"learning_rate": 0.1, "eps": 1e-3, "gradient_clipping": True, "max_gradient": 0.3}
    table, tbe = _train_both(optim, fused, {}, zipf_batches(8, seed=12))
    _assert_same_as_tbe(table, tbe)
    unclipped, _ = _train_both(optim, {"learning_rate": 0.1, "eps": 1e-3}, {}, zipf_batches(8, seed=12))
    assert not torch.allclose(unclipped.host_weight, table.host_weight), "the bound clamped nothing"


@pytest.mark.parametrize("optim", [OptimType.EXACT_SGD, OptimType.EXACT_ADAGRAD, OptimType.EXACT_ROWWISE_ADAGRAD])
@pytest.mark.parametrize("slots", [60, ROWS])
def test_fp16_tables_match_fbgemm_cpu_tbe(optim, slots):
    """FP16 storage, FP32 arithmetic, one rounding to nearest per update (FBGEMM's CUDA rule;
    its CPU kernel ignores stochastic_rounding, on here as FBGEMM's default). Row-wise Adagrad
    is bit for bit FBGEMM's CPU TBE. For SGD and Adagrad that kernel rounds twice - the change
    to FP16 (``Half -= float`` converts the float first), then the sum - so there the tables
    agree within a few FP16 steps (8 updates of the hottest rows)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode as FbgemmMode

    fused = {"learning_rate": 0.1, "eps": 1e-3, "stochastic_rounding": True}
    if optim is OptimType.EXACT_ROWWISE_ADAGRAD:
        fused.update(weight_decay=0.3, weight_decay_mode=FbgemmMode.L2)
    table, tbe = _train_both(optim, fused, {"weights_precision": SparseType.FP16}, zipf_batches(8, seed=14),
                             dtype=torch.float16, slots=slots)
    assert table.host_weight.dtype == torch.float16
    if optim is OptimType.EXACT_ROWWISE_ADAGRAD:
        _assert_same_as_tbe(table, tbe, rtol=0, atol=0)
    else:
        _assert_same_as_tbe(table, tbe, rtol=8 * 2**-10, atol=2**-14)


@pytest.mark.parametrize("optim", [OptimType.EXACT_SGD, OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM])
def test_fp16_tables_are_bit_identical_across_depths_caches_and_overflow(optim):
    """The FP16 rule (FP32 arithmetic, one rounding) gives the same bits whatever holds a row:
    any prefetch depth, any cache size, and rows served from the host tier (overflow)."""
    from torchrec_proactive.store import plan_table_batch, pooled_lookup

    batches = zipf_batches(10, seed=21)
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(2)).half()
    cfg = OptimizerConfig(optim, learning_rate=0.05, eps=1e-3, weight_decay=0.1, weight_decay_mode=WeightDecayMode.L2)
    ws = max(int(torch.unique(b[0]).numel()) for b in batches)
    results = []
    for depth, slots in [(0, ROWS), (0, ws), (2, 3 * ws), (4, 5 * ws + 7)]:
        table = TieredTable("t", init.clone(), cfg, num_slots=slots)
        train_store(table, FetchEngine(InlineTransport()), batches, depth)
        FetchEngine().flush([table])
        results.append((table.host_weight.clone(), {k: v.clone() for k, v in table.host_state.items()}))
    # A cache of 5 slots: most of every batch is read from and updated in the host tier.
    table = TieredTable("t", init.clone(), cfg, num_slots=5)
    anchor = torch.empty(0, requires_grad=True)
    for values, offsets, _, grad in batches:
        tb = plan_table_batch(table, values, offsets, overflow=True)
        FetchEngine().run([tb.plan])
        pooled_lookup(tb, anchor).backward(grad)
    FetchEngine().flush([table])
    results.append((table.host_weight.clone(), {k: v.clone() for k, v in table.host_state.items()}))
    w0, s0 = results[0]
    assert w0.dtype == torch.float16 and not torch.equal(w0, init)
    for w, st in results[1:]:
        assert torch.equal(w, w0) and all(torch.equal(st[k], s0[k]) for k in s0)


def _adam_reference(w, g_steps, lr, eps, b1, b2, wd):
    """FBGEMM's CUDA Adam (its CPU TBE has none), element by element, steps 1..n."""
    m1 = torch.zeros_like(w)
    m2 = torch.zeros_like(w)
    for t, g in enumerate(g_steps, start=1):
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b2 * m2 + (1 - b2) * g * g
        w = w - lr * (m1 / (1 - b1**t) / (torch.sqrt(m2 / (1 - b2**t)) + eps) + wd * w)
    return w, m1, m2


@pytest.mark.parametrize("mode", [WeightDecayMode.NONE, WeightDecayMode.L2, WeightDecayMode.DECOUPLE])
def test_adam_applies_weight_decay_inside_its_step_whatever_the_mode(mode):
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(5, DIM, generator=g)
    grads = [torch.randn(5, DIM, generator=g) for _ in range(4)]
    cfg = OptimizerConfig(OptimType.ADAM, learning_rate=0.05, eps=1e-6, beta1=0.8, beta2=0.95,
                          weight_decay=0.2, weight_decay_mode=mode)
    w = w0.clone()
    state = {k: torch.zeros(5, *s) for k, s in cfg.state_shapes(DIM).items()}
    for t, grad in enumerate(grads, start=1):
        update_rows(cfg, w, state, torch.arange(5), grad, t)
    want_w, want_m1, want_m2 = _adam_reference(w0, grads, 0.05, 1e-6, 0.8, 0.95, 0.2)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["momentum1"], want_m1)
    torch.testing.assert_close(state["momentum2"], want_m2)


def test_rowwise_max_norm_follows_fbgemm_cuda():
    # FBGEMM applies max_norm in its CUDA kernel only (its CPU kernel ignores it): rows whose
    # new norm exceeds it are scaled to it; the others are left as updated.
    cfg = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3, max_norm=1.0)
    w = torch.tensor([[3.0, 4.0], [0.1, 0.2]])
    state = {"momentum1": torch.zeros(2)}
    grad = torch.tensor([[0.5, -0.5], [0.1, 0.1]])
    update_rows(cfg, w, state, torch.arange(2), grad, 1)
    plain = torch.tensor([[3.0, 4.0], [0.1, 0.2]])
    update_rows(OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-3), plain,
                {"momentum1": torch.zeros(2)}, torch.arange(2), grad, 1)
    torch.testing.assert_close(w[0], plain[0] / plain[0].norm())
    assert torch.equal(w[1], plain[1])


def test_unsupported_weight_decay_modes_are_refused_by_name():
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode as FbgemmMode

    with pytest.raises(ValueError, match="weight_decay_mode='COUNTER' is not supported"):
        OptimizerConfig.from_fused_params({"optimizer": "exact_row_wise_adagrad", "weight_decay_mode": FbgemmMode.COUNTER})


# ---------------------------------------------------------------- stochastic rounding (CUDA rule)
def _fbgemm_scalar_rounding(x: float, random_value: int) -> float:
    """FBGEMM's ``stochastic_rounding_scalar`` written out on one FP32 value."""
    w_int = struct.unpack("<I", struct.pack("<f", x))[0]
    assembles = (w_int & 0xFF800000) | (random_value >> 19)
    subtract = w_int & 0xFF800000
    as_float = lambda i: struct.unpack("<f", struct.pack("<I", i))[0]  # noqa: E731
    y = torch.tensor(x, dtype=torch.float32) + torch.tensor(as_float(assembles) - as_float(subtract),
                                                            dtype=torch.float32)
    # round toward zero into FP16: the nearest value not further from zero than y
    h = y.half()
    if abs(float(h)) > abs(float(y)):
        h = torch.tensor(struct.unpack("<e", struct.pack("<H", struct.unpack("<H", h.numpy().tobytes())[0] - 1))[0],
                         dtype=torch.float16)
    return float(h)


def test_stochastic_rounding_is_fbgemms_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(200, generator=g) * s for s in (1e-3, 1.0, 100.0)])
    bits = torch.randint(0, 2**32, x.shape, generator=g, dtype=torch.int64)
    got = stochastic_round_fp16(x, bits)
    want = torch.tensor([_fbgemm_scalar_rounding(float(v), int(b)) for v, b in zip(x, bits)], dtype=torch.float16)
    assert torch.equal(got, want)
    # Values FP16 holds exactly stay as they are, whatever the noise.
    exact = torch.tensor([0.5, -1.25, 3.0, 1024.0])
    assert torch.equal(stochastic_round_fp16(exact, torch.full((4,), 2**32 - 1)), exact.half())


def test_stochastic_rounding_is_unbiased_and_reproducible():
    # 1 + a third of an FP16 step: rounds up a third of the time over many (step, row) keys.
    ulp = 2.0**-10
    x = torch.full((4000, DIM), 1.0 + ulp / 3)
    rows = torch.arange(4000)
    r1 = stochastic_round_fp16(x, rounding_bits(seed=0, step=7, rows=rows, dim=DIM))
    assert set(r1.unique().tolist()) == {1.0, 1.0 + ulp}
    up = float((r1 > 1).float().mean())
    assert abs(up - 1 / 3) < 0.01, up
    # A pure function of (seed, step, row, column): the same key gives the same draw ...
    again = stochastic_round_fp16(x[:10], rounding_bits(seed=0, step=7, rows=rows[:10], dim=DIM))
    assert torch.equal(again, r1[:10])
    # ... and the row order (which slot holds a row) does not matter.
    perm = torch.randperm(4000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(stochastic_round_fp16(x, rounding_bits(0, 7, rows[perm], DIM)), r1[perm])
    assert not torch.equal(stochastic_round_fp16(x, rounding_bits(0, 8, rows, DIM)), r1)


def test_fp16_update_with_the_cuda_rule_rounds_the_fp32_result_once():
    """``update_rows`` with the rows' ids (what a CUDA table passes) rounds each new FP32 row
    stochastically: every entry is one of the two FP16 neighbours of the FP32 result."""
    g = torch.Generator().manual_seed(5)
    w16 = torch.randn(50, DIM, generator=g).half()
    grad = torch.randn(50, DIM, generator=g) * 1e-3  # small updates: rounding decides them
    cfg = OptimizerConfig(OptimType.EXACT_SGD, learning_rate=0.1)
    exact = w16.float() - 0.1 * grad
    nearest = w16.clone()
    update_rows(cfg, nearest, {}, torch.arange(50), grad, 1)
    assert torch.equal(nearest, exact.half())
    rows = torch.arange(1000, 1050)
    stochastic = w16.clone()
    update_rows(cfg, stochastic, {}, torch.arange(50), grad, 1, stochastic_rows=rows)
    lo = torch.where(exact >= 0, exact.half().float().clamp(max=exact), exact.half().float().clamp(min=exact))
    assert bool(((stochastic.float() - exact).abs() < (exact.half().float() - exact).abs() + 2 * (exact.abs() * 2**-10)).all())
    assert not torch.equal(stochastic, nearest), "stochastic rounding rounded every entry to nearest"
    # Reproducible, and keyed by row id, not by where the row sits.
    again = w16.flip(0).clone()
    update_rows(cfg, again, {}, torch.arange(50), grad.flip(0), 1, stochastic_rows=rows.flip(0))
    assert torch.equal(again.flip(0), stochastic)
    del lo


# ---------------------------------------------------------------- against stock TorchRec
STOCK_OPTIMS = ["exact_sgd", "exact_adagrad", "exact_row_wise_adagrad"]


@pytest.fixture(scope="module")
def one_rank():
    """The module's 1-rank cases in one launch (starting a rank costs more than a case)."""
    from .cases_worker import call, launch_cases

    cases = [*((optim, dict(fn=optimizer_worker.train_vs_stock, lr_gamma=0.5, hyper={"eps": 1e-2, "weight_decay": 0.5},
                            fused={"optimizer": optim, "learning_rate": 0.05, "eps": 1e-3, "weight_decay": 0.3,
                                   "gradient_clipping": True, "max_gradient": 0.002}))
               for optim in STOCK_OPTIMS),
             *((("adam_counter", between), dict(fn=optimizer_worker.adam_counter, eval_between=between))
               for between in (True, False))]
    return launch_cases(call, [key for key, _ in cases], [kwargs for _, kwargs in cases], world_size=1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("optim", STOCK_OPTIMS)
def test_weight_decay_clipping_and_lr_scheduler_match_stock_torchrec(one_rank, optim):
    """fused_params with weight_decay=0.3, gradient clipping, a StepLR over the combined
    optimizer and ``update_hyper_parameters`` (eps, weight_decay) mid-run: the same logits
    every step and the same tables and state as stock TorchRec (1 rank)."""
    from .cases_worker import ok

    (res,) = ok(one_rank[optim])
    assert res["steps"] == 10 and res["same_keys"]
    assert res["out_diff"] < 1e-6 and res["table_diff"] < 1e-6 and res["state_diff"] < 1e-6, res
    assert res["lrs"] == pytest.approx(res["stock_lrs"]) and res["lrs"][0] == pytest.approx(0.05 * 0.5**5)
    assert res["eps"] and all(e == 1e-2 for e in res["eps"]), res["eps"]  # the change reached the tables


@pytest.mark.multiprocess
def test_fp16_tables_match_stock_torchrec_on_two_ranks():
    """FP16 tables, row-wise Adagrad (L2 weight decay), row-wise sharding, a 10% cache at
    depth 2: the logits of every step and the final tables as stock TorchRec's."""
    fused = {"optimizer": "exact_row_wise_adagrad", "learning_rate": 0.05, "eps": 1e-3, "weight_decay": 0.3,
             "weight_decay_mode": WeightDecayMode.L2.value}
    for res in run_ranks(optimizer_worker.train_vs_stock, world_size=2, fused=fused, data_type="fp16",
                         sharding="row_wise", steps=12):
        assert res["dtypes"] == res["stock_dtypes"] == ["torch.float16"], res
        assert res["steps"] == 12 and res["same_keys"]
        # 1e-6 is a small fraction of one FP16 step at these weights' magnitude (~3e-5 at
        # 0.05): only an entry near zero may round the other way (summation order across ranks).
        assert res["out_diff"] < 1e-6 and res["table_diff"] < 1e-6 and res["state_diff"] < 1e-6, res


@pytest.mark.multiprocess
def test_adam_step_counter_advances_on_every_forward(one_rank):
    from .cases_worker import ok

    (a,) = ok(one_rank[("adam_counter", True)])
    (b,) = ok(one_rank[("adam_counter", False)])
    assert a["steps"] and all(s == 3 for s in a["steps"]), a["steps"]
    assert a["params"] == b["params"]
