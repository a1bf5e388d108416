"""FP16 stochastic rounding as one fused op (issue 30, item 6): on a GPU the rounding of an
update is one kernel over the updated rows, reading each FP32 value once and writing its
FP16 value once; its Triton kernel (run by Triton's interpreter on the CPU) gives the
reference's bits exactly, so a row rounds the same on either tier and at any cache size."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from torchrec_proactive.store.cost_counter import CostCounter
from torchrec_proactive.store.optimizers import round_rows, rounding_bits, stochastic_round_fp16
from torchrec_proactive.store.sync_detector import fake_cuda


def test_rounding_an_update_on_a_gpu_is_one_launch_touching_each_value_twice():
    n, dim = 4096, 128
    counter = CostCounter()
    with fake_cuda():
        values = torch.empty(n, dim, device="cuda")
        rows = torch.empty(n, dtype=torch.int64, device="cuda")
        with counter, counter.phase("round"):
            out = round_rows(values, torch.float16, rows, seed=0, step=3)
    assert out.dtype == torch.float16 and out.shape == (n, dim)
    cost = counter.phases["round"]
    assert cost.launches == 1, cost.launch_names
    # FP32 in, FP16 out, the rows' ids: nothing else crosses memory.
    assert cost.bytes == n * dim * (4 + 2) + n * 8, cost.bytes
    assert cost.largest_temporary == n * dim * 2


def test_the_fused_op_is_the_reference_rule():
    g = torch.Generator().manual_seed(3)
    rows = torch.cat([torch.randint(0, 2**40, (300,), generator=g), torch.arange(20)])
    x = torch.randn(rows.numel(), 24, generator=g) * 10
    for seed, step in ((0, 1), (7, 2**33 + 5)):
        want = stochastic_round_fp16(x, rounding_bits(seed, step, rows, 24))
        assert torch.equal(round_rows(x, torch.float16, rows, seed, step), want)


def test_the_triton_kernel_gives_the_reference_bits():
    script = textwrap.dedent("""
        import torch
        from torchrec_proactive.store.stochastic_rounding import reference_round_fp16, rounding_key, triton_round_fp16
        g = torch.Generator().manual_seed(0)
        rows = torch.cat([torch.randint(0, 2**40, (60,), generator=g), torch.arange(10),
                          torch.tensor([2**32 - 1, 2**32, 2**63 - 1])])
        n = rows.numel()
        for dim in (1, 7, 64, 130):
            x = torch.randn(n, dim, generator=g) * torch.logspace(-9, 5, n).unsqueeze(1)
            x[0] = 65519.0; x[1] = -70000.0; x[2] = 0.0; x[3] = -0.0; x[4] = 1e-8  # (edges: fp16 max, overflow, zeros, subnormal)
            x[5] = float("inf")
            for key in (0, rounding_key(5, 9), rounding_key(2**31 + 3, 2**33 + 1)):
                want = reference_round_fp16(x, rows, key)
                got = triton_round_fp16(x, rows, key)
                assert got.dtype == torch.float16 and torch.equal(want.view(torch.int16), got.view(torch.int16)), (dim, key)
        print("equal")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("equal"), out.stderr[-3000:]
