"""CPU backups read back as tensors: a copy, or a view of the backup itself that holds a
lease on it (:class:`_Lease`) for as long as the view lives."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Callable, Optional

from .binary_wrapper import BinaryWrapper
from .errors import InvalidArgumentError, NotFoundError

if TYPE_CHECKING:  # pragma: no cover
    import torch


class _Lease:
    """One leased CPU backup (``tms_acquire_cpu_backup``), released with the last view of it."""

    __slots__ = ("_release", "lease")

    def __init__(self, lib: Any, lease: int) -> None:
        self._release = lib.tms_release_cpu_backup
        self.lease = lease

    def __del__(self) -> None:
        try:
            self._release(self.lease)
        except Exception:  # interpreter shutdown: the library goes with the process
            pass


class _CpuBackups:
    """``get_cpu_backup`` of :class:`~.saver._TorchMemorySaverImpl`, which gives the library."""

    _library: Callable[[], BinaryWrapper]
    _lib: Optional[BinaryWrapper]
    available: bool

    def get_cpu_backup(self, tensor: "torch.Tensor", zero_copy: bool = False) -> "Optional[torch.Tensor]":
        """The host backup of ``tensor`` as a CPU tensor of the same dtype and shape, or None
        where there is no complete snapshot (no backup enabled; active with the backup released;
        a pause writing it, or one that failed; no library in this process, as in preload mode
        without ``LD_PRELOAD``) and where there is nothing to back up: a tensor
        that does not lie inside one pauseable allocation (made outside every region, or
        spanning two), or an empty one. Integrations ask for every parameter and fall back on
        None, as the existing library answers. While paused it holds the contents; while active
        with ``retain_cpu_backup`` it holds the last pause's. A copy by default; with
        ``zero_copy=True`` a view of the backup itself, which keeps that memory mapped and
        unchanged for as long as the view lives (a later pause writes a new buffer, a resume or
        free leaves this one to the view). ``tensor`` must be contiguous."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, not {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise InvalidArgumentError("get_cpu_backup needs a contiguous tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return None
        if self._lib is None and not self.available:
            return None  # no library in this process (preload mode without LD_PRELOAD): no backups
        try:
            return self._backup_of(tensor, nbytes, zero_copy)
        except NotFoundError:
            return None

    def _backup_of(self, tensor: "torch.Tensor", nbytes: int, zero_copy: bool) -> "Optional[torch.Tensor]":
        import torch

        lib = self._library()
        if not zero_copy:
            host = torch.empty(nbytes, dtype=torch.uint8)
            found = ctypes.c_int(0)
            lib.check(lib.tms_copy_cpu_backup(tensor.data_ptr(), nbytes, host.data_ptr(), ctypes.byref(found)))
            return host.view(tensor.dtype).view(tensor.shape) if found.value else None
        out = ctypes.c_void_p(0)
        lease = ctypes.c_uint64(0)
        held = None
        try:
            lib.check(lib.tms_acquire_cpu_backup(tensor.data_ptr(), nbytes, ctypes.byref(out), ctypes.byref(lease)))
            if not out.value:
                return None
            held = _Lease(lib, lease.value)
            buf = (ctypes.c_uint8 * nbytes).from_address(out.value)
            # torch.frombuffer keeps `buf` alive as long as the tensor's storage, and `buf` its lease.
            buf._tms_lease = held
            return torch.frombuffer(buf, dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)
        except BaseException:
            # The call may wait long (for the page-locking of a retained backup), and a Ctrl-C
            # then lands as it returns, the lease taken: no _Lease owns it yet, so it goes here.
            # (A lease ended twice is refused harmlessly: numbers are never reused.)
            if held is None and lease.value:
                lib.tms_release_cpu_backup(lease.value)
            raise
