"""The implementation behind ``torch_memory_saver.entrypoint.TorchMemorySaver``: regions,
pause/resume, CUDA graphs, ``disable()``, CPU backups, statistics."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import operator
import os
import re
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

from .binary_wrapper import BinaryWrapper
from .errors import (
    InternalError,
    InvalidArgumentError,
    InvalidStateError,
    LibraryNotFoundError,
    NotFoundError,
    TorchMemorySaverError,
    UnsupportedError,
    error_for_status,
)
from .hooks import HookUtilBase

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["_TorchMemorySaverImpl"]

logger = logging.getLogger("torch_memory_saver")

BACKENDS = ("pinned", "mmap")


class _JobRecord:
    """``save_chunk_state`` / ``restore_chunk_state`` value of job-wide operations
    (``distributed``): their own record of chunk states, for their undo, so that they never
    replace the program's (``pause(tag, save_chunk_state=True)``)."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "JOB_RECORD"


JOB_RECORD = _JobRecord()


def _record(flag: Any) -> int:
    """The C ABI's value for a record: 2 the job's, 1 the program's."""
    return 2 if flag is JOB_RECORD else 1


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


def _platform() -> tuple:
    """``(xpu, rocm)``, read at call time: ``entrypoint.is_xpu`` (a module name integrations
    patch) and the ``torch.version.hip`` of the torch in use."""
    from . import entrypoint

    torch = sys.modules.get("torch")
    return bool(entrypoint.is_xpu()), bool(getattr(getattr(torch, "version", None), "hip", None))


def resolve_cpu_backup_backend(enable_cpu_backup: Any, backend: Any) -> Optional[str]:
    """The host memory a region's CPU backups go to: ``backend`` where given (``"pinned"`` or
    ``"mmap"``; refused without ``enable_cpu_backup``, and ``"mmap"`` on ROCm/XPU), else
    ``TMS_INIT_CPU_BACKUP_BACKEND``, else ``"pinned"``; None without a CPU backup. Errors are
    :class:`InvalidArgumentError` (a ``ValueError``) in the existing library's words."""
    if backend is not None:
        if backend not in BACKENDS:
            raise InvalidArgumentError(f'cpu_backup_backend must be "mmap" or "pinned", not {backend!r}')
        if not enable_cpu_backup:
            raise InvalidArgumentError(
                f"cpu_backup_backend={backend!r} requires enable_cpu_backup=True (there is no backup to put in it)"
            )
        if backend == "mmap" and any(_platform()):
            raise InvalidArgumentError(
                "cpu_backup_backend='mmap' is not supported on ROCm/XPU (pageable backups need CUDA); use 'pinned'"
            )
        return backend
    if not enable_cpu_backup:
        return None
    env = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND", "").strip()
    if not env:
        return "pinned"
    if env not in BACKENDS:
        raise InvalidArgumentError(f'environment variable TMS_INIT_CPU_BACKUP_BACKEND must be "mmap" or "pinned", not {env!r}')
    return env


def _check_backup(enable_cpu_backup: Any, backend: Any) -> Optional[str]:
    """A region's explicit backend, checked (None where not given: the library's default)."""
    if backend is not None and _platform()[0]:
        raise InvalidArgumentError(
            "cpu_backup_backend is not supported on XPU (torch_memory_saver works on CUDA devices)"
        )
    resolve_cpu_backup_backend(enable_cpu_backup, backend)
    return backend


def _check_disk(enable_cpu_backup: bool, enable_disk_backup: Any) -> bool:
    disk = bool(enable_disk_backup)
    if disk and enable_cpu_backup:
        raise InvalidArgumentError(
            "enable_cpu_backup and enable_disk_backup are mutually exclusive (a paused tensor keeps its "
            "contents in one place)"
        )
    return disk


_U64_MAX = (1 << 64) - 1

# The library's message for an allocation whose size is not a multiple of its region's chunk size.
_CHUNK_MISFIT = re.compile(r"chunk size (\d+) bytes: the size \((\d+) bytes\) must be a multiple of it")


def _int(what: str, v: Any) -> int:
    """``v`` as an int (anything with ``__index__`` but a bool), else TypeError naming ``what``."""
    if isinstance(v, bool):
        raise TypeError(f"{what} must be an int, not bool ({v!r})")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(v).__name__} ({v!r})") from None


def _check_chunk_size(chunk_size: Any) -> int:
    """A region's chunk size in bytes (None: 0, not chunked). Whether it is a multiple of the
    device's granularity is the library's to say (it knows the granularity)."""
    if chunk_size is None:
        return 0
    try:
        n = _int("chunk_size", chunk_size)
    except TypeError as e:
        raise InvalidArgumentError(f"{e} (bytes, a multiple of the device's allocation granularity)") from None
    if n < 0 or n > _U64_MAX:
        raise InvalidArgumentError(
            f"chunk_size must be 0 (not chunked) or a positive multiple of the device's allocation "
            f"granularity, not {n}"
        )
    return n


def _check_indices(indices: Any) -> list:
    """Chunk indices: any iterable of ints >= 0."""
    if isinstance(indices, (str, bytes)):
        raise TypeError(f"chunk indices must be an iterable of ints, not {type(indices).__name__}")
    try:
        it = iter(indices)
    except TypeError:
        raise TypeError(f"chunk indices must be an iterable of ints, not {type(indices).__name__}") from None
    out = []
    for i in it:
        v = _int("a chunk index", i)
        if v < 0 or v > _U64_MAX:
            raise InvalidArgumentError(f"chunk index {v} is out of range (indices count from 0)")
        out.append(v)
    return out


def _one_of(fn: str, what: str, name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """The argument given as ``name`` (ours, positional) or as keyword ``alias`` (the existing
    library's name): exactly one of them, else a TypeError saying so."""
    if value is not None and alias_value is not None:
        raise TypeError(f"{fn}() got {what} twice: as {name} and as {alias}=; pass one")
    if value is None and alias_value is None:
        raise TypeError(f"{fn}() needs {what}: {name} (or {alias}=)")
    return value if value is not None else alias_value


def chunk_target(fn: str, tag_or_tensor: Any, tag: Any) -> Any:
    """The tag or tensor of a chunk call, given positionally (or as ``tag_or_tensor=``) or as
    ``tag=`` (the existing library's keyword)."""
    return _one_of(fn, "a tag or tensor", "tag_or_tensor", tag_or_tensor, "tag", tag)


def chunk_arguments(fn: str, tag_or_tensor: Any, indices: Any, tag: Any, chunk_indices: Any) -> tuple:
    """``(target, indices)`` of ``pause_chunks``/``resume_chunks``, each given under our name or
    the existing library's (``tag=``, ``chunk_indices=``)."""
    return (
        chunk_target(fn, tag_or_tensor, tag),
        _one_of(fn, "the chunk indices", "indices", indices, "chunk_indices", chunk_indices),
    )


def _address(x: Any) -> int:
    """The device address of a tensor (``x.data_ptr()``)."""
    data_ptr = getattr(x, "data_ptr", None)
    if isinstance(x, (bytes, type)) or not callable(data_ptr):
        raise TypeError(f"expected a tag (str) or a torch.Tensor, not {type(x).__name__}")
    return int(data_ptr())


def _tensor_or_address(x: Any) -> int:
    """A tensor, or a device address (an entry of ``order=``, the target of ``wait``)."""
    if isinstance(x, int) and not isinstance(x, bool):
        if not 0 < x <= _U64_MAX:
            raise InvalidArgumentError(f"device address {x} is out of range")
        return x
    return _address(x)


def _iterable(what: str, x: Any) -> list:
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{what} must be an iterable of tensors, not {type(x).__name__}")
    try:
        return list(x)
    except TypeError:
        raise TypeError(f"{what} must be an iterable of tensors, not {type(x).__name__}") from None


def _stream_handle(stream: Any) -> tuple:
    """(device, CUstream) of a ``torch.cuda.Stream``."""
    handle = getattr(stream, "cuda_stream", None)
    device = getattr(stream, "device", None)
    if not isinstance(handle, int) or device is None:
        raise TypeError(f"stream must be a torch.cuda.Stream (or True: the current one), not {type(stream).__name__}")
    index = device.index if device.index is not None else 0
    return index, handle


def _current_stream() -> tuple:
    """(device, CUstream) of the calling thread's current CUDA stream; (-1, 0) without CUDA."""
    torch = _torch_if_cuda()
    if torch is None:
        return -1, 0
    return _stream_handle(torch.cuda.current_stream())


def _tensor_bytes(t: Any) -> int:
    """The bytes a contiguous tensor spans from its ``data_ptr()``."""
    if not t.is_contiguous():
        raise InvalidArgumentError("a byte range of a tensor needs a contiguous tensor")
    return t.numel() * t.element_size()


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
        # PyTorch lets one thread at a time route to a pool ("beginAllocateToPool: already
        # recording to mempool_id"), so a region entered by a second thread while the first is
        # inside it gets a sibling pool of the same kind. busy: id(pool) -> the thread routing
        # to it; siblings: id(pool) -> (the pool, its siblings), kept while the pool lives
        # (only pools that ever needed one are listed, so a dropped pool still goes).
        self.busy: dict = {}
        self.siblings: dict = {}

    def claim(self, pool: Any, make: Any) -> Any:
        """A pool of ``pool``'s kind that no other thread routes to now (``pool`` itself when
        free; else a sibling, made with ``make()`` where all are busy), marked as this
        thread's."""
        me = threading.get_ident()
        with self.lock:
            if self.busy.get(id(pool), me) == me or make is None:
                self.busy[id(pool)] = me
                return pool
            _, sibs = self.siblings.setdefault(id(pool), (pool, []))
            for sib in sibs:
                if self.busy.get(id(sib), me) == me:
                    self.busy[id(sib)] = me
                    return sib
        sib = make()
        with self.lock:
            sibs.append(sib)
            self.busy[id(sib)] = me
        return sib

    def release(self, pool: Any) -> None:
        with self.lock:
            self.busy.pop(id(pool), None)

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

    def __init__(self, pool: Any, make: Any = None) -> None:
        self.pool = pool
        self.make = make
        self.ctx: Any = None
        self.using: Any = None

    def start(self, torch: Any) -> None:
        using = _routing.claim(self.pool, self.make)
        try:
            ctx = torch.cuda.use_mem_pool(using)
            ctx.__enter__()
        except BaseException:
            _routing.release(using)
            raise
        self.ctx, self.using = ctx, using
        _routing.enter()

    def stop(self, torch: Any) -> None:
        ctx, self.ctx = self.ctx, None
        using, self.using = self.using, None
        if ctx is not None:
            try:
                ctx.__exit__(None, None, None)
            finally:
                _routing.release(using)
                _routing.leave(torch)


def _human(n: int) -> str:
    """``1.50 GiB``-style bytes, as the library and tmsctl write them."""
    v, unit = float(n), "B"
    for u in ("KiB", "MiB", "GiB", "TiB"):
        if v < 1024:
            break
        v, unit = v / 1024, u
    return f"{n} B" if unit == "B" else f"{v:.2f} {unit}"


# What the bytes of a phase went through, in words (as tmsctl shows them).
_MOVED = {
    "copying_to_host": "copied to host memory",
    "writing_to_disk": "written to disk",
    "reading_from_disk": "read from disk",
    "copying_to_device": "copied from host memory",
}


class _Watch:
    """Progress of one pause or resume of this thread, while the C call runs (ctypes lets the
    GIL go for it, so a helper thread can poll ``tms_get_progress``).

    ``progress(done, total, phase)`` is called from the helper thread about every
    ``PROGRESS_EVERY`` seconds while the operation runs, and once more with phase ``"done"``
    and the operation's true totals (bytes copied to or from backups) after it has succeeded.
    ``phase`` is the library's (``"preparing"``, ``"synchronizing"``, ``"copying_to_host"``,
    ``"writing_to_disk"``, ``"reading_from_disk"``, ``"copying_to_device"``, ``"mapping"``,
    ``"releasing"``), or ``"waiting"`` while another pause or resume runs first.

    What a callback may do: anything that returns. Calls come one at a time, ``"done"`` last;
    none comes after the operation's call has returned but that ``"done"``. A callback that
    blocks does not hold the pause up: when the operation ends during such a call, the pause
    returns at once and ``"done"`` follows from the helper thread when the callback returns.
    Whatever a callback raises (``KeyboardInterrupt`` and ``SystemExit`` included) is logged,
    ends its calls, and never changes the operation's outcome.

    Operations that last longer than ``LOG_AFTER`` seconds are logged at INFO every
    ``LOG_EVERY`` seconds. No helper thread is started when nobody would see what it finds (no
    callback, INFO not enabled)."""

    PROGRESS_EVERY = 0.5
    LOG_AFTER = 2.0
    LOG_EVERY = 5.0

    def __init__(self, lib: BinaryWrapper, what: str, progress: Any) -> None:
        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be a callable (done, total, phase), not {type(progress).__name__}")
        self.lib = lib
        self.what = what
        self.progress = progress
        self.failed = False
        self.stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.me = threading.get_native_id()
        # Guards `in_call` and `final` against the helper thread.
        self.lock = threading.Lock()
        self.in_call = False
        self.final: Optional[tuple] = None

    def __enter__(self) -> "_Watch":
        if self.progress is not None or logger.isEnabledFor(logging.INFO):
            self.thread = threading.Thread(target=self._run, name="torch_memory_saver-progress", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        final = None
        if exc_type is None and self.progress is not None:
            p = self.lib.last_progress()
            total = p.bytes_total if p is not None else 0
            final = (total, total, "done")
        with self.lock:
            self.stop.set()
            busy = self.in_call
            if busy:
                # Delivered by the helper thread once the callback it is in returns.
                self.final = final
        if final is not None and not busy:
            self._call(*final)

    def _call(self, done: int, total: int, phase: str) -> None:
        if self.failed:
            return
        try:
            self.progress(done, total, phase)
        except BaseException:  # noqa: BLE001 - a callback never changes the operation's outcome
            # Said once, then left alone (KeyboardInterrupt and SystemExit too: the pause
            # they would escape has done its work; see the class's docstring).
            self.failed = True
            logger.exception("the progress callback of the %s raised; it is not called again", self.what)

    def _run(self) -> None:
        t0 = time.monotonic()
        next_log = t0 + self.LOG_AFTER
        while not self.stop.wait(self.PROGRESS_EVERY):
            try:
                p = self.lib.progress()
            except TorchMemorySaverError:
                return
            if p is None:
                continue  # not started yet, or ended
            mine = p.thread_id == self.me
            phase = p.phase.decode("ascii", "replace") if mine else "waiting"
            done, total = (p.bytes_done, p.bytes_total) if mine else (0, 0)
            if self.progress is not None:
                with self.lock:
                    if self.stop.is_set():
                        return
                    self.in_call = True
                self._call(done, total, phase)
                with self.lock:
                    self.in_call = False
                    final, self.final = self.final, None
                if final is not None:
                    self._call(*final)
                    return
            now = time.monotonic()
            if now >= next_log and logger.isEnabledFor(logging.INFO):
                next_log = now + self.LOG_EVERY
                logger.info("%s: %s (%.0f s)", self.what, self._words(p, mine, phase), now - t0)

    @staticmethod
    def _words(p: Any, mine: bool, phase: str) -> str:
        if not mine:
            return "waiting for another pause or resume to end"
        moved = _MOVED.get(phase)
        if moved is None or not p.bytes_total:
            return phase.replace("_", " ")
        s = f"{_human(p.bytes_done)} of {_human(p.bytes_total)} {moved}"
        if p.copy_seconds > 0:
            s += f", {_human(int(p.bytes_done / p.copy_seconds))}/s"
        return s


class _PoolMap(dict):
    """Region (or graph) pools by ``(tag, enable_cpu_backup, enable_disk_backup, backend,
    device)``, plus the chunk size where chunked; ``backend`` is ``""`` without a CPU backup, as
    the existing library keys it. A key of the shape an earlier version of the existing library
    used names every pool it covers, for the callers written against it: ``(tag,
    enable_cpu_backup)`` (0.0.9), ``(tag, enable_cpu_backup, device)`` and ``(tag,
    enable_cpu_backup, enable_disk_backup, device)``. ``in``, ``get``, ``[]``, ``pop`` and
    ``del`` take them: ``pop`` and ``del`` drop every pool covered (so the next region of the tag
    gets a new pool, never a cached block of the old one); ``get``, ``[]`` and ``pop`` give the
    pool where one is covered, a list of them where several are."""

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
            if default is self._NO_DEFAULT:
                return dict.pop(self, key)
            return dict.pop(self, key, default)
        return self._one_or_all([dict.pop(self, k) for k in covered])


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
        # Region pools keyed as the existing library's callers expect (see _PoolMap). Popping
        # one drops it (its blocks go back to the device once its tensors are gone).
        self._mem_pools: _PoolMap = _PoolMap()
        self._graph_pools: _PoolMap = _PoolMap()
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
            if self._in_use():
                raise InvalidStateError(
                    f"hook_mode is already {self.hook_mode!r} and in use; set it before the first region or pause"
                )
            self._hook_util = new

    def _in_use(self) -> bool:
        """Whether the library was loaded or a pool made: the hook mode is fixed from then on."""
        return self._lib is not None or bool(self._mem_pools) or bool(self._graph_pools)

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
        """True, with no side effect, as the existing library's attribute of this name is (see
        :attr:`available`)."""
        return True

    @property
    def available(self) -> bool:
        """Whether the library can work in this process in the current hook mode, without
        loading it: preloaded (preload mode), or its file found (torch mode)."""
        if self._lib is not None:
            return True
        try:
            return self._hook_util.get_path_binary() is not None
        except LibraryNotFoundError:
            return False

    @property
    def _hook_mode(self) -> str:
        """The existing library's name of :attr:`hook_mode`."""
        return self.hook_mode

    @property
    def _is_xpu(self) -> bool:
        """Whether the accelerator is an Intel XPU (``entrypoint.is_xpu``, read now)."""
        return _platform()[0]

    @property
    def _device_module(self) -> Any:
        """``torch.xpu`` on an Intel XPU, else ``torch.cuda``."""
        import torch

        return torch.xpu if self._is_xpu else torch.cuda

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
        if n < 0 or n > _U64_MAX:
            raise InvalidArgumentError(f"memory_margin_bytes must be from 0 to 2**64 - 1 bytes, not {n}")
        lib = self._library()
        lib.check(lib.tms_set_memory_margin(n))

    def set_disk_backup_dir(self, path: Any) -> None:
        """See ``TorchMemorySaver.set_disk_backup_dir``."""
        if path is not None and not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
        raw = None if path is None else os.fsencode(path)
        if raw is not None and b"\0" in raw:
            raise InvalidArgumentError(f"path {path!r} contains a NUL byte (a C string would cut it there)")
        lib = self._library()
        lib.check(lib.tms_set_disk_backup_dir(raw))

    # ---------------------------------------------------------------- residency and devices

    def keep_resident(self, tensor: Any) -> int:
        """See ``TorchMemorySaver.keep_resident``."""
        numel = getattr(tensor, "numel", None)
        if not callable(numel):
            raise TypeError(f"expected a torch.Tensor, not {type(tensor).__name__}")
        if numel() == 0:
            return 0
        addr = _address(tensor)
        lib = self._library()
        size = ctypes.c_uint64(0)
        lib.check(lib.tms_keep_resident_ex(addr, ctypes.byref(size)))
        if size.value:
            logger.info("keeping the allocation holding %#x resident (%d bytes)", addr, size.value)
        return size.value

    def _affected_devices(self, tag: Optional[str]) -> list:
        """The devices a pause or resume of ``tag`` (every tag if None) acts on, ascending.
        Uses only ``self._binary_wrapper.cdll`` (one call), as the existing library's does."""
        capacity = 64
        out = (ctypes.c_int * capacity)()
        name = None if tag is None else (tag.encode("utf-8") if isinstance(tag, str) else tag)
        wrapper = self._binary_wrapper
        n = wrapper.cdll.tms_affected_devices(name, out, capacity)
        if n < 0:
            last = getattr(wrapper, "last_error", None)
            raise InternalError(last() if callable(last) else "tms_affected_devices failed")
        if n > capacity:
            # The existing library's check, as its callers expect it (not a bare assert: it holds
            # under python -O too).
            raise AssertionError(f"Too many affected devices: {n} (at most {capacity})")
        return list(out[:n])

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

    def _new_pool(self, torch: Any) -> Any:
        """A MemPool whose allocator is the hook mode's."""
        allocator = self._hook_util.get_allocator()
        return torch.cuda.MemPool(allocator.allocator()) if allocator is not None else torch.cuda.MemPool()

    @contextlib.contextmanager
    def _routed(self, torch: Any, pool: Any = None, make: Any = None) -> Iterator[None]:
        """Route this thread's allocations to ``pool`` inside the block. Routes nest: the
        innermost one wins, the enclosing one is suspended meanwhile and restarted after (so
        which pool serves does not depend on how PyTorch orders nested ``use_mem_pool``).
        ``pool=None``: a pool of PyTorch's own allocator for this block alone, dropped on exit
        before the enclosing route restarts, so that its cache can go back to the device.
        ``make()`` makes a sibling of ``pool`` for a thread that finds ``pool`` routed to by
        another thread (PyTorch routes one thread at a time to a pool)."""
        stack = getattr(self._local, "routes", None)
        if stack is None:
            stack = self._local.routes = []
        retire = pool is None
        route = _Route(torch.cuda.MemPool() if retire else pool, make)
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
        # nor a block of one chunk layout to another.
        pool = self._pool("region", tag, enable_cpu_backup, disk, backend, torch.cuda.current_device(), chunk)
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk, chunk):
            with self._routed(torch, pool, lambda: self._new_pool(torch)), self._chunk_misfits(lib, chunk):
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
        chunk_size: Any = 0,
    ) -> Iterator[None]:
        """See ``TorchMemorySaver.cuda_graph``."""
        import torch

        tag = _check_tag(tag)
        enable_cpu_backup = bool(enable_cpu_backup)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        disk = _check_disk(enable_cpu_backup, enable_disk_backup)
        chunk = _check_chunk_size(chunk_size)
        lib = self._library()
        if self.hook_mode == "torch" and pool is None:
            device = torch.cuda.current_device()
            pool = self._pool("graph", tag, enable_cpu_backup, disk, backend, device, chunk).id
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk, chunk):
            _routing.enter()  # a capture: no pool may be destroyed meanwhile (see _Routing)
            try:
                with self._chunk_misfits(lib, chunk), torch.cuda.graph(
                    cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
                ):
                    yield
            finally:
                _routing.leave(torch)

    # ---------------------------------------------------------------- pause / resume

    def pause(self, tag: Optional[str] = None, save_chunk_state: Any = False, *, progress: Any = None) -> None:
        """Give back the device memory of ``tag`` (every tag if None), backing up contents where
        the region asked for it. Pausing what is paused does nothing. See
        ``TorchMemorySaver.pause`` for ``save_chunk_state`` and ``progress``."""
        tag = _check_tag(tag, optional=True)
        lib = self._library()
        what = "all tags" if tag is None else f"tag {tag!r}"
        t0 = time.perf_counter()
        with _Watch(lib, f"pause of {what}", progress):
            if save_chunk_state:
                lib.check(lib.tms_pause_ex(_enc(tag), _record(save_chunk_state)))
            else:
                lib.check(lib.tms_pause(_enc(tag)))
        logger.info("paused %s in %.3f s", what, time.perf_counter() - t0)

    def resume(
        self,
        tag: Optional[str] = None,
        restore_chunk_state: Any = False,
        *,
        progress: Any = None,
        non_blocking: Any = False,
        order: Any = None,
    ) -> None:
        """Take device memory back for ``tag`` (every tag if None), at the same addresses, and
        restore backups. On out of memory raises :class:`OutOfMemoryError` and the tag stays
        paused with its backups: free memory and call again. See ``TorchMemorySaver.resume``
        for ``restore_chunk_state``, ``progress``, ``non_blocking`` and ``order``."""
        tag = _check_tag(tag, optional=True)
        if non_blocking or order is not None:
            return self._resume_nonblocking(tag, restore_chunk_state, progress, non_blocking, order)
        lib = self._library()
        what = "all tags" if tag is None else f"tag {tag!r}"
        t0 = time.perf_counter()
        with _Watch(lib, f"resume of {what}", progress):
            if restore_chunk_state:
                lib.check(lib.tms_resume_ex(_enc(tag), _record(restore_chunk_state)))
            else:
                lib.check(lib.tms_resume(_enc(tag)))
        logger.info("resumed %s in %.3f s", what, time.perf_counter() - t0)

    def _resume_nonblocking(self, tag: Optional[str], restore_chunk_state: Any, progress: Any,
                            non_blocking: Any, order: Any) -> None:
        if not non_blocking:
            raise InvalidArgumentError("order= is for resume(..., non_blocking=True)")
        if restore_chunk_state:
            raise InvalidArgumentError("non_blocking=True resumes whole tags: restore_chunk_state is not supported with it")
        if progress is not None:
            raise InvalidArgumentError("non_blocking=True returns at once: use wait() instead of progress=")
        addrs = [] if order is None else [_tensor_or_address(x) for x in _iterable("order", order)]
        device, handle = _current_stream()
        lib = self._library()
        what = "all tags" if tag is None else f"tag {tag!r}"
        pending = ctypes.c_uint64(0)
        arr = (ctypes.c_uint64 * len(addrs))(*addrs) if addrs else None
        t0 = time.perf_counter()
        lib.check(lib.tms_resume_nonblocking(_enc(tag), device, handle, arr, len(addrs), ctypes.byref(pending)))
        logger.info("resuming %s: mapped in %.3f s, %d bytes still being restored", what,
                    time.perf_counter() - t0, pending.value)

    def wait(self, tensor: Any = None, *, stream: Any = None, timeout: Any = None) -> bool:
        """See ``TorchMemorySaver.wait``."""
        addr = 0 if tensor is None else _tensor_or_address(tensor)
        lib = self._library()
        if stream is not None and stream is not False:
            if timeout is not None:
                raise InvalidArgumentError("wait(stream=...) does not block: timeout= is for a host wait")
            device, handle = _current_stream() if stream is True else _stream_handle(stream)
            if device < 0:
                raise UnsupportedError("wait(stream=...) needs PyTorch with CUDA")
            lib.check(lib.tms_stream_wait_restored(addr, device, handle))
            return True
        if timeout is None:
            ms = -1
        else:
            t = float(timeout)
            if not t >= 0:
                raise InvalidArgumentError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
            ms = int(t * 1000)
        done = ctypes.c_int(0)
        lib.check(lib.tms_wait_restored(addr, ms, ctypes.byref(done)))
        return bool(done.value)

    # ---------------------------------------------------------------- chunked allocations

    def _chunks(self, target: Any, indices: Any, pause: bool) -> None:
        if isinstance(target, str):
            tag = _check_tag(target)
            idx = _check_indices(indices)
            lib = self._library()
            fn = lib.tms_pause_chunks if pause else lib.tms_resume_chunks
            try:
                lib.check(fn(_enc(tag), (ctypes.c_size_t * len(idx))(*idx), len(idx)))
            except NotFoundError:
                if self._tag_has_allocations(tag):
                    raise
                # The existing library's answer for a tag without any allocation: nothing to do.
                logger.debug("tag %r has no allocation: no chunks to %s", tag, "pause" if pause else "resume")
                return
            what = f"tag {tag!r}"
        else:
            addr = _address(target)
            idx = _check_indices(indices)
            lib = self._library()
            lib.check(lib.tms_chunks_at(addr, int(pause), (ctypes.c_uint64 * len(idx))(*idx), len(idx)))
            what = f"the allocation at {addr:#x}"
        logger.info("%s %d chunks of %s", "paused" if pause else "resumed", len(idx), what)

    def _tag_has_allocations(self, tag: str) -> bool:
        """Whether ``tag`` holds any pauseable allocation now (chunked or not)."""
        return any(t["tag"] == tag and t["allocations"] for t in self.stats()["tags"])

    def pause_chunks(
        self,
        tag_or_tensor: Any = None,
        indices: Optional[Iterable[int]] = None,
        *,
        tag: Any = None,
        chunk_indices: Optional[Iterable[int]] = None,
    ) -> None:
        """See ``TorchMemorySaver.pause_chunks``."""
        target, idx = chunk_arguments("pause_chunks", tag_or_tensor, indices, tag, chunk_indices)
        self._chunks(target, idx, True)

    def resume_chunks(
        self,
        tag_or_tensor: Any = None,
        indices: Optional[Iterable[int]] = None,
        *,
        tag: Any = None,
        chunk_indices: Optional[Iterable[int]] = None,
    ) -> None:
        """See ``TorchMemorySaver.resume_chunks``."""
        target, idx = chunk_arguments("resume_chunks", tag_or_tensor, indices, tag, chunk_indices)
        self._chunks(target, idx, False)

    def _range(self, tensor: Any, start: Any, end: Any, pause: bool) -> range:
        addr = _address(tensor)
        start, end = _int("start", start), _int("end", end)
        nbytes = _tensor_bytes(tensor)
        if not 0 <= start <= end <= nbytes:
            raise InvalidArgumentError(
                f"byte range [{start}, {end}) is not inside the tensor's {nbytes} bytes "
                f"(0 <= start <= end <= {nbytes})"
            )
        lib = self._library()
        if start == end:
            lib.check(lib.tms_chunks_of(addr, None, None, None))  # still refuses a non-chunked tensor
            return range(0)
        first, count = ctypes.c_uint64(0), ctypes.c_uint64(0)
        lib.check(lib.tms_range(addr + start, end - start, int(pause), ctypes.byref(first), ctypes.byref(count)))
        done = range(first.value, first.value + count.value)
        logger.info("%s chunks %s of the allocation holding %#x", "paused" if pause else "resumed", done, addr)
        return done

    def pause_range(self, tensor: Any, start: int, end: int) -> range:
        """See ``TorchMemorySaver.pause_range``."""
        return self._range(tensor, start, end, True)

    def resume_range(self, tensor: Any, start: int, end: int) -> range:
        """See ``TorchMemorySaver.resume_range``."""
        return self._range(tensor, start, end, False)

    def _tag_failure(self, lib: BinaryWrapper, tag: bytes) -> TorchMemorySaverError:
        """The error of a failed by-tag chunk query that reports no status: its message, and the
        status of the same lookup through ``tms_get_chunk_layout`` (which fails the same way)."""
        msg = lib.last_error()
        status = lib.tms_get_chunk_layout(tag, None, None, 0)
        return error_for_status(status, msg) if status else InternalError(msg or "chunk query failed")

    def _chunks_of(self, lib: BinaryWrapper, addr: int) -> tuple:
        start, chunk, count = ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(0)
        lib.check(lib.tms_chunks_of(addr, ctypes.byref(start), ctypes.byref(chunk), ctypes.byref(count)))
        return start.value, chunk.value, count.value

    def _tag_count(self, lib: BinaryWrapper, tag: bytes) -> int:
        """The chunk count of the tag's chunked allocation; 0 where the tag has no allocation
        at all (the existing library's answer), an error where it has only unchunked ones."""
        n = lib.tms_get_num_chunks_for_tag(tag)
        if not n:
            err = self._tag_failure(lib, tag)
            if isinstance(err, NotFoundError) and not self._tag_has_allocations(tag.decode("utf-8")):
                return 0
            raise err
        return n

    def get_num_chunks(self, tag_or_tensor: Any = None, *, tag: Any = None) -> int:
        """See ``TorchMemorySaver.get_num_chunks``."""
        tag_or_tensor = chunk_target("get_num_chunks", tag_or_tensor, tag)
        lib = self._library()
        if isinstance(tag_or_tensor, str):
            return self._tag_count(lib, _enc(_check_tag(tag_or_tensor)))
        return self._chunks_of(lib, _address(tag_or_tensor))[2]

    def get_chunk_states(self, tag_or_tensor: Any = None, *, tag: Any = None) -> list:
        """See ``TorchMemorySaver.get_chunk_states``."""
        tag_or_tensor = chunk_target("get_chunk_states", tag_or_tensor, tag)
        if isinstance(tag_or_tensor, str):
            name = _enc(_check_tag(tag_or_tensor))
            lib = self._library()
            n = self._tag_count(lib, name)
            if not n:
                return []
            out = (ctypes.c_uint8 * n)()
            if not lib.tms_get_chunk_states(name, out, n):
                raise self._tag_failure(lib, name)
        else:
            addr = _address(tag_or_tensor)
            lib = self._library()
            n = self._chunks_of(lib, addr)[2]
            out = (ctypes.c_uint8 * n)()
            lib.check(lib.tms_chunk_states_at(addr, out, n))
        return [bool(v) for v in out]

    def get_chunk_layout(self, tag_or_tensor: Any = None, *, tag: Any = None) -> list:
        """See ``TorchMemorySaver.get_chunk_layout``."""
        tag_or_tensor = chunk_target("get_chunk_layout", tag_or_tensor, tag)
        if isinstance(tag_or_tensor, str):
            name = _enc(_check_tag(tag_or_tensor))
            lib = self._library()
            n = self._tag_count(lib, name)
            if not n:
                return []
            offsets, sizes = (ctypes.c_size_t * n)(), (ctypes.c_size_t * n)()
            lib.check(lib.tms_get_chunk_layout(name, offsets, sizes, n))
            return list(zip(offsets, sizes))
        addr = _address(tag_or_tensor)
        _, chunk, n = self._chunks_of(self._library(), addr)
        return [(i * chunk, chunk) for i in range(n)]

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
        """Per-tag statistics: allocations (active, paused, and chunked ones with some chunks
        paused or one a failed pause could not make whole again: ``partial_allocations``),
        bytes active/paused (counting chunks), host backup bytes (and how many of them are
        page-locked), and the last pause/resume (seconds, bytes, GiB/s, and the part of a
        resume spent releasing host memory)."""
        lib = self._library()
        return json.loads(lib.call_string(lib.tms_stats_json))

    def summary(self) -> str:
        """The statistics as a readable table."""
        s = self.stats()
        gib = float(1 << 30)
        # A column of chunked allocations with some chunks paused, where there are any.
        partial = any(t.get("partial_allocations", 0) for t in s["tags"])
        partial_head = f"{'partial':>7} " if partial else ""
        lines = [
            f"torch-memory-saver ({s['backend']}): retain_cpu_backup={s['retain_cpu_backup']}, "
            f"memory_margin_bytes={s['memory_margin_bytes']}",
            f"{'tag':<16} {'allocs':>6} {'paused':>6} {partial_head}{'active GiB':>11} "
            f"{'paused GiB':>11} {'host GiB':>9} {'disk GiB':>9} {'last pause':>18} {'last resume':>18}",
        ]

        def op(o: Optional[dict]) -> str:
            return "-" if not o else f"{o['seconds']:.3f}s {o['gib_per_s']:.1f}GiB/s"

        for t in s["tags"]:
            part = f"{t.get('partial_allocations', 0):>7} " if partial else ""
            lines.append(
                f"{t['tag']:<16} {t['allocations']:>6} {t['paused_allocations']:>6} {part}"
                f"{t['bytes_active'] / gib:>11.3f} {t['bytes_paused'] / gib:>11.3f} "
                f"{t['host_backup_bytes'] / gib:>9.3f} {t.get('disk_backup_bytes', 0) / gib:>9.3f} "
                f"{op(t['last_pause']):>18} {op(t['last_resume']):>18}"
            )
        return "\n".join(lines)
