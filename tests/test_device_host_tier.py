"""The TorchRec path holds a group's host tier once (issue 44, item 1): FBGEMM's host-mapped
rows are used in place (FBGEMM's ``uvm_to_cpu`` refuses them, so the kernel used to copy
them into pinned memory, rounded up to a power of two), and the optimizer state is one
host-mapped allocation at its exact size. Counted on fake CUDA tensors through the real
``from_stock`` (``integration/host_tier_probe.py``)."""

from __future__ import annotations

import pytest
import torch

from torchrec_proactive.integration.host_tier_probe import from_stock_host_bytes
from torchrec_proactive.store.host_memory import HostBytes, cpu_alias, fake_host_mapped


@pytest.mark.parametrize("optimizer", ["adam", "exact_row_wise_adagrad"])
def test_from_stock_holds_the_rows_and_the_state_once_at_their_exact_size(optimizer):
    r = from_stock_host_bytes(optimizer)
    # (main before this: 1.97 with Adam, 2.62 with row-wise Adagrad - a pinned copy of the
    # rows and pinned state, each rounded up to a power of two)
    assert r["host_tier_bytes_ratio"] <= 1.05, r
    assert r["allocated_pinned"] == 0, r
    assert r["allocated_host_mapped"] == r["state_bytes"], r  # one allocation per state, exact size
    assert r["host_on_device"], r  # the moves address the tier in place, no staging


def test_a_cpu_alias_of_host_mapped_memory_is_its_bytes_and_keeps_them_alive():
    """The alias is a view of the allocation (a write through it is a write of the
    allocation), with the UVM tensor's strides and offset, and it holds the allocation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import gc
    import weakref

    with FakeTensorMode(allow_non_fake_inputs=True), fake_host_mapped() as model:
        uvm = torch.ops.fbgemm.new_host_mapped_tensor(torch.empty(0, device="cuda"), [6, 4])
        with pytest.raises(RuntimeError):
            torch.ops.fbgemm.uvm_to_cpu(uvm)  # (FBGEMM's check, as on a GPU)
        backing = model._base_of(uvm)[1]
        alias = cpu_alias(uvm)
    assert alias is not None and alias.device.type == "cpu" and tuple(alias.shape) == (6, 4)
    # The alias (a real CPU tensor before FakeTensorMode's views) reads and writes the bytes.
    from torchrec_proactive.store import host_memory

    raw = host_memory._cpu_bytes_at(backing.data_ptr(), backing.numel(), uvm)
    raw.view(torch.float32).copy_(torch.arange(24, dtype=torch.float32))
    assert torch.equal(backing.view(torch.float32), torch.arange(24, dtype=torch.float32))
    owner = weakref.ref(uvm)
    del uvm, model
    gc.collect()
    assert owner() is not None  # held by the alias's buffer
    del raw, alias
    gc.collect()
    assert owner() is None


def test_host_bytes_counts_pinned_blocks_at_the_caching_allocators_size():
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = HostBytes()
    with FakeTensorMode(), counter:
        torch.empty(3 * 2**20, dtype=torch.uint8, pin_memory=True)
        torch.zeros(1000, dtype=torch.float32)
        torch.zeros(10).view(2, 5)
    assert counter.pinned == 4 * 2**20 and counter.cpu == 4000 + 40
