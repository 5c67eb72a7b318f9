"""Regions, graph captures and ``disable()`` blocks of the implementation
(:class:`~.saver._TorchMemorySaverImpl`): the library's per-thread flags and, where torch is in
use, which ``MemPool`` serves the allocations: one per region key (:class:`_PoolMap`, the
``_mem_pools`` integrations reach), routed to per thread (``routing.py``)."""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional

from . import routing
from .arguments import (
    _check_backup,
    _check_chunk_size,
    _check_disk,
    _check_tag,
    _enc,
    _require_torch,
    _torch_if_cuda,
    resolve_cpu_backup_backend,
)
from .binary_wrapper import BinaryWrapper
from .errors import InvalidArgumentError, TorchMemorySaverError
from .hooks import HookUtilBase

if TYPE_CHECKING:  # pragma: no cover
    import torch

# The library's message for an allocation whose size is not a multiple of its region's chunk size.
_CHUNK_MISFIT = re.compile(r"chunk size (\d+) bytes: the size \((\d+) bytes\) must be a multiple of it")


class _PoolMap(dict):
    """Region (or graph) pools by ``(tag, enable_cpu_backup, enable_disk_backup, backend,
    device)``, plus the chunk size where chunked; ``backend`` is ``""`` without a CPU backup, as
    the existing library keys it. A key of the shape an earlier version of the existing library
    used names every pool it covers, for the callers written against it: ``(tag,
    enable_cpu_backup)`` (0.0.9), ``(tag, enable_cpu_backup, device)`` and ``(tag,
    enable_cpu_backup, enable_disk_backup, device)``. ``in``, ``get``, ``[]``, ``[] =``, ``pop``
    and ``del`` take them: ``pop`` and ``del`` drop every pool covered (so the next region of the
    tag gets a new pool, never a cached block of the old one); ``[] =`` puts the pool given in
    place of every pool covered (the tag's next region allocates from it, and the old pool can
    go), and is kept under the key as given where it covers none; ``get``, ``[]`` and ``pop``
    give the pool where one is covered, a list of them where several are."""

    # Which places of a full key each earlier shape holds, by its length.
    _OLDER_SHAPES = {2: (0, 1), 3: (0, 1, 4), 4: (0, 1, 2, 4)}

    def _covered(self, key: Any) -> Optional[list]:
        """The full keys an earlier-shaped ``key`` covers; None for any other key (a full one,
        or one held as it is)."""
        places = self._OLDER_SHAPES.get(len(key)) if isinstance(key, tuple) else None
        if places is None or dict.__contains__(self, key):
            return None
        return [k for k in list(dict.keys(self)) if len(k) >= 5 and tuple(k[i] for i in places) == key]

    @staticmethod
    def _one_or_all(pools: list) -> Any:
        return pools[0] if len(pools) == 1 else pools

    def __contains__(self, key: Any) -> bool:
        covered = self._covered(key)
        return dict.__contains__(self, key) if covered is None else bool(covered)

    def __getitem__(self, key: Any) -> Any:
        covered = self._covered(key)
        if not covered:  # None: a key as it is; []: an earlier shape that covers nothing
            return dict.__getitem__(self, key)
        return self._one_or_all([dict.__getitem__(self, k) for k in covered])

    def __setitem__(self, key: Any, value: Any) -> None:
        replaced = []
        for k in self._covered(key) or [key]:
            old = dict.get(self, k)
            if old is not None and old is not value:
                replaced.append(old)
            dict.__setitem__(self, k, value)
        routing._routing.retire_pools(replaced)

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __delitem__(self, key: Any) -> None:
        self.pop(key)

    _NO_DEFAULT = object()

    def pop(self, key: Any, default: Any = _NO_DEFAULT) -> Any:
        covered = self._covered(key)
        if not covered:
            if default is not self._NO_DEFAULT and not dict.__contains__(self, key):
                return default
            covered = [key]
        pools = [dict.pop(self, k) for k in covered]
        routing._routing.retire_pools(pools)
        return self._one_or_all(pools)

    def clear(self) -> None:
        pools = list(dict.values(self))
        dict.clear(self)
        routing._routing.retire_pools(pools)

    def popitem(self) -> tuple:
        item = dict.popitem(self)
        routing._routing.retire_pools([item[1]])
        return item

    def update(self, *args: Any, **kwargs: Any) -> None:
        # Key by key through [] =, so that earlier-shaped keys cover and replaced pools retire.
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def __ior__(self, other: Any) -> "_PoolMap":
        self.update(other)
        return self


class _Regions:
    """Regions, graph captures, ``disable()`` and ``_with_region_config`` of
    :class:`~.saver._TorchMemorySaverImpl`, which holds the state declared here."""

    _hook_util: HookUtilBase
    _lock: threading.RLock
    _local: threading.local
    _mem_pools: _PoolMap
    _graph_pools: _PoolMap
    _kept_disable_pools: Dict[int, Any]
    hook_mode: str
    _library: Callable[[], BinaryWrapper]

    @contextlib.contextmanager
    def _with_region_config(
        self,
        tag: str = "default",
        enable_cpu_backup: Any = False,
        cpu_backup_backend: Optional[str] = None,
        enable_disk_backup: Any = False,
    ) -> Iterator[None]:
        """This thread's allocations are pauseable with these settings inside, with no pool
        routing (the existing library's internal context, which its callers use to free tensors
        under a tag)."""
        tag = _check_tag(tag)
        enable_cpu_backup = bool(enable_cpu_backup)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        disk = _check_disk(enable_cpu_backup, enable_disk_backup)
        lib = self._library()
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk):
            yield


    @contextlib.contextmanager
    def _flags(
        self,
        lib: BinaryWrapper,
        enabled: bool,
        tag: Optional[str],
        backup: bool,
        backend: Optional[str],
        disk: bool = False,
        chunk: int = 0,
    ):
        lib.check(lib.tms_region_enter(int(enabled), _enc(tag), int(backup), _enc(backend)))
        try:
            if disk:
                lib.check(lib.tms_set_enable_disk_backup(1))
            if chunk:
                lib.check(lib.tms_set_chunk_size(chunk))  # names the granularity where it does not fit
            yield
        finally:
            lib.check(lib.tms_region_exit())

    @contextlib.contextmanager
    def _chunk_misfits(self, lib: BinaryWrapper, chunk: int) -> Iterator[None]:
        """Inside a region with a chunk size: an error PyTorch raised for an allocation the
        library refused because its size is not a multiple of the chunk size (torch's
        OutOfMemoryError in torch mode, its CUDA error in preload mode) becomes our
        :class:`InvalidArgumentError` with the library's message, chained from torch's. Only
        when this thread's last library error is that refusal, recorded inside this block (the
        thread's error count moved) and for this chunk size; any other exception passes through
        unchanged."""
        if not chunk:
            yield
            return
        before = lib.tms_error_count()
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, TorchMemorySaverError):
                raise
            msg = lib.last_error()
            m = _CHUNK_MISFIT.search(msg)
            if lib.tms_error_count() == before or m is None or int(m.group(1)) != chunk:
                raise
            raise InvalidArgumentError(
                f"{msg} (inside a region with chunk_size={chunk}, allocate only tensors whose size in bytes "
                "is a multiple of it)",
                3,
            ) from e

    def _pool(
        self, kind: str, tag: str, cpu: bool, disk: bool, backend: Optional[str], device: int, chunk: int = 0
    ) -> Any:
        """The MemPool of a region (``kind="region"``, in ``_mem_pools``) or a graph capture (in
        ``_graph_pools``) for (tag, CPU backup, disk backup, resolved backend, device, chunk
        size), made on first use, so that cached blocks never cross backup settings or chunk
        layouts. Its allocator is the hook mode's: libtms.so in torch mode; PyTorch's own
        (cudaMalloc, which the preloaded library serves while the region's flags are on) in
        preload mode."""
        import torch

        resolved = resolve_cpu_backup_backend(cpu, backend) or ""  # "" without a CPU backup, as upstream keys it
        key = (tag, cpu, disk, resolved, device) + ((chunk,) if chunk else ())
        pools = self._mem_pools if kind == "region" else self._graph_pools
        with self._lock:
            pool = pools.get(key)
            if pool is None:
                pool = self._new_pool(torch)
                pools[key] = pool
            return pool

    def _own_pool(self, pool: Any) -> bool:
        """Whether ``pool`` (a ``MemPool`` or its ``id``) is one of the region or graph pools."""
        with self._lock:
            for p in (*dict.values(self._mem_pools), *dict.values(self._graph_pools)):
                if pool is p or pool == getattr(p, "id", None):
                    return True
        return False

    def _new_pool(self, torch: Any) -> Any:
        """A MemPool whose allocator is the hook mode's."""
        allocator = self._hook_util.get_allocator()
        if allocator is None:
            return torch.cuda.MemPool()
        # A hook written to return the ``CUDAPluggableAllocator`` itself works too.
        raw = getattr(allocator, "allocator", None)
        return torch.cuda.MemPool(raw() if callable(raw) else allocator)

    def _routed(self, torch: Any, pool: Any = None, make: Any = None) -> "routing._Routed":
        """Route this thread's allocations to ``pool`` inside the block. Routes nest: the
        innermost one wins, the enclosing one is suspended meanwhile and restarted after (so
        which pool serves does not depend on how PyTorch orders nested ``use_mem_pool``).
        ``pool=None``: a pool of PyTorch's own allocator for this block alone, dropped on exit
        before the enclosing route restarts, so that its cache can go back to the device; one
        such pool retired and not yet destroyed (another thread routes) serves the next such
        block on its device instead of a new one (``_Routing.take_spare``).
        ``make()`` makes a sibling of ``pool`` for a thread that finds ``pool`` routed to by
        another thread (PyTorch routes one thread at a time to a pool). On exit the pool goes
        to ``_Routing.retire`` (``routing.py``): a caller keeps no reference of its own past
        the block, or the pool's end may come with that one, while another thread routes."""
        return routing._Routed(self._local, torch, pool, make)

    @contextlib.contextmanager
    def region(
        self,
        tag: str = "default",
        enable_cpu_backup: Any = False,
        enable_disk_backup: Any = False,
        cpu_backup_backend: Optional[str] = None,
        *,
        chunk_size: Any = 0,
    ) -> Iterator[None]:
        """See ``TorchMemorySaver.region``."""
        tag = _check_tag(tag)
        enable_cpu_backup = bool(enable_cpu_backup)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        disk = _check_disk(enable_cpu_backup, enable_disk_backup)
        chunk = _check_chunk_size(chunk_size)
        lib = self._library()
        torch = _torch_if_cuda() if self.hook_mode == "preload" else _require_torch()
        if torch is None:
            # Preload mode without torch (C extensions calling cudaMalloc): the flags suffice.
            with self._flags(lib, True, tag, enable_cpu_backup, backend, disk, chunk), self._chunk_misfits(lib, chunk):
                yield
            return
        # Each region's tensors live in a pool of their own, so PyTorch never hands a pauseable
        # block to a tensor made outside the region, nor a plain cached block to one inside it,
        # nor a block of one chunk layout to another. The pool is taken once the flags are on,
        # and the route holds it alone from there: nothing between may raise and end it here,
        # where the map dropped it meanwhile, under another thread's route (see _routed). The
        # device is asked before, as ever (it may initialize CUDA, which the flags need not see).
        device = torch.cuda.current_device()
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk, chunk):
            pool = self._pool("region", tag, enable_cpu_backup, disk, backend, device, chunk)
            routed = self._routed(torch, pool, lambda: self._new_pool(torch))
            del pool
            with routed, self._chunk_misfits(lib, chunk):
                yield

    @contextlib.contextmanager
    def disable(self, dispose_mem_pool_after_use: bool = True) -> Iterator[None]:
        """See ``TorchMemorySaver.disable``. ``dispose_mem_pool_after_use=False`` (the existing
        library's keyword) keeps the block's pool, with what it cached, for the next such
        block on the device instead of dropping it on exit."""
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
        # device (on torch 2.11 at once), while blocks of tensors still alive stay theirs. While
        # a route or capture is under way anywhere it waits, and serves the next such block of
        # the device meanwhile (see _Routing).
        kept = None
        if not dispose_mem_pool_after_use:
            device = torch.cuda.current_device()
            with self._lock:
                kept = self._kept_disable_pools.get(device)
                if kept is None:
                    kept = self._kept_disable_pools[device] = torch.cuda.MemPool()
        routed = self._routed(torch, kept, torch.cuda.MemPool if kept is not None else None)
        del kept  # the route's alone (see _routed)
        with self._flags(lib, False, None, False, None):
            with routed:
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
        chunk_size: Any = 0,
    ) -> Iterator[None]:
        """See ``TorchMemorySaver.cuda_graph``."""
        import torch

        routing._count_captures(torch)
        tag = _check_tag(tag)
        enable_cpu_backup = bool(enable_cpu_backup)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        disk = _check_disk(enable_cpu_backup, enable_disk_backup)
        chunk = _check_chunk_size(chunk_size)
        lib = self._library()
        if self.hook_mode == "torch" and pool is None:
            device = torch.cuda.current_device()
            pool = self._pool("graph", tag, enable_cpu_backup, disk, backend, device, chunk).id
        elif self.hook_mode == "torch" and not self._own_pool(pool):
            warnings.warn(
                f"torch mode: the pool given to cuda_graph(tag={tag!r}) is not one of "
                "torch_memory_saver's, so the graph's memory comes from PyTorch's own allocator and "
                "is not pauseable; pass pool=None (the tag's graph pool is made) or a region's pool",
                stacklevel=3,
            )
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk, chunk):
            routing._routing.enter()  # a capture: no pool is destroyed meanwhile (see _Routing)
            try:
                with self._capturing(torch), self._chunk_misfits(lib, chunk), torch.cuda.graph(
                    cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
                ):
                    yield
            finally:
                routing._routing.leave(torch)

    @contextlib.contextmanager
    def _capturing(self, torch: Any) -> Iterator[None]:
        """Suspend this thread's route (an enclosing region's) for a graph capture. PyTorch
        serves an allocation from the first pool routed to whose filter takes it, and a
        region's route (``use_mem_pool``) takes every allocation of its thread, the capture's
        too: inside ``region()`` the capture would allocate from the region's pool, not the
        graph's private one. Cached blocks of the region (its tag) could then serve the graph,
        and blocks the graph frees while capturing would go back to the region's pool, where a
        later allocation of the region on the capture's stream could get one the graph still
        replays into. A route a region opens inside the capture nests as usual, and the
        capture's place on the stack restarts nothing."""
        place = routing._Capture()  # its own: routing._unlink finds it by identity
        stack = routing._push(self._local, torch, place)
        try:
            yield
        finally:
            if routing._unlink(self._local, stack, place):
                routing._restart_top(self._local, stack, torch)
