"""A device plan as one CUDA graph launch: how planning gets to FBGEMM's launch count.

Why graphs. The device planner (``device_planner.py``) is about a hundred small fixed-shape
ATen ops per group per step; on a GPU each is a kernel launch of a few microseconds of
host time, so at 25k-250k ids a plan costs its launches, not its work (issue 30, item 3).
FBGEMM's UVM cache does the same job in about ten kernels written for it. The ways to get
there were: hand-written kernels (Triton or CUDA: a second implementation of every rule,
which no CPU test here could run), ``torch.compile`` (which cannot trace through the
store's Python bookkeeping and recompiles on every new batch size), FBGEMM's ``lru_cache_*``
ops (a set-associative layout whose full sets force overflow, see ``device_planner.py``), or
*capture*: the planner's ops already have shapes that depend only on the number of ids and
read nothing on the host (``fixed_shape.py``, proven by ``sync_detector``), which is
exactly what a CUDA graph needs. A graph is captured once per shape and replayed as one
launch; the ATen ops stay the single implementation, bit-identical to eager on the same
device. So a step costs (``tests/test_device_cost.py`` counts them on fake CUDA):

* 1-2 launches staging the ids (a copy, and a fill of the padding when the batch is not a
  bucket's size) and 1 the KJT's offsets;
* 1 graph launch (the plan, ids to store rows included, ~100 kernels inside);
* 1 copy of its packed outputs out of the graph's memory, which the next replay reuses
  while this batch is still in flight.

That is about 5 launches per group per step against FBGEMM's ~10 (plus the lookup recipe's
few, ``lookup.TableBatch``).

Shapes. Batch sizes vary (multi-hot features), and every distinct shape would be a capture
(a stream sync of its own, and graph memory). Ids are therefore padded up to a *bucket*
(:func:`bucket`: at most 12.5% more, so a few dozen buckets cover 64 to 2**31 ids) with
``PAD_ID``, which the planner treats as "no id": planned as the sentinel row in the trash
slot, never counted, never looked up.

What capture requires, and how it is checked on CPU. A graph replays the *same* kernels
with the *same* arguments on the *same* memory. So a plan of a given shape must issue the
same ops with the same non-tensor arguments every time (a Python counter baked into a
kernel argument, such as an LRU tick, would replay its first value forever), and every
tensor it reads or writes that it did not create must be the same tensor every time (the
store's persistent buffers and the staging buffers). Wherever graphs are not captured
(CPU, and fake CUDA tensors in tests) :class:`PlanGraphs` runs the plan eagerly under
:class:`ReplayCheck`, which records the first plan of each shape and raises
:class:`GraphReplayError` when a later one differs in any of these. Every device-planner
test on CPU therefore proves, step by step, that replaying the captured graph would have
done what the eager plan did.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: The staged value of a padding id: "no id here" (the planner plans it as the sentinel row).
PAD_ID = torch.iinfo(torch.int64).min

_SMALLEST = 64
_region = threading.local()


def bucket(n: int) -> int:
    """The padded length of a batch of ``n`` ids: ``n`` rounded up to a multiple of an
    eighth of its power of two (at most 12.5% padding), at least 64."""
    if n <= _SMALLEST:
        return _SMALLEST
    step = 1 << max(0, (n - 1).bit_length() - 4)
    return -(-n // step) * step


def graph_region() -> Optional[int]:
    """Which region the calling thread is in, if it is inside a plan that runs (or, where
    graphs are not captured, would run) as one graph launch: a number new for every run.
    ``CostCounter`` counts a region's kernels as one launch."""
    return getattr(_region, "serial", 0) if getattr(_region, "depth", 0) > 0 else None


@contextlib.contextmanager
def _graph_region() -> Iterator[None]:
    _region.depth = getattr(_region, "depth", 0) + 1
    _region.serial = getattr(_region, "serial", 0) + 1
    try:
        yield
    finally:
        _region.depth -= 1


class GraphReplayError(RuntimeError):
    """A plan of a captured shape did not repeat itself: its replay would be wrong."""


@dataclass
class _Trace:
    ops: List[Tuple[Any, ...]] = field(default_factory=list)
    external: List[torch.Tensor] = field(default_factory=list)


class ReplayCheck(TorchDispatchMode):
    """Records the ATen ops of one region: op, non-tensor arguments, tensor shapes and
    dtypes, and for each tensor argument either which earlier op of the region made it or,
    for tensors from outside the region, which one (by identity)."""

    def __init__(self) -> None:
        super().__init__()
        self.trace = _Trace()
        self._made: Dict[int, Tuple[int, int]] = {}
        self._alive: List[torch.Tensor] = []  # (ids stay unique while the region runs)

    def _describe(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value if isinstance(value, (int, float, bool, str, type(None), torch.dtype,
                                               torch.device, torch.layout, torch.memory_format)) else repr(value)
        where = self._made.get(id(value))
        if where is None:
            for i, t in enumerate(self.trace.external):
                if t is value:
                    where = ("external", i)
                    break
            else:
                self.trace.external.append(value)
                where = ("external", len(self.trace.external) - 1)
        return (where, tuple(value.shape), value.dtype, value.device.type)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        described = tuple(self._describe(v) for v in leaves)
        out = func(*args, **kwargs)
        index = len(self.trace.ops)
        self.trace.ops.append((str(func), described))
        inputs = {id(v) for v in leaves if isinstance(v, torch.Tensor)}
        outs, _ = tree_flatten(out)
        for j, t in enumerate(outs):
            if isinstance(t, torch.Tensor) and id(t) not in inputs:
                self._made[id(t)] = (index, j)
                self._alive.append(t)
        return out


def _compare(key: Hashable, first: _Trace, now: _Trace) -> None:
    if len(first.ops) != len(now.ops):
        raise GraphReplayError(f"plan of shape {key}: {len(now.ops)} ops where its first plan issued {len(first.ops)}")
    for i, (a, b) in enumerate(zip(first.ops, now.ops)):
        if a != b:
            raise GraphReplayError(
                f"plan of shape {key}: op {i} differs from the first plan's ({a[0]} with {a[1]} vs {b[0]} with "
                f"{b[1]}); a captured graph would replay the first one's arguments")
    for i, (a, b) in enumerate(zip(first.external, now.external)):
        if a is not b:
            raise GraphReplayError(
                f"plan of shape {key}: outside tensor {i} ({tuple(b.shape)}, {b.dtype}) is not the one its first plan "
                f"read; a captured graph would read the first one's memory")


@dataclass
class _Entry:
    inputs: List[torch.Tensor]  # staging buffers, one per input, at the bucket's shape
    sizes: List[int]
    trace: Optional[_Trace] = None
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    packed: Optional[torch.Tensor] = None  # the graph's output (its own memory)
    runs: int = 0
    graph_bytes: int = 0  # device memory the capture took from the pool (measured there)

    def memory_bytes(self) -> int:
        staged = sum(t.numel() * t.element_size() for t in self.inputs)
        packed = 0 if self.packed is None else self.packed.numel() * self.packed.element_size()
        return staged + max(packed, self.graph_bytes)


Body = Callable[..., Sequence[torch.Tensor]]


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)`` through the op itself: the same kernel, but it
    also runs on fake CUDA tensors of a CPU-only build (whose ``Tensor.copy_`` binding
    needs CUDA before dispatch), so the cost tests see the staging copies."""
    torch.ops.aten.copy_.default(dst, src, True)


class PlanGraphs:
    """Runs a planner's fixed-shape body once per batch, as a CUDA graph where one can be
    captured and under :class:`ReplayCheck` elsewhere.

    ``run(key, body, inputs)``: ``key`` names everything the body's shapes and arguments
    depend on besides the inputs' shapes; ``inputs`` are 1-D device tensors, the first of
    them the ids, padded to :func:`bucket` with ``PAD_ID`` (the others are staged as they
    are). ``body`` returns 1-D int64 tensors; ``run`` returns fresh copies of them that
    stay valid while later plans run. Invariant: one entry (staging buffers, trace, graph)
    per key; an entry is freed whole (its graph with the buffers it reads) when it is the
    least recently run of more than ``max_entries``, or when they hold more than
    ``max_bytes`` (a graph at 2M ids holds ~170 MB of device memory: the cache is bounded,
    ``memory_bytes`` says what it holds, ``evictions`` how often it let one go).

    Capture: the first plan of the first key runs eagerly (a warm-up: lazy initialisations
    do not belong in a graph) and its second is captured; once one graph has been
    captured, the first plan of every new key is captured at once (no eager run of ~145
    launches).
    """

    def __init__(self, device: torch.device, capture: Optional[bool] = None, max_entries: int = 16,
                 max_bytes: int = 1 << 30) -> None:
        self.device = torch.device(device)
        real_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.capture = real_cuda if capture is None else capture
        self.max_entries = max(1, int(max_entries))
        self.max_bytes = int(max_bytes)
        self._entries: "OrderedDict[Hashable, _Entry]" = OrderedDict()
        self._pool: Any = None
        self._stream: Any = None
        self.captures = 0  # graphs captured (each cost one stream sync, once)
        self.replays = 0
        self.evictions = 0  # entries freed to keep the cache within max_entries

    def run(self, key: Hashable, body: Body, inputs: Sequence[torch.Tensor], length: int) -> List[torch.Tensor]:
        full_key = (key, length, tuple(t.shape[0] for t in inputs[1:]))
        entry = self._entries.get(full_key)
        if entry is None:
            entry = _Entry([torch.empty(length, dtype=torch.int64, device=self.device)]
                           + [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in inputs[1:]], [])
            self._entries[full_key] = entry
        else:
            self._entries.move_to_end(full_key)
        self._bound()
        self._stage(entry, inputs)
        entry.runs += 1
        # (fake tensors - a counting run on a GPU machine - hold no memory a graph could
        # replay: they run eagerly, under the check, so their kernels are seen and counted)
        warm = entry.runs >= 2 or self.captures > 0
        if self.capture and warm and not _is_fake(inputs[0]):
            if entry.graph is None:
                self._capture(entry, body)
            entry.graph.replay()
            self.replays += 1
            packed = entry.packed
        else:
            check = ReplayCheck()
            with _graph_region(), check:
                outs = body(*entry.inputs)
                packed = self._pack(entry, outs)
            if entry.trace is None:
                entry.trace = check.trace
            else:
                _compare(key, entry.trace, check.trace)
        return list(packed.clone().split(entry.sizes))  # (views of one copy)

    def _bound(self) -> None:
        """Frees the least recently run entries (graph and buffers together) while there are
        more than ``max_entries`` or they hold more than ``max_bytes``; never the one in use."""
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries
                                          or self.memory_bytes() > self.max_bytes):
            self._entries.popitem(last=False)
            self.evictions += 1

    def _stage(self, entry: _Entry, inputs: Sequence[torch.Tensor]) -> None:
        ids, staged = inputs[0], entry.inputs[0]
        n, length = int(ids.shape[0]), int(staged.shape[0])
        _copy(staged.narrow(0, 0, n), ids)
        if n < length:
            staged.narrow(0, n, length - n).fill_(PAD_ID)
        for src, dst in zip(inputs[1:], entry.inputs[1:]):
            _copy(dst, src)

    @staticmethod
    def _pack(entry: _Entry, outs: Sequence[torch.Tensor]) -> torch.Tensor:
        entry.sizes = [int(t.shape[0]) for t in outs]
        return torch.cat([t.reshape(-1) for t in outs])

    def _capture(self, entry: _Entry, body: Body) -> None:
        """Captures the body on a side stream, ordered after the work queued so far; no
        device-wide synchronisation (``torch.cuda.graph`` would add one, and a GC pass)."""
        if self._pool is None:
            # One memory pool for the table's graphs: a replay may overwrite what another
            # graph left in it, which is safe because ``run`` copies a replay's outputs out
            # before anything else is queued on the stream, and replays never overlap.
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        before = torch.cuda.memory_allocated(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                with _graph_region():
                    entry.packed = self._pack(entry, body(*entry.inputs))
            finally:
                graph.capture_end()
        current.wait_stream(self._stream)
        entry.graph = graph
        entry.graph_bytes = max(0, torch.cuda.memory_allocated(self.device) - before)
        self.captures += 1

    def memory_bytes(self) -> int:
        """Device memory the cache of plans holds: staging buffers, and each graph's memory
        (its outputs; on a GPU what its capture took from the pool)."""
        return sum(e.memory_bytes() for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
