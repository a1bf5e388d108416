"""Live views of a table ON DISK: what TorchRec hands out (state-dict shards, parameters,
optimizer state) for a table whose rows live in a file, with no host tensor holding them.

For a table in DRAM the kernel hands out :class:`~.host_views.HostTierView`: real tensors over
the host tier whose hook writes the cache back before a value is touched. A table on disk
(``TieredTable.on_disk``) may be larger than host memory, so there is nothing to view. Here a
:class:`DiskRowsView` *stands for* rows ``[start, start + n)`` of one component of the table
(its weight ``[n, dim]``, or one optimizer state: ``[n, dim]``, or ``[n]`` when row-wise) and
holds no storage of its own (a ``_make_wrapper_subclass`` tensor with ``__torch_dispatch__``):

* **Metadata** (shape, dtype, ``device`` cpu, ``stride``, ``is_contiguous``, ``requires_grad``,
  ``is_pinned``) costs nothing.
* **Views** (``narrow``, slicing, ``select``, ``view``/``reshape`` where a view is possible,
  ``detach``, ``t``, ``split``, ``unbind`` ..., as DCP and ``ShardedTensor`` use to cut a
  local shard) stay lazy: a new ``DiskRowsView`` of the sub-range, nothing read. Views are
  computed on a ``meta`` tensor shaped as the whole component, so any strided view works
  (columns too); a view that changes the dtype is refused.
* **Reads** (any op that needs values: ``clone``, arithmetic, ``torch.equal``, ``item``,
  ``.numpy()``, ``tolist()``, ``torch.save``, ``deepcopy``, pickling) first call
  ``owner.before_host_access()`` (the kernel writes its device cache back), then read ONLY
  the rows the view covers, through ``store.read_host_rows`` in chunks of ``chunk_rows``
  rows; the result is a plain tensor. Copies (pickle, ``deepcopy``, ``torch.save``) are
  plain tensors, so checkpoints stay readable by stock TorchRec.
* **In-place writes** (``copy_``, ``fill_``, ``zero_``, ``uniform_``/``normal_`` and the
  other ``torch.nn.init`` fillers, ``mul_``, ``add_``, ``t[i] = x``, ``out=``...) call
  ``before_host_access()``, read the covered rows only when the op needs the old values
  (not for ``copy_``, ``fill_``, ``zero_``, the random fillers or ``out=``), compute on a
  plain tensor and write the rows back through ``store.write_host_rows`` in chunks (a view
  of whole rows writes those rows; a view of some columns reads and rewrites its rows),
  then call ``owner.after_host_write()``. ``write_host_rows`` updates cached copies of the
  rows written and needs a clean cache and no batch in flight: the owner's
  ``before_host_access`` must flush, and a write with batches in flight is refused by
  the store (``StoreStateError``), not silently lost.
* ``repr()`` shows the table, component and row range, not values (a debugger or a log line
  reads nothing from disk).

The owner is held weakly (the kernel keeps its views; the table's file goes with the
kernel): a value access through a view that outlived it raises, naming the table.

Costs to know: an op reads every row its view arguments cover, so indexing with a tensor
(``v[ids]``, ``index_select``) of a view reads the whole view first; take a narrower view.

Not supported: in-place ops that change a view's metadata (``resize_``, ``set_``,
``squeeze_``, ``transpose_`` ...), writes through a view with repeated elements
(``expand``), ``data_ptr``/``untyped_storage`` bytes (there are none), autograd through
the values (the views are detached), and async DCP staging (it copies whole tensors).

Checkpoints (issue 42 item 5): ``torch.distributed.checkpoint`` asks a state-dict VALUE how
to chunk it (the ``__create_write_items__`` / ``__create_chunk_list__`` /
``__get_tensor_shard__`` protocol DTensor answers). A view that is itself a value answers it
in row chunks, so the stock planner streams it. But TorchRec's state dict holds
``ShardedTensor`` values (``get_state_dict``), whose local shards DCP's default planner
writes as ONE item each: the writer resolves the whole local shard and ``torch.save``s it,
so a whole shard would be read into DRAM at once. DCP never asks a shard's tensor how to
chunk it, so the view alone cannot fix that; :class:`StreamingSavePlanner` (a
``DefaultSavePlanner`` subclass, ``dcp.save(sd, planner=StreamingSavePlanner())``) splits
every write item whose data is a disk view into row chunks and reads one chunk when the
writer asks for it. Loading needs no planner: DCP reads each saved chunk (``torch.load``
of that chunk), narrows the destination (lazy here) and ``copy_``s into it, which writes
those rows only. A checkpoint saved in chunks thus loads chunk by chunk, into any sharding
(resharding) and any cache sizes. A checkpoint saved in one piece per shard (stock planner,
or a table in DRAM) still loads into disk views, written in chunks, but DCP's reader holds
each saved piece in DRAM while it copies it; save with ``StreamingSavePlanner`` to avoid that.
(TorchRec's opt-in DTensor state dict wraps local shards in ``LocalShardsWrapper``, which
also answers one item per shard; the planner does not split those: untested, not used here.)

``disk_view_io(store)`` counts every read and write the views of a store make (calls, rows,
the most rows in one call, the most rows assembled in DRAM at once): deterministic figures
that show a save or load moved rows in bounded chunks.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.utils._pytree import tree_map

__all__ = ["DEFAULT_CHUNK_BYTES", "DiskRowsView", "DiskViewIO", "DiskViewOwner", "StreamingSavePlanner",
           "disk_view", "disk_view_io"]

#: Bytes of whole records (a row's weight and its optimizer state) one read or write of the
#: store moves at most, when ``disk_view`` is given no ``chunk_rows``.
DEFAULT_CHUNK_BYTES = 4 << 20


class DiskViewOwner(Protocol):
    """What a disk view needs of the kernel that serves the table (the same two calls as
    ``host_views.HostTierOwner``: ``ProactiveEmbeddingBag`` is one)."""

    def before_host_access(self) -> None:
        """Makes the host tier current: writes every dirty cached row back (a flush)."""

    def after_host_write(self) -> None:
        """Rows of the host tier were written through a view (the store's cached copies of
        them already took the new values)."""


@dataclass
class DiskViewIO:
    """What the views of one store read and wrote (``disk_view_io``). Rows count rows of the
    store; a read or write moves whole records of every component for those rows."""

    read_calls: int = 0  # calls of store.read_host_rows
    rows_read: int = 0
    max_rows_per_read: int = 0
    write_calls: int = 0  # calls of store.write_host_rows
    rows_written: int = 0
    max_rows_per_write: int = 0
    materializations: int = 0  # row blocks assembled in DRAM (a value read, a partial write)
    max_rows_materialized: int = 0  # the most rows of one component held at once

    @property
    def max_rows_per_call(self) -> int:
        return max(self.max_rows_per_read, self.max_rows_per_write)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


_IO: "weakref.WeakKeyDictionary[Any, DiskViewIO]" = weakref.WeakKeyDictionary()
_STATE = threading.local()
# One value access (the owner's flush, then the store's reads and writes) at a time: DCP's
# writer may resolve items from several threads (FileSystemWriter(thread_count=N)), and
# neither the kernel's flush nor the store's host tier takes concurrent callers.
_LOCK = threading.RLock()


def disk_view_io(store: Any) -> DiskViewIO:
    """The running I/O counts of every disk view over ``store`` (created on first use)."""
    io = _IO.get(store)
    if io is None:
        io = _IO[store] = DiskViewIO()
    return io


class _Source:
    """What every view of one component of one store shares: the owner, the store, which
    component, its per-row shape and dtype, and the chunk size."""

    def __init__(self, owner: Optional[DiskViewOwner], store: Any, component: int, chunk_rows: Optional[int]) -> None:
        hosts = [store.host_weight, *store.host_state.values()]
        names = ["weight", *store.host_state]
        if not 0 <= component < len(hosts):
            raise ValueError(f"table '{store.name}': component {component} is not one of its {len(hosts)} "
                             f"(0: weight, then the optimizer state {list(store.host_state)})")
        # The owner is held weakly, as host_views.py holds it: the kernel keeps its views
        # (``split_embedding_weights``), so a strong reference would be a cycle delaying its
        # finalizer (which removes the table's file) to the next garbage collection.
        self._owner: Optional[Any] = None
        if owner is not None:
            try:
                self._owner = weakref.ref(owner)
            except TypeError:  # (an owner without weak references: held strongly)
                self._owner = lambda: owner
        self.store = store
        self.component = component
        self.num_components = len(hosts)
        self.name = names[component]
        self.dtype = hosts[component].dtype
        self.row_shape = tuple(int(s) for s in hosts[component].shape[1:])
        self.width = 1
        for s in self.row_shape:
            self.width *= s
        record = max(1, int(getattr(store, "row_bytes", 0)) or self.width * hosts[component].element_size())
        self.chunk_rows = max(1, int(chunk_rows) if chunk_rows else DEFAULT_CHUNK_BYTES // record)
        self.io = disk_view_io(store)

    @property
    def owner(self) -> Optional[DiskViewOwner]:
        """The owner, or None when the view was made without one. Raises once the owner
        is gone: its device cache (and the table's file) went with it."""
        if self._owner is None:
            return None
        owner = self._owner()
        if owner is None:
            raise RuntimeError(f"{self.describe()}: the module serving this table is gone (a view outlived it); "
                               f"take the tensor again from a live module's state_dict()")
        return owner

    # ------------------------------------------------------------------ row I/O
    def read_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of the component, flat (``(r1 - r0) * width`` elements), read
        in chunks."""
        out = torch.empty((r1 - r0) * self.width, dtype=self.dtype)
        self._assembled(r1 - r0)
        for a in range(r0, r1, self.chunk_rows):
            k = min(self.chunk_rows, r1 - a)
            part = self.store.read_host_rows(a, k)[self.component]
            self.io.read_calls += 1
            self.io.rows_read += k
            self.io.max_rows_per_read = max(self.io.max_rows_per_read, k)
            out[(a - r0) * self.width:(a - r0 + k) * self.width] = part.reshape(-1)
        return out

    def write_rows(self, r0: int, flat: torch.Tensor) -> None:
        """Writes whole rows from ``r0`` (``flat``: rows times width elements), in chunks."""
        n = flat.numel() // self.width
        rows = flat.reshape(n, *self.row_shape)
        for a in range(0, n, self.chunk_rows):
            k = min(self.chunk_rows, n - a)
            parts: List[Optional[torch.Tensor]] = [None] * self.num_components
            parts[self.component] = rows[a:a + k]
            self.store.write_host_rows(r0 + a, parts)
            self.io.write_calls += 1
            self.io.rows_written += k
            self.io.max_rows_per_write = max(self.io.max_rows_per_write, k)

    def _assembled(self, rows: int) -> None:
        self.io.materializations += 1
        self.io.max_rows_materialized = max(self.io.max_rows_materialized, rows)

    def describe(self) -> str:
        return f"table '{self.store.name}' {self.name}"


def _span(meta: torch.Tensor, width: int) -> Tuple[int, int]:
    """The store rows ``[r0, r1)`` a (non-empty) view's elements lie in."""
    first = meta.storage_offset()
    last = first + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride()))
    return first // width, last // width + 1


def _whole_rows(meta: torch.Tensor, width: int) -> bool:
    """Whether the view is whole rows, in order (written without reading)."""
    return meta.is_contiguous() and meta.storage_offset() % width == 0 and meta.numel() % width == 0


class DiskRowsView(torch.Tensor):
    """Rows of one component of a table on disk, as a CPU tensor with no storage (see the
    module docstring). Build with :func:`disk_view`."""

    _source: _Source
    _meta: torch.Tensor

    __torch_function__ = torch._C._disabled_torch_function_impl  # results stay plain tensors

    @staticmethod
    def __new__(cls, source: _Source, meta: torch.Tensor) -> "DiskRowsView":
        r = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(), dtype=meta.dtype,
                                                device="cpu", requires_grad=False)
        r._source = source
        r._meta = meta
        return r

    # ------------------------------------------------------------------ what it covers
    @property
    def store_rows(self) -> Tuple[int, int]:
        """The store rows ``[r0, r1)`` this view covers (``(0, 0)`` when empty)."""
        if self._meta.numel() == 0:
            return 0, 0
        return _span(self._meta, self._source.width)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        r0, r1 = self.store_rows
        return (f"DiskRowsView({self._source.describe()}, rows [{r0}, {r1}), shape={tuple(self.shape)}, "
                f"dtype={self.dtype})")

    # ------------------------------------------------------------------ values out of torch
    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        return _values(self).numpy()

    def tolist(self) -> Any:  # type: ignore[override]
        return _values(self).tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:  # type: ignore[override]
        arr = _values(self).numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __reduce_ex__(self, protocol: int) -> Any:
        return _values(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        out = _values(self)
        memo[id(self)] = out
        return out

    # ------------------------------------------------------------------ DCP's chunking protocol
    # (asked only of state-dict values: see the module docstring; a view inside a
    # ShardedTensor is streamed by StreamingSavePlanner instead.)
    def _chunk_bounds(self) -> List[Tuple[int, int]]:
        if self.dim() == 0:
            return [(0, 0)]
        n, k = int(self.shape[0]), self._source.chunk_rows
        return [(a, min(k, n - a)) for a in range(0, n, k)] or [(0, 0)]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        rest = [0] * (self.dim() - 1)
        if self.dim() == 0:
            return [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
        return [ChunkStorageMetadata(offsets=torch.Size([a, *rest]), sizes=torch.Size([k, *self.shape[1:]]))
                for a, k in self._chunk_bounds()]

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        props = TensorProperties(dtype=self.dtype, requires_grad=self.requires_grad)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.size()))
                for chunk in self.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if self.dim() == 0:
            return self
        start = int(index.offset[0]) if index.offset is not None else 0
        for a, k in self._chunk_bounds():
            if a == start:
                return self.narrow(0, a, k)
        raise ValueError(f"{self._source.describe()}: no chunk of this view starts at row {start} "
                         f"(chunks of {self._source.chunk_rows} rows)")

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "is_pinned":
            return False
        if name == "is_same_size":
            return args[0].shape == args[1].shape
        if name in _NO_VALUES:
            return func(*tree_map(_blank, args), **tree_map(_blank, kwargs))
        if func.is_view:
            return _view(func, args, kwargs)
        written = _written_args(func, args, kwargs)
        if not written:
            return _compute(func, args, kwargs)
        if name in _META_MUTATIONS:
            if name == "detach_":
                return args[0]
            raise NotImplementedError(f"{_describe(args)}: {name} changes a view's shape in place; "
                                      f"not supported on a table on disk (use the out-of-place op)")
        return _mutate(func, name, args, kwargs, written)


# Ops that read only their inputs' metadata: no read, no hook.
_NO_VALUES = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                        "randint_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"})
# In-place ops that overwrite every element of what they write: the old values are not read.
_OVERWRITES = frozenset({"copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "exponential_",
                         "geometric_", "log_normal_", "cauchy_", "bernoulli_"})
# In-place ops that change the written tensor's metadata, not (only) its values.
_META_MUTATIONS = frozenset({"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_",
                             "transpose_", "swapdims_", "swapaxes_", "detach_", "_resize_output_"})


def _describe(args: Any) -> str:
    for a in _flat(args):
        if isinstance(a, DiskRowsView):
            return a._source.describe()
    return "a disk view"


def _flat(tree: Any) -> List[Any]:
    out: List[Any] = []
    tree_map(out.append, tree)
    return out


def _blank(a: Any) -> Any:
    return torch.empty(a.shape, dtype=a.dtype) if isinstance(a, DiskRowsView) else a


def _view(func: Any, args: Any, kwargs: Dict[str, Any]) -> Any:
    source = next(a._source for a in _flat((args, kwargs)) if isinstance(a, DiskRowsView))
    meta = func(*tree_map(_meta_of, args), **tree_map(_meta_of, kwargs))

    def wrap(m: Any) -> Any:
        if not isinstance(m, torch.Tensor):
            return m
        if m.dtype != source.dtype:
            raise NotImplementedError(f"{source.describe()}: a view as {m.dtype} of a {source.dtype} disk view is not "
                                      f"supported; clone() it first")
        return DiskRowsView(source, m)

    return tree_map(wrap, meta)


def _meta_of(a: Any) -> Any:
    return a._meta if isinstance(a, DiskRowsView) else a


class _Hooks:
    """Calls each owner's ``before_host_access`` once on entry (not when nested: the owner's
    own flush may touch tensors) and, for the written ones, ``after_host_write`` on exit."""

    def __init__(self, views: Sequence["DiskRowsView"]) -> None:
        self.owners: Dict[int, Any] = {}
        for v in views:
            owner = v._source.owner
            if owner is not None:
                self.owners.setdefault(id(owner), owner)

    def before(self) -> None:
        if getattr(_STATE, "busy", False):
            return
        _STATE.busy = True
        try:
            for owner in self.owners.values():
                owner.before_host_access()
        finally:
            _STATE.busy = False

    @staticmethod
    def after_write(views: Sequence["DiskRowsView"]) -> None:
        seen: Dict[int, Any] = {}
        for v in views:
            owner = v._source.owner
            if owner is not None:
                seen.setdefault(id(owner), owner)
        for owner in seen.values():
            owner.after_host_write()


def _materialize(view: "DiskRowsView") -> torch.Tensor:
    """The view's values as a plain contiguous tensor (no hook: the caller's job)."""
    m, src = view._meta, view._source
    if m.numel() == 0:
        return torch.empty(m.shape, dtype=m.dtype)
    r0, r1 = _span(m, src.width)
    block = src.read_rows(r0, r1)
    out = block.as_strided(m.shape, m.stride(), m.storage_offset() - r0 * src.width)
    return out if _whole_rows(m, src.width) else out.contiguous()


def _values(view: "DiskRowsView") -> torch.Tensor:
    """The view's values as a plain tensor, after its owner made the host tier current."""
    with _LOCK:
        _Hooks([view]).before()
        return _materialize(view)


def _write(view: "DiskRowsView", values: torch.Tensor) -> None:
    """Writes ``values`` (the view's shape) into the rows the view covers (no hook)."""
    m, src = view._meta, view._source
    if m.numel() == 0:
        return
    if any(s > 1 and st == 0 for s, st in zip(m.shape, m.stride())):
        raise NotImplementedError(f"{src.describe()}: a write through a view whose elements repeat (expand) is not "
                                  f"supported")
    values = values.to(m.dtype).expand(m.shape)
    if _whole_rows(m, src.width):
        src.write_rows(m.storage_offset() // src.width, values.contiguous().reshape(-1))
        return
    r0, r1 = _span(m, src.width)
    block = src.read_rows(r0, r1)
    block.as_strided(m.shape, m.stride(), m.storage_offset() - r0 * src.width).copy_(values)
    src.write_rows(r0, block)


def _written_args(func: Any, args: Any, kwargs: Dict[str, Any]) -> List[Tuple[str, Any, bool]]:
    """The op's arguments it writes that are disk views: ``(where, key, is_out)``, where is
    ``"pos"`` (``key`` an index into ``args``) or ``"kw"``."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if not a.kwarg_only and i < len(args):
            where, key, value = "pos", i, args[i]
        elif a.name in kwargs:
            where, key, value = "kw", a.name, kwargs[a.name]
        else:
            continue
        if any(isinstance(v, DiskRowsView) for v in _flat(value)):
            out.append((where, key, bool(getattr(a, "is_out", False))))
    return out


def _compute(func: Any, args: Any, kwargs: Dict[str, Any]) -> Any:
    with _LOCK:
        return _compute_locked(func, args, kwargs)


def _compute_locked(func: Any, args: Any, kwargs: Dict[str, Any]) -> Any:
    views = [a for a in _flat((args, kwargs)) if isinstance(a, DiskRowsView)]
    _Hooks(views).before()
    cache: Dict[int, torch.Tensor] = {}

    def plain(a: Any) -> Any:
        if not isinstance(a, DiskRowsView):
            return a
        if id(a) not in cache:
            cache[id(a)] = _materialize(a)
        return cache[id(a)]

    return func(*tree_map(plain, args), **tree_map(plain, kwargs))


def _mutate(func: Any, name: str, args: Any, kwargs: Dict[str, Any], written: List[Tuple[str, Any, bool]]) -> Any:
    with _LOCK:
        return _mutate_locked(func, name, args, kwargs, written)


def _mutate_locked(func: Any, name: str, args: Any, kwargs: Dict[str, Any],
                   written: List[Tuple[str, Any, bool]]) -> Any:
    views = [a for a in _flat((args, kwargs)) if isinstance(a, DiskRowsView)]
    hooks = _Hooks(views)
    hooks.before()
    args, kwargs = list(args), dict(kwargs)
    stand_ins: Dict[int, Tuple["DiskRowsView", torch.Tensor]] = {}  # id(stand-in) -> (view, stand-in)
    targets = []

    def stand_in(v: Any, read: bool) -> Any:
        if not isinstance(v, DiskRowsView):
            return v
        t = _materialize(v) if read else torch.empty(v.shape, dtype=v.dtype)
        stand_ins[id(t)] = (v, t)
        targets.append((v, t))
        return t

    # What is only read is read before anything is written (copy_ between overlapping views).
    cache: Dict[int, torch.Tensor] = {}
    written_keys = {(w, k) for w, k, _ in written}

    def plain(a: Any) -> Any:
        if not isinstance(a, DiskRowsView):
            return a
        if id(a) not in cache:
            cache[id(a)] = _materialize(a)
        return cache[id(a)]

    for i in range(len(args)):
        if ("pos", i) not in written_keys:
            args[i] = tree_map(plain, args[i])
    for k in list(kwargs):
        if ("kw", k) not in written_keys:
            kwargs[k] = tree_map(plain, kwargs[k])
    for where, key, is_out in written:
        read = not (is_out or name in _OVERWRITES)
        if where == "pos":
            args[key] = tree_map(lambda v: stand_in(v, read), args[key])
        else:
            kwargs[key] = tree_map(lambda v: stand_in(v, read), kwargs[key])
    ret = func(*args, **kwargs)
    for view, values in targets:
        _write(view, values)
    _Hooks.after_write([v for v, _ in targets])
    return tree_map(lambda r: stand_ins[id(r)][0] if isinstance(r, torch.Tensor) and id(r) in stand_ins else r, ret)


def disk_view(owner: Optional[DiskViewOwner], store: Any, component: int, start: int, num_rows: int, *,
              chunk_rows: Optional[int] = None) -> torch.Tensor:
    """Rows ``[start, start + num_rows)`` of one component of ``store`` as a live tensor
    that holds none of them (a :class:`DiskRowsView`; see the module docstring).

    Args:
        owner: the kernel serving ``store`` (``before_host_access`` flushes its device
            cache; ``after_host_write`` is told of writes), held weakly: a value access
            after it is gone raises. None only for a store no batch is using (its host
            tier is then read as it is).
        store: a ``TieredTable`` (on disk, or in DRAM: the same ``read_host_rows`` /
            ``write_host_rows``).
        component: 0 for the weight ``[num_rows, dim]``; ``k >= 1`` for the k-th optimizer
            state in ``store.host_state`` order (``[num_rows]`` when row-wise, else
            ``[num_rows, dim]``).
        start, num_rows: the rows of the store's row space (a table of a group starts at its
            ``Segment.start``).
        chunk_rows: rows one read or write of the store moves at most (default: whole
            records of ``DEFAULT_CHUNK_BYTES``); also the rows per item
            ``StreamingSavePlanner`` writes.
    """
    source = _Source(owner, store, int(component), chunk_rows)
    if start < 0 or num_rows < 0 or start + num_rows > store.num_rows:
        raise ValueError(f"table '{store.name}': rows [{start}, {start + num_rows}) are not in its rows "
                         f"[0, {store.num_rows})")
    base = torch.empty((store.num_rows, *source.row_shape), dtype=source.dtype, device="meta")
    return DiskRowsView(source, base.narrow(0, int(start), int(num_rows)))


# ---------------------------------------------------------------------- DCP
class StreamingSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes every disk view (a ``ShardedTensor``'s local shard,
    or a state-dict value) as items of at most ``chunk_rows`` rows (default: the view's own
    ``chunk_rows``), each read from the store only when the writer asks for it. Everything
    else is saved as the default planner saves it. The checkpoint is an ordinary DCP
    checkpoint (a tensor saved in several chunks), loadable by the default load planner,
    into any sharding."""

    def __init__(self, *args: Any, chunk_rows: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunk_rows = chunk_rows

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not plan.usable:
            return plan
        items: List[WriteItem] = []
        for item in plan.items:
            items.extend(self._split(item))
        self.plan = dataclasses.replace(plan, items=items)
        if hasattr(self, "_pending_local_plan"):
            self._pending_local_plan = self.plan
        return self.plan

    def _split(self, item: WriteItem) -> List[WriteItem]:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            return [item]
        view = self._disk_view_of(item)
        chunk = item.tensor_data.chunk
        if view is None or len(chunk.sizes) == 0:
            return [item]
        rows = max(1, int(self.chunk_rows or view._source.chunk_rows))
        total = int(chunk.sizes[0])
        if total <= rows:
            return [item]
        out = []
        for a in range(0, total, rows):
            offsets = torch.Size([int(chunk.offsets[0]) + a, *chunk.offsets[1:]])
            sizes = torch.Size([min(rows, total - a), *chunk.sizes[1:]])
            out.append(dataclasses.replace(
                item, index=MetadataIndex(item.index.fqn, offsets),
                tensor_data=dataclasses.replace(item.tensor_data, chunk=ChunkStorageMetadata(offsets, sizes))))
        return out

    def _disk_view_of(self, item: WriteItem) -> Optional[DiskRowsView]:
        """The (lazy) disk view holding the item's chunk, or None when it is not one."""
        value = self.state_dict.get(item.index.fqn)
        chunk = item.tensor_data.chunk  # type: ignore[union-attr]
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                md = shard.metadata
                inside = all(o <= c and c + s <= o + n for o, n, c, s in
                             zip(md.shard_offsets, md.shard_sizes, chunk.offsets, chunk.sizes))
                if inside and isinstance(shard.tensor, DiskRowsView):
                    rel = [c - o for c, o in zip(chunk.offsets, md.shard_offsets)]
                    return narrow_tensor_by_index(shard.tensor, rel, chunk.sizes)  # type: ignore[return-value]
            return None
        if isinstance(value, DiskRowsView):
            return narrow_tensor_by_index(value, chunk.offsets, chunk.sizes)  # type: ignore[return-value]
        return None

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type != WriteItemType.BYTE_IO and write_item.tensor_data is not None:
            view = self._disk_view_of(write_item)
            if view is not None:
                return _values(view)
        return super().resolve_data(write_item)
