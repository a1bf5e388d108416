"""Proving on a CPU-only machine that device-side code never makes the host wait for the GPU.

A host-device synchronisation happens whenever the host needs a value or a size that only
the device knows: ``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``/``.numpy()`` of a device
tensor, ``nonzero``, ``unique``, boolean indexing, and a blocking upload from pageable host
memory (which waits for the stream). On CUDA each costs the training thread its lead over
the GPU. ``torch.cuda.set_sync_debug_mode("error")`` catches them on a GPU; this module
catches them without one.

:func:`fake_cuda` runs code on *fake* CUDA tensors (``FakeTensorMode``: shapes, dtypes and
devices without storage), under a dispatch mode that raises :class:`HostSyncError` for
every operation that would read device data on the host. Code that passes under it needs
no synchronisation on a real GPU, because fake tensors have no values to read.

Two limitations of fake CUDA tensors on a CPU-only build of torch: Python slicing
(``t[1:]``) of a CUDA tensor fails there for lack of CUDA support (not because it would
sync), so device-side code uses ``narrow`` instead; and ``copy_`` between two CUDA tensors
fails the same way, so the guard answers it itself (it moves nothing a fake tensor holds).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """An operation would make the host wait for device data."""


def _is_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


class _HostReadGuard(TorchDispatchMode):
    """Raises on device-to-host reads and blocking uploads; lets every other op through."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []  # every op seen, for tests that want to know what ran
        self._setup = False

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """Lets uploads through while objects are built (construction is not the step,
        and uploads its constants once); every other check stays on."""
        self._setup = True
        try:
            yield
        finally:
            self._setup = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        self.ops.append(name)
        if func is _aten._to_copy.default and not self._setup:
            src, target = args[0], kwargs.get("device")
            if _is_device(src) and target is not None and torch.device(target).type == "cpu":
                raise HostSyncError(f"{name}: a device tensor {tuple(src.shape)} is copied to the host")
            if not _is_device(src) and target is not None and torch.device(target).type != "cpu":
                return self._upload(src, torch.device(target), kwargs.get("non_blocking", False), name,
                                    kwargs.get("dtype") or src.dtype)
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if _is_device(src) and not _is_device(dst):
                raise HostSyncError(f"{name}: a device tensor {tuple(src.shape)} is copied into host memory")
            if _is_device(dst) and not _is_device(src) and not self._setup:
                self._upload(src, dst.device, args[2] if len(args) > 2 else kwargs.get("non_blocking", False),
                             name, dst.dtype)
                return dst
            if _is_device(dst) and _is_device(src):
                # Device to device: no host involvement. (Fake CUDA tensors cannot run
                # ``copy_`` on a CPU-only build; with no values to move, dst is the result.)
                return dst
        try:
            return func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise HostSyncError(f"{name} needs device data on the host (its result depends on values)") from e

    @staticmethod
    def _upload(src: torch.Tensor, device: torch.device, non_blocking: bool, name: str, dtype: Any) -> torch.Tensor:
        # Only an asynchronous copy out of pinned memory leaves the host free; fake tensors
        # have no pinned memory to check, so the flag stands for it (callers pin first).
        if not non_blocking:
            raise HostSyncError(f"{name}: a blocking host-to-device upload of {tuple(src.shape)} waits for the stream")
        return torch.empty(src.shape, dtype=dtype, device=device)


@contextlib.contextmanager
def fake_cuda() -> Iterator[_HostReadGuard]:
    """Runs the block on fake CUDA tensors; any host read of device data raises
    :class:`HostSyncError`. Create the device-side state inside the block."""
    with FakeTensorMode(allow_non_fake_inputs=True), _HostReadGuard() as guard:
        yield guard
