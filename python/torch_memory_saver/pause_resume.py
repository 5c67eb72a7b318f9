"""Pause and resume (blocking or not), waiting for a non-blocking resume, and the progress of
one pause or resume while the library's call runs (:class:`_Watch`)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any, Callable, Optional

from .arguments import (
    _check_tag,
    _current_stream,
    _enc,
    _iterable,
    _record,
    _stream_handle,
    _tensor_or_address,
)
from .binary_wrapper import BinaryWrapper
from .errors import InvalidArgumentError, TorchMemorySaverError, UnsupportedError

logger = logging.getLogger("torch_memory_saver")


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
        try:
            if exc_type is None and self.progress is not None:
                p = self.lib.last_progress()
                total = p.bytes_total if p is not None else 0
                final = (total, total, "done")
        finally:
            # Whatever lands above (a KeyboardInterrupt), the helper thread stops.
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


class _PauseResume:
    """Pause, resume and wait of :class:`~.saver._TorchMemorySaverImpl`, which gives the
    library."""

    _library: Callable[[], BinaryWrapper]
    _checks_lock: threading.Lock
    # From ``nccl._Nccl``: hands the library the communicators it cannot see being made.
    _hand_over_nccl: Callable[[Optional[str]], None]

    def pause(self, tag: Optional[str] = None, save_chunk_state: Any = False, *, progress: Any = None) -> None:
        """Give back the device memory of ``tag`` (every tag if None), backing up contents where
        the region asked for it. Pausing what is paused does nothing. See
        ``TorchMemorySaver.pause`` for ``save_chunk_state`` and ``progress``."""
        tag = _check_tag(tag, optional=True)
        self._hand_over_nccl(tag)
        lib = self._library()
        what = "all tags" if tag is None else f"tag {tag!r}"
        t0 = time.perf_counter()
        with _Watch(lib, f"pause of {what}", progress):
            if save_chunk_state:
                lib.check_op(lib.tms_pause_ex(_enc(tag), _record(save_chunk_state)))
            else:
                lib.check_op(lib.tms_pause(_enc(tag)))
        logger.info("paused %s in %.3f s", what, time.perf_counter() - t0)

    def resume(
        self,
        tag: Optional[str] = None,
        restore_chunk_state: Any = False,
        *,
        progress: Any = None,
        non_blocking: Any = False,
        order: Any = None,
        verify: Any = False,
    ) -> None:
        """Take device memory back for ``tag`` (every tag if None), at the same addresses, and
        restore backups. On out of memory raises :class:`OutOfMemoryError` and the tag stays
        paused with its backups: free memory and call again. See ``TorchMemorySaver.resume``
        for ``restore_chunk_state``, ``progress``, ``non_blocking``, ``order`` and ``verify``."""
        tag = _check_tag(tag, optional=True)
        if verify is not True and verify is not False:
            raise InvalidArgumentError(f"verify must be True or False, not {verify!r}")
        if verify and (non_blocking or order is not None or restore_chunk_state):
            raise InvalidArgumentError(
                "resume(verify=True) waits for what it checks, of whole tags: not with non_blocking, order or "
                "restore_chunk_state"
            )
        self._hand_over_nccl(tag)
        if non_blocking or order is not None:
            return self._resume_nonblocking(tag, restore_chunk_state, progress, non_blocking, order)
        lib = self._library()
        what = "all tags" if tag is None else f"tag {tag!r}"
        t0 = time.perf_counter()
        with _Watch(lib, f"resume of {what}", progress):
            if verify:
                lib.check_op(lib.tms_resume_verified(_enc(tag)))
            elif restore_chunk_state:
                lib.check_op(lib.tms_resume_ex(_enc(tag), _record(restore_chunk_state)))
            else:
                lib.check_op(lib.tms_resume(_enc(tag)))
        logger.info("resumed %s in %.3f s", what, time.perf_counter() - t0)

    def set_checks(self, tag: Optional[str] = None, *, skip_unchanged: Any = None, verify: Any = None) -> None:
        """See ``TorchMemorySaver.set_checks``."""
        tag = _check_tag(tag, optional=True)
        for name, v in (("skip_unchanged", skip_unchanged), ("verify", verify)):
            if v is not None and not isinstance(v, bool):
                raise InvalidArgumentError(f"{name} must be True, False or None, not {v!r}")
        lib = self._library()
        # What is not given is read and written back: no other thread's set_checks in between.
        with self._checks_lock:
            now = self.get_checks(tag)
            lib.check(
                lib.tms_set_checks(
                    _enc(tag),
                    int(now["skip_unchanged"] if skip_unchanged is None else skip_unchanged),
                    int(now["verify"] if verify is None else verify),
                )
            )

    def get_checks(self, tag: Optional[str] = None) -> dict:
        """See ``TorchMemorySaver.get_checks``."""
        tag = _check_tag(tag, optional=True)
        lib = self._library()
        skip, verify = ctypes.c_int(0), ctypes.c_int(0)
        lib.check(lib.tms_get_checks(_enc(tag), ctypes.byref(skip), ctypes.byref(verify)))
        return {"skip_unchanged": bool(skip.value), "verify": bool(verify.value)}

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
        lib.check_op(lib.tms_resume_nonblocking(_enc(tag), device, handle, arr, len(addrs), ctypes.byref(pending)))
        logger.info("resuming %s: mapped in %.3f s, %d bytes still being restored", what,
                    time.perf_counter() - t0, pending.value)

    def wait(self, tensor: Any = None, *, stream: Any = None, timeout: Any = None) -> bool:
        """See ``TorchMemorySaver.wait``."""
        addr = 0 if tensor is None else _tensor_or_address(tensor)
        # An empty tensor (data_ptr() 0) lies in no allocation: nothing to wait for (0 would
        # be every allocation, and another's failed restore raised here).
        nothing = tensor is not None and addr == 0
        lib = self._library()
        if stream is not None and stream is not False:
            if timeout is not None:
                raise InvalidArgumentError("wait(stream=...) does not block: timeout= is for a host wait")
            device, handle = _current_stream() if stream is True else _stream_handle(stream)
            if device < 0:
                raise UnsupportedError("wait(stream=...) needs PyTorch with CUDA")
            if not nothing:
                lib.check(lib.tms_stream_wait_restored(addr, device, handle))
            return True
        if timeout is None:
            ms = -1
        else:
            try:
                # A bool is an int to float(): wait(timeout=True) would wait one second.
                t = float("nan") if isinstance(timeout, bool) else float(timeout)
            except (TypeError, ValueError):
                t = float("nan")
            if not t >= 0:
                raise InvalidArgumentError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
            # Beyond what 64 bits of milliseconds hold (inf included): no limit.
            ms = -1 if t * 1000 >= 2**63 else int(t * 1000)
        if nothing:
            return True
        done = ctypes.c_int(0)
        lib.check(lib.tms_wait_restored(addr, ms, ctypes.byref(done)))
        return bool(done.value)
