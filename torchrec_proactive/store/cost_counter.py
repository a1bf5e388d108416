"""Counting, on a CPU-only machine, what device code would cost a GPU: ATen ops, kernel
launches and the bytes they touch.

A plan on the GPU costs its launches (a few microseconds of host time each) and the bytes
it moves; neither may grow with the cache, only with the batch's ids (FBGEMM's UVM cache
plans in ~10 launches whatever its size). :class:`CostCounter` is a ``TorchDispatchMode``
that sees every ATen op the code issues - on fake CUDA tensors under ``sync_detector.
fake_cuda``, where nothing runs - and adds it to the current *phase* (planning, lookup,
update), so tests can assert counts that a wall clock could not give on this machine.

What counts:

* an *op*: any ATen call that reads or writes a device tensor;
* a *launch*: an op that would start a GPU kernel or copy - not a view, an alias or an
  uninitialised allocation (``empty``), which only change metadata;
* *bytes touched*: the bytes an op reads and writes. A gather or scatter (``index_select``,
  ``index_copy_``, ``index_add_``, ``index_fill_``, ``embedding_bag``) touches only the rows
  it indexes, not its whole operand, and a row move (``row_moves.move_rows_``, which
  returns nothing and writes ``dst``) at most one row of each side per entry; any other op
  touches all of its inputs and outputs;
* the *largest temporary*: the biggest tensor an op allocates (in-place and view results
  are not allocations).

Kernels inside a plan that runs as a CUDA graph (``plan_graphs``) are counted in
``graph_kernels``; the graph itself is one launch (``graph_replay``). Their ops and bytes
count as any other's: a graph saves launches, not work.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .plan_graphs import graph_region
from .row_moves import move_rows_

_aten = torch.ops.aten

# Ops that allocate without writing, or only change metadata: no kernel starts.
_NO_LAUNCH = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.detach.default,
    _aten.alias.default, _aten.lift_fresh.default, _aten._local_scalar_dense.default,
}

_ROW_MOVE = move_rows_._opoverload
# Gathers and scatters: (index of the indexed operand, index of the index tensor, dim or None = 0).
_INDEXED = {
    _aten.index_select.default: (0, 2),
    _aten.index_copy_.default: (0, 2),
    _aten.index_copy.default: (0, 2),
    _aten.index_add_.default: (0, 2),
    _aten.index_fill_.int_Scalar: (0, 2),
    _aten.index_fill_.int_Tensor: (0, 2),
    _aten._embedding_bag.default: (0, 1),
    _aten._embedding_bag_forward_only.default: (0, 1),
    _aten.embedding.default: (0, 1),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class PhaseCost:
    """What one phase issued."""

    ops: int = 0
    launches: int = 0
    bytes: int = 0
    largest_temporary: int = 0
    names: List[str] = field(default_factory=list)
    launch_names: List[str] = field(default_factory=list)
    op_bytes: List[int] = field(default_factory=list)  # per launch
    graph_kernels: int = 0  # kernels launched by graph replays (not in ``launches``)

    def key(self) -> tuple:
        """Everything that must not depend on the cache size, in one comparable value."""
        return (self.ops, self.launches, self.bytes, self.largest_temporary, tuple(self.names))


class CostCounter(TorchDispatchMode):
    """Adds every device op to the current phase (``with counter.phase("plan"): ...``).
    Enter it inside ``fake_cuda()`` so that it sees the ops before they are faked."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: Dict[str, PhaseCost] = {}
        self._phase: Optional[str] = None
        self._region: Optional[int] = None  # the last graph region seen

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhaseCost]:
        previous, self._phase = self._phase, name
        cost = self.phases.setdefault(name, PhaseCost())
        try:
            yield cost
        finally:
            self._phase = previous

    def reset(self) -> None:
        self.phases.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._phase is None:
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not any(t.device.type != "cpu" for t in inputs + outputs):
            return out  # host bookkeeping: no launch
        cost = self.phases[self._phase]
        cost.ops += 1
        cost.names.append(str(func.__name__ if hasattr(func, "__name__") else func))
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        if func in _NO_LAUNCH or getattr(func, "is_view", False) or not (outputs or writes):
            return out
        region = graph_region()
        if region is None:
            cost.launches += 1
            cost.launch_names.append(cost.names[-1])
        else:
            cost.graph_kernels += 1
            if region != self._region:  # a new replay: one launch for the whole graph
                self._region = region
                cost.launches += 1
                cost.launch_names.append("graph_replay")
        touched = 0
        indexed = _INDEXED.get(func)
        skip = set()
        if func is _ROW_MOVE:
            dst, src, guard = args[0], args[2], args[4]
            touched += guard.numel() * (_nbytes(dst) // max(int(dst.shape[0]), 1)
                                        + _nbytes(src) // max(int(src.shape[0]), 1))
            skip.update((id(dst), id(src)))
        elif indexed is not None:
            operand, index = args[indexed[0]], args[indexed[1]]
            rows = max(int(operand.shape[0]), 1) if operand.dim() else 1
            touched += index.numel() * (_nbytes(operand) // rows)
            skip.add(id(operand))
        for t in inputs:
            if id(t) not in skip:
                touched += _nbytes(t)
        mutable = any(r.alias_info is not None for r in func._schema.returns)
        if not mutable:
            for t in outputs:
                touched += _nbytes(t)
                cost.largest_temporary = max(cost.largest_temporary, _nbytes(t))
        cost.bytes += touched
        cost.op_bytes.append(touched)
        return out
