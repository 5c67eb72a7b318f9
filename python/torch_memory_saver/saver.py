"""The implementation behind ``torch_memory_saver.entrypoint.TorchMemorySaver``: regions,
pause/resume, CUDA graphs, ``disable()``, CPU backups, statistics."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from .binary_wrapper import BinaryWrapper
from .errors import InvalidArgumentError, InvalidStateError, LibraryNotFoundError, UnsupportedError
from .hooks import HookUtilBase

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["_TorchMemorySaverImpl"]

logger = logging.getLogger("torch_memory_saver")

BACKENDS = ("pinned", "mmap")


def _check_tag(tag: Any, *, optional: bool = False) -> Optional[str]:
    if tag is None and optional:
        return None
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str{' or None' if optional else ''}, not {type(tag).__name__}")
    if not tag:
        if optional:
            return None  # pause("") / resume(""): every tag, as callers of the existing library expect
        raise InvalidArgumentError("tag must not be empty")
    if "\0" in tag:
        raise InvalidArgumentError("tag must not contain NUL characters")
    return tag


def _check_backup(enable_cpu_backup: Any, backend: Any) -> Optional[str]:
    if backend is None:
        return None
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"cpu_backup_backend must be one of {BACKENDS}, not {backend!r}")
    if not enable_cpu_backup:
        raise InvalidArgumentError(
            f"cpu_backup_backend={backend!r} needs enable_cpu_backup=True (there is no backup to put in it)"
        )
    return backend


def _check_disk(enable_cpu_backup: bool, enable_disk_backup: Any) -> bool:
    disk = bool(enable_disk_backup)
    if disk and enable_cpu_backup:
        raise InvalidArgumentError(
            "enable_cpu_backup and enable_disk_backup are mutually exclusive (a paused tensor keeps its "
            "contents in one place)"
        )
    return disk


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


class _Routing:
    """Which pools this process's threads route allocations to, through ``use_mem_pool``.

    PyTorch (2.11) asserts, and so ends the process, when a ``MemPool`` is destroyed while any
    thread routes to a pool or captures a graph: the pool's destructor frees its cache, which
    needs that nothing be under way. ``disable()`` destroys its pool to give the cache back, so
    it does so only when no route or capture of this package is active in any thread; until
    then the pool waits in ``retired`` and goes with the last route or capture to end.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.retired: list = []

    def enter(self) -> None:
        with self.lock:
            self.active += 1

    def leave(self, torch: Any) -> None:
        with self.lock:
            self.active -= 1
        self.collect(torch)

    def retire(self, pool: Any, torch: Any) -> None:
        with self.lock:
            self.retired.append(pool)
        self.collect(torch)

    def collect(self, torch: Any) -> None:
        with self.lock:
            if self.active or not self.retired or torch.cuda.is_current_stream_capturing():
                return
            dead, self.retired = self.retired, []
        del dead  # the last references: each pool gives its cached blocks back to the device


_routing = _Routing()


class _Route:
    """One pool this thread's allocations are routed to, and the ``use_mem_pool`` context that
    does it while the route is the innermost one (None while a nested route suspends it)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.ctx: Any = None

    def start(self, torch: Any) -> None:
        ctx = torch.cuda.use_mem_pool(self.pool)
        ctx.__enter__()
        self.ctx = ctx
        _routing.enter()

    def stop(self, torch: Any) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            try:
                ctx.__exit__(None, None, None)
            finally:
                _routing.leave(torch)


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


class _TorchMemorySaverImpl:
    """What ``torch_memory_saver.torch_memory_saver`` does, in one hook mode."""

    def __init__(self, hook_mode: str = "preload") -> None:
        self._hook_util: HookUtilBase = HookUtilBase.create(hook_mode)
        self._lib: Optional[BinaryWrapper] = None
        self._lock = threading.RLock()
        self._pools: dict[tuple, Any] = {}
        self._local = threading.local()

    # ---------------------------------------------------------------- configuration

    @property
    def hook_mode(self) -> str:
        return self._hook_util.hook_mode

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        with self._lock:
            if mode == self._hook_util.hook_mode:
                return
            new = HookUtilBase.create(mode)  # refuses an unknown mode
            if self._lib is not None or self._pools:
                raise InvalidStateError(
                    f"hook_mode is already {self.hook_mode!r} and in use; set it before the first region or pause"
                )
            self._hook_util = new

    @property
    def _binary_wrapper(self) -> BinaryWrapper:
        """The loaded libtms.so (``.cdll`` is its ``ctypes.CDLL``); loaded on first use."""
        with self._lock:
            if self._lib is None:
                self._lib = self._hook_util.binary_wrapper()
                logger.debug("using libtms %s in %s mode", self._lib.tms_version().decode(), self.hook_mode)
            return self._lib

    def _library(self) -> BinaryWrapper:
        return self._binary_wrapper

    @property
    def enabled(self) -> bool:
        if self._lib is not None:
            return True
        try:
            return self._hook_util.get_path_binary() is not None
        except LibraryNotFoundError:
            return False

    @property
    def retain_cpu_backup(self) -> bool:
        lib = self._library()
        v = ctypes.c_int(0)
        lib.check(lib.tms_query_retain_cpu_backup(ctypes.byref(v)))
        return bool(v.value)

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, on: Any) -> None:
        lib = self._library()
        lib.check(lib.tms_set_retain_cpu_backup(int(bool(on))))

    @property
    def memory_margin_bytes(self) -> int:
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

    def set_disk_backup_dir(self, path: Any) -> None:
        """See ``TorchMemorySaver.set_disk_backup_dir``."""
        if path is not None and not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
        lib = self._library()
        lib.check(lib.tms_set_disk_backup_dir(None if path is None else os.fsencode(path)))

    # ---------------------------------------------------------------- regions

    @contextlib.contextmanager
    def _flags(
        self,
        lib: BinaryWrapper,
        enabled: bool,
        tag: Optional[str],
        backup: bool,
        backend: Optional[str],
        disk: bool = False,
    ):
        lib.check(lib.tms_region_enter(int(enabled), _enc(tag), int(backup), _enc(backend)))
        try:
            if disk:
                lib.check(lib.tms_set_enable_disk_backup(1))
            yield
        finally:
            lib.check(lib.tms_region_exit())

    def _pool(self, kind: str, tag: str, backup: Any, backend: Optional[str], device: int) -> Any:
        """The MemPool of (kind, tag, backup, backend, device), made on first use. Its allocator
        is the hook mode's: libtms.so in torch mode; PyTorch's own (cudaMalloc, which the
        preloaded library serves while the region's flags are on) in preload mode."""
        import torch

        with self._lock:
            key = (self.hook_mode, kind, tag, backup, backend, device)
            pool = self._pools.get(key)
            if pool is None:
                allocator = self._hook_util.get_allocator()
                pool = torch.cuda.MemPool(allocator.allocator()) if allocator is not None else torch.cuda.MemPool()
                self._pools[key] = pool
            return pool

    @contextlib.contextmanager
    def _routed(self, torch: Any, pool: Any = None) -> Iterator[None]:
        """Route this thread's allocations to ``pool`` inside the block. Routes nest: the
        innermost one wins, the enclosing one is suspended meanwhile and restarted after (so
        which pool serves does not depend on how PyTorch orders nested ``use_mem_pool``).
        ``pool=None``: a pool of PyTorch's own allocator for this block alone, dropped on exit
        before the enclosing route restarts, so that its cache can go back to the device."""
        stack = getattr(self._local, "routes", None)
        if stack is None:
            stack = self._local.routes = []
        retire = pool is None
        route = _Route(torch.cuda.MemPool() if retire else pool)
        del pool
        outer = stack[-1] if stack else None
        if outer is not None:
            outer.stop(torch)
        try:
            route.start(torch)
        except BaseException:
            if outer is not None:
                outer.start(torch)
            raise
        stack.append(route)
        try:
            yield
        finally:
            stack.pop()
            route.stop(torch)
            if retire:
                _routing.retire(route.pool, torch)
                route.pool = None
            if outer is not None:
                outer.start(torch)

    @contextlib.contextmanager
    def region(
        self,
        tag: str = "default",
        enable_cpu_backup: Any = False,
        cpu_backup_backend: Optional[str] = None,
        enable_disk_backup: Any = False,
    ) -> Iterator[None]:
        """See ``TorchMemorySaver.region``."""
        tag = _check_tag(tag)
        enable_cpu_backup = bool(enable_cpu_backup)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        disk = _check_disk(enable_cpu_backup, enable_disk_backup)
        lib = self._library()
        torch = _torch_if_cuda() if self.hook_mode == "preload" else _require_torch()
        if torch is None:
            # Preload mode without torch (C extensions calling cudaMalloc): the flags suffice.
            with self._flags(lib, True, tag, enable_cpu_backup, backend, disk):
                yield
            return
        # Each region's tensors live in a pool of their own, so PyTorch never hands a pauseable
        # block to a tensor made outside the region, nor a plain cached block to one inside it.
        backup = "disk" if disk else enable_cpu_backup
        pool = self._pool("region", tag, backup, backend, torch.cuda.current_device())
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk):
            with self._routed(torch, pool):
                yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """See ``TorchMemorySaver.disable``."""
        lib = self._library()
        torch = _torch_if_cuda()
        if torch is None:
            with self._flags(lib, False, None, False, None):
                yield
            return
        # A pool of its own with PyTorch's own allocator: plain cudaMalloc (the library's flags
        # are off, so a preloaded libtms.so passes it through), never a cached pauseable block
        # of the enclosing region's pool or, under TMS_INIT_ENABLE=1, of the default pool.
        # On exit the pool is dropped: PyTorch then gives its cached free blocks back to the
        # device (on torch 2.11 at once), while blocks of tensors still alive stay theirs.
        with self._flags(lib, False, None, False, None):
            with self._routed(torch):
                yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: "torch.cuda.CUDAGraph",
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = "default",
        enable_cpu_backup: Any = False,
        cpu_backup_backend: Optional[str] = None,
        enable_disk_backup: Any = False,
    ) -> Iterator[None]:
        """See ``TorchMemorySaver.cuda_graph``."""
        import torch

        tag = _check_tag(tag)
        enable_cpu_backup = bool(enable_cpu_backup)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        disk = _check_disk(enable_cpu_backup, enable_disk_backup)
        lib = self._library()
        if self.hook_mode == "torch" and pool is None:
            device = torch.cuda.current_device()
            backup = "disk" if disk else enable_cpu_backup
            pool = self._pool("graph", tag, backup, backend, device).id
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk):
            _routing.enter()  # a capture: no pool may be destroyed meanwhile (see _Routing)
            try:
                with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
                    yield
            finally:
                _routing.leave(torch)

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
        """The host backup of ``tensor`` as a CPU tensor of the same dtype and shape, or None
        where there is no complete snapshot (no backup enabled; active with the backup released;
        a pause writing it, or one that failed). While paused it holds the contents; while
        active with ``retain_cpu_backup`` it holds the last pause's. A copy by default; with
        ``zero_copy=True`` a view of the backup itself, which keeps that memory mapped and
        unchanged for as long as the view lives (a later pause writes a new buffer, a resume or
        free leaves this one to the view). ``tensor`` must be contiguous and lie inside one
        pauseable allocation."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, not {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise InvalidArgumentError("get_cpu_backup needs a contiguous tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise InvalidArgumentError("get_cpu_backup of an empty tensor")
        lib = self._library()
        if not zero_copy:
            host = torch.empty(nbytes, dtype=torch.uint8)
            found = ctypes.c_int(0)
            lib.check(lib.tms_copy_cpu_backup(tensor.data_ptr(), nbytes, host.data_ptr(), ctypes.byref(found)))
            return host.view(tensor.dtype).view(tensor.shape) if found.value else None
        out = ctypes.c_void_p(0)
        lease = ctypes.c_uint64(0)
        lib.check(lib.tms_acquire_cpu_backup(tensor.data_ptr(), nbytes, ctypes.byref(out), ctypes.byref(lease)))
        if not out.value:
            return None
        buf = (ctypes.c_uint8 * nbytes).from_address(out.value)
        # torch.frombuffer keeps `buf` alive as long as the tensor's storage, and `buf` its lease.
        buf._tms_lease = _Lease(lib, lease.value)
        return torch.frombuffer(buf, dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)

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
            f"{'disk GiB':>9} {'last pause':>18} {'last resume':>18}",
        ]

        def op(o: Optional[dict]) -> str:
            return "-" if not o else f"{o['seconds']:.3f}s {o['gib_per_s']:.1f}GiB/s"

        for t in s["tags"]:
            lines.append(
                f"{t['tag']:<16} {t['allocations']:>6} {t['paused_allocations']:>6} "
                f"{t['bytes_active'] / gib:>11.3f} {t['bytes_paused'] / gib:>11.3f} "
                f"{t['host_backup_bytes'] / gib:>9.3f} {t.get('disk_backup_bytes', 0) / gib:>9.3f} "
                f"{op(t['last_pause']):>18} {op(t['last_resume']):>18}"
            )
        return "\n".join(lines)
