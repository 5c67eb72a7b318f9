"""The TorchMemorySaver class: regions, pause/resume, CUDA graphs, CPU backups, statistics."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from . import _binding
from .errors import InvalidArgumentError, InvalidStateError, LibraryNotFoundError, UnsupportedError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TorchMemorySaver"]

logger = logging.getLogger("torch_memory_saver")

HOOK_MODES = ("preload", "torch")
BACKENDS = ("pinned", "mmap")


def _check_tag(tag: Any, *, optional: bool = False) -> Optional[str]:
    if tag is None and optional:
        return None
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str{' or None' if optional else ''}, not {type(tag).__name__}")
    if not tag:
        raise InvalidArgumentError("tag must not be empty")
    if "\0" in tag:
        raise InvalidArgumentError("tag must not contain NUL characters")
    return tag


def _check_backup(enable_cpu_backup: Any, backend: Any) -> Optional[str]:
    if not isinstance(enable_cpu_backup, bool):
        raise TypeError(f"enable_cpu_backup must be a bool, not {type(enable_cpu_backup).__name__}")
    if backend is None:
        return None
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"cpu_backup_backend must be one of {BACKENDS}, not {backend!r}")
    if not enable_cpu_backup:
        raise InvalidArgumentError(
            f"cpu_backup_backend={backend!r} needs enable_cpu_backup=True (there is no backup to put in it)"
        )
    return backend


def _expandable_segments_setting() -> Optional[str]:
    """The allocator setting variable that turns expandable segments on, if any."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in os.environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return var
    return None


def _torch_if_cuda() -> Any:
    """torch, if it is installed and has CUDA; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _require_torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise UnsupportedError("torch hook mode needs PyTorch with CUDA, and torch cannot be imported") from e
    return torch


def _enc(s: Optional[str]) -> Optional[bytes]:
    return None if s is None else s.encode("utf-8")


class TorchMemorySaver:
    """Pauseable GPU memory for PyTorch.

    Tensors allocated inside :meth:`region` (or captured by :meth:`cuda_graph`) can give their
    device memory back with :meth:`pause` and get it back with :meth:`resume`, at the same
    addresses, so tensors, pointers and CUDA graphs stay valid. With ``enable_cpu_backup=True``
    the contents survive; without it they are undefined after resume.

    Use the process-wide instance ``torch_memory_saver.torch_memory_saver``.
    """

    def __init__(self) -> None:
        self._hook_mode = "preload"
        self._lib: Optional[_binding.Library] = None
        self._lock = threading.RLock()
        self._allocator: Any = None
        self._pools: dict[tuple, Any] = {}

    # ---------------------------------------------------------------- configuration

    @property
    def hook_mode(self) -> str:
        """``"preload"`` (libtms.so in ``LD_PRELOAD``; the default) or ``"torch"`` (a
        ``torch.cuda.MemPool`` per tag whose allocator is libtms.so). Set before first use."""
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        if mode not in HOOK_MODES:
            raise InvalidArgumentError(f"hook_mode must be one of {HOOK_MODES}, not {mode!r}")
        with self._lock:
            if self._lib is not None and mode != self._hook_mode:
                raise InvalidStateError(
                    f"hook_mode is already {self._hook_mode!r} and in use; set it before the first region or pause"
                )
            self._hook_mode = mode

    def _library(self) -> _binding.Library:
        with self._lock:
            if self._lib is not None:
                return self._lib
            if self._hook_mode == "preload":
                var = _expandable_segments_setting()
                if var:
                    raise UnsupportedError(
                        f"{var} has expandable_segments:True: PyTorch then maps memory itself and never calls "
                        "cudaMalloc, so preload mode cannot make it pauseable. Remove the setting, or use "
                        "torch_memory_saver.hook_mode = 'torch'."
                    )
                lib = _binding.preloaded()
                if lib is None:
                    try:
                        path = _binding.bundled_library_path()
                    except LibraryNotFoundError:
                        path = "/path/to/libtms.so"
                    raise LibraryNotFoundError(
                        "hook_mode 'preload' needs libtms.so in LD_PRELOAD, and this process does not have it: "
                        f"run `LD_PRELOAD={path} python ...`, start child processes inside "
                        "`torch_memory_saver.configure_subprocess()`, or set torch_memory_saver.hook_mode = 'torch'"
                    )
            else:
                lib = _binding.load()
            self._lib = lib
            logger.debug("using libtms %s in %s mode", lib.tms_version().decode(), self._hook_mode)
            return lib

    @property
    def enabled(self) -> bool:
        """True when libtms.so is present in this process for the current hook mode."""
        if self._lib is not None:
            return True
        if self._hook_mode == "preload":
            return _binding.preloaded() is not None
        try:
            _binding.bundled_library_path()
            return True
        except LibraryNotFoundError:
            return False

    @property
    def retain_cpu_backup(self) -> bool:
        """Keep host backups across resume, so the next pause reuses them instead of allocating
        host memory again. Consulted at resume; setting it to False frees nothing at once."""
        lib = self._library()
        v = ctypes.c_int(0)
        lib.check(lib.tms_get_retain_cpu_backup(ctypes.byref(v)))
        return bool(v.value)

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"retain_cpu_backup must be a bool, not {type(on).__name__}")
        lib = self._library()
        lib.check(lib.tms_set_retain_cpu_backup(int(on)))

    @property
    def memory_margin_bytes(self) -> int:
        """A pauseable allocation that would leave fewer bytes free on the device fails with out
        of memory (so PyTorch frees its cache and retries). 0 turns it off."""
        lib = self._library()
        v = ctypes.c_uint64(0)
        lib.check(lib.tms_get_memory_margin(ctypes.byref(v)))
        return v.value

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"memory_margin_bytes must be an int, not {type(n).__name__}")
        if n < 0:
            raise InvalidArgumentError(f"memory_margin_bytes must be >= 0, not {n}")
        lib = self._library()
        lib.check(lib.tms_set_memory_margin(n))

    # ---------------------------------------------------------------- regions

    @contextlib.contextmanager
    def _flags(self, lib: _binding.Library, enabled: bool, tag: Optional[str], backup: bool, backend: Optional[str]):
        lib.check(lib.tms_region_enter(int(enabled), _enc(tag), int(backup), _enc(backend)))
        try:
            yield
        finally:
            lib.check(lib.tms_region_exit())

    def _pool(self, kind: str, tag: str, backup: bool, backend: Optional[str], device: int) -> Any:
        """The MemPool of (kind, tag, backup, backend, device), made on first use. In torch mode
        its allocator is libtms.so; in preload mode it is PyTorch's own (cudaMalloc, which the
        preloaded library serves while the region's flags are on)."""
        import torch

        with self._lock:
            key = (self._hook_mode, kind, tag, backup, backend, device)
            pool = self._pools.get(key)
            if pool is not None:
                return pool
            if self._hook_mode == "torch":
                if self._allocator is None:
                    from torch.cuda.memory import CUDAPluggableAllocator

                    lib = self._library()
                    self._allocator = CUDAPluggableAllocator(lib.path, "tms_torch_malloc", "tms_torch_free")
                pool = torch.cuda.MemPool(self._allocator.allocator())
            else:
                pool = torch.cuda.MemPool()
            self._pools[key] = pool
            return pool

    @contextlib.contextmanager
    def region(
        self, tag: str = "default", enable_cpu_backup: bool = False, cpu_backup_backend: Optional[str] = None
    ) -> Iterator[None]:
        """Tensors allocated inside are pauseable under ``tag``.

        They come from a ``torch.cuda.MemPool`` of the region's own (one per tag, backup setting,
        backend and device), so cached blocks never move between pauseable and ordinary tensors.

        ``enable_cpu_backup=True`` keeps their contents across pause in host memory:
        ``cpu_backup_backend="pinned"`` (the default, or ``TMS_INIT_CPU_BACKUP_BACKEND``) is
        page-locked once retained (``retain_cpu_backup``; a background thread does it after the
        pause), so later cycles copy at link speed; ``"mmap"`` stays pageable, so the kernel can
        take it back. Both are filled and read through small page-locked staging buffers where
        they are not page-locked.
        """
        tag = _check_tag(tag)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        lib = self._library()
        torch = _torch_if_cuda() if self._hook_mode == "preload" else _require_torch()
        if torch is None:
            # Preload mode without torch (C extensions calling cudaMalloc): the flags suffice.
            with self._flags(lib, True, tag, enable_cpu_backup, backend):
                yield
            return
        # Each region's tensors live in a pool of their own, so PyTorch never hands a pauseable
        # block to a tensor made outside the region, nor a plain cached block to one inside it.
        pool = self._pool("region", tag, enable_cpu_backup, backend, torch.cuda.current_device())
        with self._flags(lib, True, tag, enable_cpu_backup, backend):
            with torch.cuda.use_mem_pool(pool):
                yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations inside are ordinary (not pauseable), even inside a region."""
        lib = self._library()
        with self._flags(lib, False, None, False, None):
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: "torch.cuda.CUDAGraph",
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = "default",
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ) -> Iterator[None]:
        """Like ``torch.cuda.graph(...)``, but the graph's own memory (its intermediate tensors)
        is pauseable under ``tag``; the graph replays correctly after resume. Works in both hook
        modes."""
        import torch

        tag = _check_tag(tag)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        lib = self._library()
        if self._hook_mode == "torch" and pool is None:
            device = torch.cuda.current_device()
            pool = self._pool("graph", tag, enable_cpu_backup, backend, device).id
        with self._flags(lib, True, tag, enable_cpu_backup, backend):
            with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
                yield

    # ---------------------------------------------------------------- pause / resume

    def pause(self, tag: Optional[str] = None) -> None:
        """Give back the device memory of ``tag`` (every tag if None), backing up contents where
        the region asked for it. Pausing what is paused does nothing."""
        tag = _check_tag(tag, optional=True)
        lib = self._library()
        t0 = time.perf_counter()
        lib.check(lib.tms_pause(_enc(tag)))
        logger.info("paused %s in %.3f s", "all tags" if tag is None else f"tag {tag!r}", time.perf_counter() - t0)

    def resume(self, tag: Optional[str] = None) -> None:
        """Take device memory back for ``tag`` (every tag if None), at the same addresses, and
        restore backups. On out of memory raises :class:`OutOfMemoryError` and the tag stays
        paused with its backups: free memory and call again."""
        tag = _check_tag(tag, optional=True)
        lib = self._library()
        t0 = time.perf_counter()
        lib.check(lib.tms_resume(_enc(tag)))
        logger.info("resumed %s in %.3f s", "all tags" if tag is None else f"tag {tag!r}", time.perf_counter() - t0)

    # ---------------------------------------------------------------- backups and stats

    def get_cpu_backup(self, tensor: "torch.Tensor", zero_copy: bool = False) -> "Optional[torch.Tensor]":
        """The host backup of ``tensor`` as a CPU tensor of the same dtype and shape (a copy, or
        with ``zero_copy=True`` a view of the backup itself, valid until the next resume without
        retention or the tensor's memory is freed), or None where there is none (no backup
        enabled, or the allocation is active and its backup was released). ``tensor`` must be
        contiguous and lie inside one pauseable allocation."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, not {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise InvalidArgumentError("get_cpu_backup needs a contiguous tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise InvalidArgumentError("get_cpu_backup of an empty tensor")
        lib = self._library()
        out = ctypes.c_void_p(0)
        lib.check(lib.tms_get_cpu_backup(tensor.data_ptr(), nbytes, ctypes.byref(out)))
        if not out.value:
            return None
        buf = (ctypes.c_uint8 * nbytes).from_address(out.value)
        host = torch.frombuffer(buf, dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)
        return host if zero_copy else host.clone()

    def stats(self) -> dict:
        """Per-tag statistics: allocations, bytes active/paused, host backup bytes (and how many
        of them are page-locked), and the last pause/resume (seconds, bytes, GiB/s, and the part
        of a resume spent releasing host memory)."""
        lib = self._library()
        return json.loads(lib.call_string(lib.tms_stats_json))

    def summary(self) -> str:
        """The statistics as a readable table."""
        s = self.stats()
        gib = float(1 << 30)
        lines = [
            f"torch-memory-saver ({s['backend']}): retain_cpu_backup={s['retain_cpu_backup']}, "
            f"memory_margin_bytes={s['memory_margin_bytes']}",
            f"{'tag':<16} {'allocs':>6} {'paused':>6} {'active GiB':>11} {'paused GiB':>11} {'host GiB':>9} "
            f"{'last pause':>18} {'last resume':>18}",
        ]

        def op(o: Optional[dict]) -> str:
            return "-" if not o else f"{o['seconds']:.3f}s {o['gib_per_s']:.1f}GiB/s"

        for t in s["tags"]:
            lines.append(
                f"{t['tag']:<16} {t['allocations']:>6} {t['paused_allocations']:>6} "
                f"{t['bytes_active'] / gib:>11.3f} {t['bytes_paused'] / gib:>11.3f} "
                f"{t['host_backup_bytes'] / gib:>9.3f} {op(t['last_pause']):>18} {op(t['last_resume']):>18}"
            )
        return "\n".join(lines)
