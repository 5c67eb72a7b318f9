"""The implementation behind ``torch_memory_saver.entrypoint.TorchMemorySaver``, one per hook
mode: its library and settings, residency, statistics; and, from a module each, regions and
graph captures (``regions``), pause and resume (``pause_resume``), chunk calls (``chunks``),
CPU backup views (``cpu_backup``) and NCCL's communicators (``nccl``)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
from typing import Any, Dict, Optional

from .arguments import _U64_MAX, _address, _is_xpu, _tensor_or_address
from .binary_wrapper import ROOM_TRIES, BinaryWrapper
from .chunks import _Chunks
from .cpu_backup import _CpuBackups
from .errors import InternalError, InvalidArgumentError, InvalidStateError, LibraryNotFoundError
from .hooks import HookUtilBase
from .nccl import _Nccl
from .pause_resume import _PauseResume
from .regions import _PoolMap, _Regions

__all__ = ["_TorchMemorySaverImpl"]

logger = logging.getLogger("torch_memory_saver")

# export_memory's room for segments at its first try (an allocation under 1 GiB that is not
# chunked has one).
_EXPORT_ROOM = 16


class _TorchMemorySaverImpl(_Regions, _PauseResume, _Chunks, _CpuBackups, _Nccl):
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
        # Held by set_checks between reading the checks it keeps and writing them back.
        self._checks_lock = threading.Lock()
        # disable(dispose_mem_pool_after_use=False)'s pools, by device, kept between blocks.
        self._kept_disable_pools: Dict[int, Any] = {}
        self._nccl_extra: list = []
        self._nccl_handed = False
        self._nccl_lock = threading.RLock()

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
        return _is_xpu()

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
        addr = _address(tensor, "a torch.Tensor")
        lib = self._library()
        size = ctypes.c_uint64(0)
        lib.check(lib.tms_keep_resident_ex(addr, ctypes.byref(size)))
        if size.value:
            logger.info("keeping the allocation holding %#x resident (%d bytes)", addr, size.value)
        return size.value

    def export_memory(self, tensor: Any) -> list:
        """See ``TorchMemorySaver.export_memory``."""
        addr = _tensor_or_address(tensor)
        lib = self._library()
        # Each call exports the allocation as it is then, or nothing when the room is too small
        # (saying the room needed). Another thread may free the allocation and make a larger
        # one there before the next call, so a too-small room is asked again with the room now
        # needed, a bounded number of times.
        # The descriptors of the latest call, -1 where it made none (it writes them only where
        # it succeeds).
        made: list = []

        def attempt(room: int):
            fds = (ctypes.c_int * room)()
            ctypes.memset(fds, 0xFF, ctypes.sizeof(fds))
            made[:] = [fds]
            offsets = (ctypes.c_uint64 * room)()
            lens = (ctypes.c_uint64 * room)()
            need = ctypes.c_uint64(0)
            status = lib.tms_export(addr, fds, offsets, lens, room, ctypes.byref(need))
            return status, need.value, lambda: [(int(offsets[i]), int(lens[i]), int(fds[i])) for i in range(need.value)]

        try:
            return lib.call_with_room(
                _EXPORT_ROOM,
                attempt,
                f"export_memory({addr:#x}): the allocation holding the address had more segments at each of "
                f"{ROOM_TRIES} tries than the try before had room for (another thread keeps freeing it and "
                "making a larger one there); nothing was exported",
            )
        except BaseException:
            # The call waits for any pause or resume under way, and a Ctrl-C then lands as it
            # returns, its descriptors made: they never reach the caller, and each left open
            # would keep its segment's memory alive across every later pause.
            for fd in made[0] if made else ():
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            raise

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

    # ---------------------------------------------------------------- stats

    def stats(self) -> dict:
        """Per-tag statistics: allocations (active, paused, and chunked ones with some chunks
        paused or one a failed pause could not make whole again: ``partial_allocations``),
        bytes active/paused (counting chunks), host backup bytes (and how many of them are
        page-locked), and the last pause/resume (seconds, bytes, GiB/s, and the part of a
        resume spent releasing host memory)."""
        self._hand_over_nccl(None)
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
