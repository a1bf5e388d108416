"""The tensors a proactive kernel hands out are live: whoever reads or writes through them
reads and writes the table as training left it, whenever they were taken.

TorchRec exposes a fused kernel's rows as views of its host storage: ``state_dict()``'s
shards, ``named_parameters()``, the registered ``embedding_bags[t].weight`` and the fused
optimizer's state. Ours are views of the store's host tier, which is behind the device cache
for every row trained since the cache last wrote it back. (On CUDA they are CUDA tensors
over the host tier's host-mapped bytes, as stock FBGEMM's UVM rows are: TorchRec places the
shards on ``cuda:r`` and checks the tensors it is handed are there.) A user (or a library) may keep
such a tensor for the whole run; a read through it would see old values, and a write would
be computed from them.

So each of those tensors is a :class:`HostTierView` (or, for the registered parameter, a
:class:`LiveTableSlice`): a plain-tensor subclass whose ``__torch_function__`` asks the owning
kernel, before any op that reads or writes values, to write the cache back (``flush``: the
host tier is then exactly the table, every cached row clean), and after any op that writes,
to have the cache take the rows written (``adopt_host_writes``: a clean row whose host copy
differs from its cached copy, bit for bit, was written; per row and tensor). Ops that only look at metadata (shape, dtype, ``data_ptr``...) or make views cost
nothing; views of a view stay live. Results that do not alias the host tier (``clone()``,
arithmetic) are plain tensors.

What the hook cannot see: a NumPy array or a ``.data`` tensor kept and written after later
training steps (taking either is seen: the cache is written back first, and the next lookup
takes what was written before it), or raw pointers. Pickling gives plain tensors, so
checkpoints stay readable by stock TorchRec.

The owner is found through the tensor's storage (a registry of weak references), so a deep
copy (new storage) is an ordinary tensor to the hook.
"""

from __future__ import annotations

import threading
import types
import weakref
from typing import Any, Dict, Iterable, Optional, Protocol

import torch
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice

__all__ = ["HostTierOwner", "HostTierView", "LiveTableSlice", "can_be_live", "live_view", "register_host_storage"]


class HostTierOwner(Protocol):
    """What a live view needs of the kernel that owns its storage."""

    def before_host_access(self) -> None:
        """Makes the host tier current (writes the cache back)."""

    def after_host_write(self) -> None:
        """The host tier was written: the cache must take the rows written."""


_OWNERS: Dict[int, "weakref.ReferenceType[Any]"] = {}
_STATE = threading.local()

# Ops that read no value: metadata, autograd flags, the raw address.
_META = frozenset({
    "shape", "dtype", "device", "layout", "ndim", "names", "is_leaf", "requires_grad", "grad", "grad_fn",
    "_version", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested",
    "size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous", "element_size",
    "data_ptr", "is_pinned", "is_floating_point", "is_complex", "get_device", "requires_grad_", "retain_grad",
    "register_hook", "__len__", "__hash__", "_is_view", "is_shared", "itemsize", "nbytes",
    "__setstate__", "_typed_storage",
})
# Ops that make a view (no value read); their result stays live.
_VIEWS = frozenset({
    "detach", "view", "view_as", "reshape", "reshape_as", "narrow", "select", "__getitem__", "as_strided",
    "t", "transpose", "permute", "flatten", "unflatten", "squeeze", "unsqueeze", "expand", "expand_as",
    "split", "chunk", "unbind", "tensor_split", "movedim", "swapaxes", "swapdims", "diagonal",
    "contiguous", "__get__:data",
})
# Ops that hand the bytes out of the hook's sight: written back first, and whatever they
# write before the next lookup is taken then.
_ESCAPES = frozenset({"numpy", "__array__", "untyped_storage", "storage", "__dlpack__", "__get__:data"})


def _name(func: Any) -> str:
    desc = getattr(func, "__self__", None)
    if isinstance(desc, (types.GetSetDescriptorType, property)) or type(desc).__name__ == "getset_descriptor":
        attr = getattr(desc, "__name__", "")
        return f"__get__:{attr}" if attr == "data" else attr
    return getattr(func, "__name__", "")


def _writes(name: str, kwargs: Dict[str, Any]) -> bool:
    if name in _META or name.startswith("__get__"):
        return False
    if name.endswith("_") and not name.endswith("__"):
        return True  # in-place methods and torch.nn.init functions (they call them)
    return name == "__setitem__" or (name.startswith("__i") and name.endswith("__")) or "out" in kwargs


def _storage_ptr(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage().data_ptr()


def _owner(tensors: Iterable[Any]) -> Optional[Any]:
    for t in tensors:
        if isinstance(t, torch.Tensor) and isinstance(t, (HostTierView, LiveTableSlice)):
            ref = _OWNERS.get(_storage_ptr(t))
            owner = ref() if ref is not None else None
            if owner is not None:
                return owner
    return None


def _flat(args: Any, kwargs: Dict[str, Any]) -> Iterable[Any]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _live(ret: Any, storage: int) -> Any:
    """``ret`` with every tensor that aliases the host storage ``storage`` made a live view."""
    if isinstance(ret, torch.Tensor) and not isinstance(ret, (HostTierView, LiveTableSlice)):
        with torch._C.DisableTorchFunctionSubclass():
            if ret.untyped_storage().data_ptr() == storage and ret.layout == torch.strided:
                return ret.as_subclass(HostTierView)
        return ret
    if isinstance(ret, (list, tuple)):
        return type(ret)(_live(r, storage) for r in ret)
    return ret


def _torch_function(func: Any, args: Any, kwargs: Optional[Dict[str, Any]]) -> Any:
    kwargs = kwargs or {}
    name = _name(func)
    owner = None if getattr(_STATE, "busy", False) or name in _META else _owner(_flat(args, kwargs))
    if owner is not None and (name not in _VIEWS or name in _ESCAPES):
        _STATE.busy = True
        try:
            owner.before_host_access()
        finally:
            _STATE.busy = False
    with torch._C.DisableTorchFunctionSubclass():
        ret = func(*args, **kwargs)
    if owner is None:
        return ret
    if _writes(name, kwargs) or name in _ESCAPES:
        owner.after_host_write()
    if name in _VIEWS or name in _ESCAPES:
        source = next(t for t in _flat(args, kwargs) if isinstance(t, (HostTierView, LiveTableSlice)))
        return _live(ret, _storage_ptr(source))
    return ret


def _written_back(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor (same bytes), after its owner wrote the cache back."""
    owner = _owner([t])
    if owner is not None and not getattr(_STATE, "busy", False):
        _STATE.busy = True
        try:
            owner.before_host_access()
        finally:
            _STATE.busy = False
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.as_subclass(t, torch.Tensor)


class HostTierView(torch.Tensor):
    """A view of a proactive kernel's host tier that reads and writes the live table (see
    the module docstring). Behaves as a plain tensor otherwise; a copy (``deepcopy``,
    pickling) is a plain tensor of the live values."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        return _torch_function(func, args, kwargs)

    def __reduce_ex__(self, protocol: int) -> Any:
        return _written_back(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        out = _written_back(self).clone()
        memo[id(self)] = out
        return out


class LiveTableSlice(TableBatchedEmbeddingSlice):
    """TorchRec's registered per-table parameter (``embedding_bags[t].weight``) over a
    proactive kernel's host tier, live as :class:`HostTierView` is; its views are those."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        return _torch_function(func, args, kwargs)

    def __reduce_ex__(self, protocol: int) -> Any:
        return _written_back(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        _written_back(self)
        return super().__deepcopy__(memo)


def register_host_storage(tensor: torch.Tensor, owner: HostTierOwner) -> None:
    """Live views over ``tensor``'s storage belong to ``owner`` (held weakly)."""
    if can_be_live(tensor):
        _OWNERS[_storage_ptr(tensor)] = weakref.ref(owner)


def can_be_live(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be made a live view: a plain tensor or parameter (FBGEMM's host
    weights are one), not a fake tensor (as under the sync detector) nor another subclass."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) or isinstance(tensor, (HostTierView, LiveTableSlice))


def live_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a view of registered host storage) as a live view; returned as it is
    where it cannot be one (``can_be_live``)."""
    if not can_be_live(tensor):
        return tensor
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(HostTierView)
