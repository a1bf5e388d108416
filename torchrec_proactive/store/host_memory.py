"""Host memory the GPU addresses, held once and at its exact size (issue 44, item 1).

A table's host tier (its rows, then each optimizer state) is the largest allocation of a
job: 50M rows x 128 fp32 with Adam is 76.8 GB. Two ways of holding it cost a second one:

* a *copy*: FBGEMM's TBE holds the rows in host-mapped memory (``uvm_host_mapped``:
  ``new_host_mapped_tensor`` = ``malloc`` + ``cudaHostRegister``), and FBGEMM's only alias
  op, ``uvm_to_cpu``, accepts managed memory alone (its ``TORCH_CHECK`` on the
  ``CUDAManagedIndirectContext`` fails for host-mapped storage) - so a caller that copies
  when it raises holds every row twice;
* *pinned tensors from PyTorch's caching host allocator* (``pin_memory=True``), which
  round every block up to a power of two (a 25.6 GB state becomes 32 GiB).

Here both tensors are made once: :func:`cpu_alias` is a CPU tensor over the very bytes of a
UVM tensor (FBGEMM's ``uvm_to_cpu`` for managed memory; for host-mapped memory, the host
address the CUDA runtime reports for the allocation, ``cudaPointerGetAttributes``), and
:func:`mapped_zeros` allocates exact-size host-mapped memory with FBGEMM's own op and
aliases it. Both keep the UVM tensor alive as long as any CPU view of it lives.

Reproducer on a GPU of what this replaces::

    torch.ops.fbgemm.uvm_to_cpu(torch.ops.fbgemm.new_host_mapped_tensor(torch.empty(0, device="cuda"), [8]))
    # RuntimeError (FBGEMM's TORCH_CHECK): host-mapped storage has no managed context

:class:`HostBytes` counts, on any machine, the host bytes a piece of code allocates (pinned
blocks at the caching allocator's power-of-two size); :func:`fake_host_mapped` models
FBGEMM's host-mapped memory on a CPU-only build (``integration/host_tier_probe.py`` uses
both to measure the TorchRec path).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

__all__ = ["cpu_alias", "mapped_zeros", "HostBytes", "fake_host_mapped"]


def _fbgemm_op(name: str) -> Optional[Any]:
    """FBGEMM's op ``name`` where fbgemm_gpu is installed (the store does not need it)."""
    try:
        import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
    except ImportError:
        return None
    try:
        return getattr(torch.ops.fbgemm, name)
    except (AttributeError, RuntimeError):
        return None


class _PointerAttributes(ctypes.Structure):
    # ``cudaPointerAttributes`` since CUDA 11: type, device, devicePointer, hostPointer.
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p)]


_CUDA_MEMORY_TYPE_HOST = 1


def _loaded_cudart() -> Optional[Any]:
    """The CUDA runtime library this process already loaded (torch's), or None."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def _mapped_host_pointer(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(host address, bytes)`` of the allocation behind a CUDA tensor of host-mapped
    memory (FBGEMM's ``new_host_mapped_tensor``: registered with ``cudaHostRegister``), as
    the CUDA runtime reports it; None for any other memory or where it cannot be asked."""
    if t.device.type != "cuda" or not torch.cuda.is_available():
        return None
    is_uvm = _fbgemm_op("is_uvm_tensor")
    if is_uvm is None or not is_uvm(t):
        return None
    lib = _loaded_cudart()
    if lib is None:
        return None
    storage = t.untyped_storage()
    attrs = _PointerAttributes()
    if lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(storage.data_ptr())) != 0:
        return None
    if attrs.type != _CUDA_MEMORY_TYPE_HOST or not attrs.hostPointer:
        return None
    return int(attrs.hostPointer), int(storage.nbytes())


def _cpu_bytes_at(address: int, nbytes: int, owner: torch.Tensor) -> torch.Tensor:
    """A CPU ``uint8`` tensor over ``nbytes`` at ``address``, which keeps ``owner`` (the
    allocation's UVM tensor) alive as long as it or any view of it lives."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    raw = (ctypes.c_ubyte * nbytes).from_address(address)
    raw._owner = owner  # type: ignore[attr-defined]  # (torch.frombuffer holds ``raw``)
    return torch.frombuffer(raw, dtype=torch.uint8)


def cpu_alias(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A CPU tensor over the same bytes as the UVM tensor ``t`` (same shape, strides and
    offset; no copy): managed memory through FBGEMM's ``uvm_to_cpu``, host-mapped memory
    through the host address of its allocation. None where neither applies (then the
    caller must copy, and should say so)."""
    to_cpu = _fbgemm_op("uvm_to_cpu")
    if to_cpu is not None:
        try:
            return to_cpu(t)
        except (RuntimeError, NotImplementedError):
            pass  # (host-mapped storage: FBGEMM's check refuses it)
    where = _mapped_host_pointer(t)
    if where is None:
        return None
    address, nbytes = where
    whole = _cpu_bytes_at(address, nbytes, t).view(t.dtype)
    return whole.as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())


def mapped_zeros(shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed host memory of exactly ``shape`` (FBGEMM's ``new_host_mapped_tensor``:
    ``malloc`` + ``cudaHostRegister``, no power-of-two rounding), as ``(CPU tensor, the
    device's view)`` over the same bytes; None off CUDA or where it cannot be made."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    op = _fbgemm_op("new_host_mapped_tensor")
    if op is None:
        return None
    try:
        mapped = op(torch.empty(0, dtype=dtype, device=dev), [int(s) for s in shape])
    except (RuntimeError, NotImplementedError):
        return None
    host = cpu_alias(mapped)
    if host is None:
        return None
    host.zero_()  # (FBGEMM only touches one byte per page to fault them in)
    return host, mapped


# ---------------------------------------------------------------------- counting host bytes
def _pinned_block(nbytes: int) -> int:
    """The block PyTorch's caching host allocator takes for ``nbytes`` (a power of two)."""
    return 1 << max(0, (nbytes - 1).bit_length()) if nbytes > 0 else 0


class HostBytes(TorchDispatchMode):
    """Counts the host bytes allocated by the ops it sees: new CPU tensors at their size
    (views and in-place results are no allocation), pinned ones (``pin_memory=True``,
    ``.pin_memory()``) at the power of two the caching host allocator takes. Host-mapped
    allocations are added by whoever makes them (``fake_host_mapped``)."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu = 0
        self.pinned = 0
        self.mapped = 0
        self.largest: List[Tuple[str, int]] = []

    @property
    def total(self) -> int:
        return self.cpu + self.pinned + self.mapped

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False) or any(r.alias_info is not None for r in func._schema.returns):
            return out
        pinned = bool(kwargs.get("pin_memory")) or func is torch.ops.aten._pin_memory.default
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                n = t.numel() * t.element_size()
                if pinned:
                    self.pinned += _pinned_block(n)
                else:
                    self.cpu += n
                if n >= 1 << 16:
                    self.largest.append((str(func), n))
        return out


class _FakeHostMapped:
    """FBGEMM's host-mapped memory on a CPU-only build: ``new`` gives a CUDA tensor (a fake
    one: run it under ``FakeTensorMode``) backed by real host bytes, which
    ``_mapped_host_pointer`` reports as CUDA's runtime would; FBGEMM's ``uvm_to_cpu``
    refuses it, as FBGEMM does on a GPU."""

    def __init__(self, counter: Optional[HostBytes]) -> None:
        self.counter = counter
        self._backing: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(storage owner) -> (tensor, bytes)

    def new(self, like: torch.Tensor, sizes: Sequence[int], count: bool = True) -> torch.Tensor:
        numel = 1
        for s in sizes:
            numel *= int(s)
        nbytes = numel * like.element_size()
        with _disable_current_modes():  # (real bytes, not a fake tensor, and not counted as the code's)
            backing = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        mapped = torch.empty(list(sizes), dtype=like.dtype, device=like.device)
        self._backing[id(mapped)] = (mapped, backing)
        if count and self.counter is not None:
            self.counter.mapped += nbytes
        return mapped

    def _base_of(self, t: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        for mapped, backing in self._backing.values():
            if t is mapped or (t.device == mapped.device and t.untyped_storage()._cdata == mapped.untyped_storage()._cdata):
                return mapped, backing
        return None

    def pointer(self, t: torch.Tensor) -> Optional[Tuple[int, int]]:
        found = self._base_of(t)
        if found is None:
            return None
        _, backing = found
        return backing.data_ptr(), int(backing.numel())

    def uvm_to_cpu(self, real: Any) -> Any:
        def op(t: torch.Tensor) -> torch.Tensor:
            if self._base_of(t) is not None:
                raise RuntimeError("Expected tcontext != nullptr to be true, but got false.  (FBGEMM's uvm_to_cpu "
                                   "on host-mapped storage, as on a GPU)")
            return real(t)
        return op


@contextlib.contextmanager
def fake_host_mapped(counter: Optional[HostBytes] = None) -> Iterator[_FakeHostMapped]:
    """Models FBGEMM's host-mapped memory for the block (see :class:`_FakeHostMapped`):
    ``torch.ops.fbgemm.new_host_mapped_tensor`` allocates it (counted in
    ``counter.mapped`` at its exact size) and ``uvm_to_cpu`` refuses it. Use inside
    ``FakeTensorMode`` (``sync_detector.fake_cuda``)."""
    model = _FakeHostMapped(counter)
    to_cpu = _fbgemm_op("uvm_to_cpu")
    fbgemm = torch.ops.fbgemm
    patches = [mock.patch(f"{__name__}._mapped_host_pointer", model.pointer),
               mock.patch.object(fbgemm, "new_host_mapped_tensor", lambda like, sizes: model.new(like, sizes),
                                 create=True)]
    if to_cpu is not None:
        patches.append(mock.patch.object(fbgemm, "uvm_to_cpu", model.uvm_to_cpu(to_cpu)))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield model
