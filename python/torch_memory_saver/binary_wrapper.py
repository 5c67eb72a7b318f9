"""ctypes binding of libtms.so's C ABI (see preload/include/tms.h). Importing this module loads
nothing; the library is found on first use.

``BinaryWrapper.cdll`` is the ``ctypes.CDLL`` of the library, the object integrations reach for
(``torch_memory_saver._impl._binary_wrapper.cdll.tms_set_interesting_region(False)``); the
library's own calls are also attributes of the wrapper itself, with their types declared."""

from __future__ import annotations

import ctypes
import os
import stat
import threading
from pathlib import Path
from typing import Optional

from ._checks import _check_backend, _check_tag
from .errors import (
    CHANGED,
    InvalidArgumentError,
    InvalidStateError,
    LibraryNotFoundError,
    TorchMemorySaverError,
    error_for_status,
)

__all__ = ["BinaryWrapper", "Changed", "LibraryHandle", "Progress", "bundled_library_path", "cuda_runtime_function", "load", "preloaded", "preloaded_path"]

_c_size_p = ctypes.POINTER(ctypes.c_size_t)
_c_u64_p = ctypes.POINTER(ctypes.c_uint64)
_c_u8_p = ctypes.POINTER(ctypes.c_uint8)


class Progress(ctypes.Structure):
    """``tms_progress`` of tms.h: the pause or resume running in the process (``active``), how
    many bytes it has copied of its total, what it does (``phase``), and which OS thread runs it
    (``thread_id``, comparable with ``threading.get_native_id()``)."""

    _fields_ = [
        ("active", ctypes.c_int32),
        ("op", ctypes.c_int32),
        ("bytes_total", ctypes.c_uint64),
        ("bytes_done", ctypes.c_uint64),
        ("seconds", ctypes.c_double),
        ("copy_seconds", ctypes.c_double),
        ("thread_id", ctypes.c_uint64),
        ("backing", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("phase", ctypes.c_char * 32),
    ]


class Changed(ctypes.Structure):
    """``tms_changed`` of tms.h: what the calling thread's last pause or resume changed all the
    same where it failed (``said`` 1: allocations, device bytes and NCCL communicators it left
    paused or resumed), or nothing said (0)."""

    _fields_ = [
        ("said", ctypes.c_int32),
        ("reserved", ctypes.c_uint32),
        ("allocations", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("communicators", ctypes.c_uint64),
    ]


# name -> (restype, argtypes), as tms.h declares them (python/tests/test_c_abi.py checks)
_SIGNATURES = {
    "tms_version": (ctypes.c_char_p, []),
    "tms_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "tms_last_error": (ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
    "tms_error_count": (ctypes.c_uint64, []),
    "tms_init": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t, _c_size_p]),
    "tms_is_active": (ctypes.c_int, []),
    "tms_region_enter": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]),
    "tms_region_exit": (ctypes.c_int, []),
    "tms_region_current": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t, _c_size_p]),
    "tms_pause": (ctypes.c_int, [ctypes.c_char_p]),
    "tms_resume": (ctypes.c_int, [ctypes.c_char_p]),
    "tms_pause_ex": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
    "tms_resume_ex": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
    # The non-blocking resume.
    "tms_resume_nonblocking": (
        ctypes.c_int,
        [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64, _c_u64_p, ctypes.c_uint64, _c_u64_p],
    ),
    "tms_wait_restored": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int)]),
    "tms_stream_wait_restored": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64]),
    # Chunked allocations, by address.
    "tms_chunks_of": (ctypes.c_int, [ctypes.c_uint64, _c_u64_p, _c_u64_p, _c_u64_p]),
    "tms_chunk_states_at": (ctypes.c_int, [ctypes.c_uint64, _c_u8_p, ctypes.c_uint64]),
    "tms_chunks_at": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_int, _c_u64_p, ctypes.c_uint64]),
    "tms_range": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, _c_u64_p, _c_u64_p]),
    "tms_set_retain_cpu_backup": (ctypes.c_int, [ctypes.c_int]),
    "tms_query_retain_cpu_backup": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "tms_set_memory_margin": (ctypes.c_int, [ctypes.c_uint64]),
    "tms_get_memory_margin": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint64)]),
    "tms_get_cpu_backup": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)]),
    "tms_acquire_cpu_backup": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint64)],
    ),
    "tms_release_cpu_backup": (ctypes.c_int, [ctypes.c_uint64]),
    "tms_copy_cpu_backup": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)],
    ),
    "tms_stats_json": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t, _c_size_p]),
    "tms_get_progress": (ctypes.c_int, [ctypes.POINTER(Progress), ctypes.c_size_t]),
    "tms_last_progress": (ctypes.c_int, [ctypes.POINTER(Progress), ctypes.c_size_t]),
    "tms_last_changed": (ctypes.c_int, [ctypes.POINTER(Changed), ctypes.c_size_t]),
    "tms_set_checks": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]),
    "tms_get_checks": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]),
    "tms_resume_verified": (ctypes.c_int, [ctypes.c_char_p]),
    "tms_export": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), _c_u64_p, _c_u64_p, ctypes.c_uint64, _c_u64_p],
    ),
    # The existing library's names (booleans travel as int 0/1; see tms.h).
    "tms_set_interesting_region": (ctypes.c_int, [ctypes.c_int]),
    "tms_get_interesting_region": (ctypes.c_bool, []),
    "tms_set_current_tag": (ctypes.c_int, [ctypes.c_char_p]),
    "tms_get_current_tag": (ctypes.c_char_p, []),
    "tms_set_enable_cpu_backup": (ctypes.c_int, [ctypes.c_int]),
    "tms_get_enable_cpu_backup": (ctypes.c_bool, []),
    "tms_set_cpu_backup_backend": (ctypes.c_int, [ctypes.c_char_p]),
    "tms_get_cpu_backup_backend": (ctypes.c_char_p, []),
    "tms_set_enable_disk_backup": (ctypes.c_int, [ctypes.c_int]),
    "tms_get_enable_disk_backup": (ctypes.c_bool, []),
    "tms_set_disk_backup_dir": (ctypes.c_int, [ctypes.c_char_p]),
    # Chunked allocations, by tag (the tag must have exactly one).
    "tms_set_chunk_size": (ctypes.c_int, [ctypes.c_size_t]),
    "tms_get_chunk_size": (ctypes.c_size_t, []),
    "tms_pause_chunks": (ctypes.c_int, [ctypes.c_char_p, _c_size_p, ctypes.c_size_t]),
    "tms_resume_chunks": (ctypes.c_int, [ctypes.c_char_p, _c_size_p, ctypes.c_size_t]),
    "tms_get_num_chunks_for_tag": (ctypes.c_size_t, [ctypes.c_char_p]),
    "tms_get_chunk_states": (ctypes.c_bool, [ctypes.c_char_p, _c_u8_p, ctypes.c_size_t]),
    "tms_get_chunk_layout": (ctypes.c_int, [ctypes.c_char_p, _c_size_p, _c_size_p, ctypes.c_size_t]),
    "set_memory_margin_bytes": (ctypes.c_int, [ctypes.c_uint64]),
    "tms_get_retain_cpu_backup": (ctypes.c_bool, []),
    # Typed as the existing library's binding types it.
    "tms_get_cpu_backup_pointer": (_c_u8_p, [_c_u8_p, ctypes.c_uint64]),
    "tms_keep_resident": (ctypes.c_size_t, [ctypes.c_void_p]),
    "tms_keep_resident_ex": (ctypes.c_int, [ctypes.c_uint64, _c_u64_p]),
    "tms_affected_devices": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
    # NCCL's communicators (the tag "nccl").
    "tms_nccl_adopt": (ctypes.c_int, [_c_u64_p, ctypes.c_size_t]),
    "tms_nccl_set_in_all": (ctypes.c_int, [ctypes.c_int]),
    "tms_nccl_get_in_all": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "tms_nccl_set_registered": (ctypes.c_int, [ctypes.c_char_p]),
    "tms_nccl_get_registered": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t, _c_size_p]),
}

BUFFER_TOO_SMALL = 9

# How many times call_with_room asks for an answer that was larger at each try than the room
# the try before made for it (another thread keeps changing what it describes) before it gives up.
ROOM_TRIES = 8


def bundled_library_path() -> str:
    """Path of the libtms.so this package uses: ``$TMS_LIBRARY_PATH``, else the one installed
    inside the package, else a development build (``target/{release,debug}``) of the checkout
    this package sits in."""
    env = os.environ.get("TMS_LIBRARY_PATH")
    if env:
        _check_library_file(env)
        return env
    here = Path(__file__).resolve().parent
    found = sorted(here.glob("libtms*.so"))
    if found:
        return str(found[0])
    root = here.parent.parent
    for profile in ("release", "debug"):
        p = root / "target" / profile / "libtms.so"
        if p.exists():
            return str(p)
    raise LibraryNotFoundError(
        f"libtms.so not found: not installed in {here}, no development build under {root / 'target'}, "
        "and TMS_LIBRARY_PATH is not set. Install the package with pip, or build with `cargo build --release`."
    )


def _check_library_file(path: str) -> None:
    """Refuse a ``TMS_LIBRARY_PATH`` that names no shared library, before its path goes into
    advice such as ``LD_PRELOAD=...``. Only a regular file is opened (a FIFO would block)."""
    fix = "it must name libtms.so; unset it to use the one installed with the package"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise LibraryNotFoundError(f"TMS_LIBRARY_PATH={path!r} is not a regular file: {fix}")
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise LibraryNotFoundError(f"TMS_LIBRARY_PATH={path!r}: {e.strerror}: {fix}") from None
    if magic != b"\x7fELF":
        raise LibraryNotFoundError(f"TMS_LIBRARY_PATH={path!r} is not a shared library: {fix}")


def _mapped_libraries(prefix: str, maps: str = "/proc/self/maps") -> list:
    """Paths of the files mapped into this process whose name starts with ``prefix``, in the
    order the kernel lists them (each once)."""
    found: list = []
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if os.path.basename(path).startswith(prefix) and path not in found:
                        found.append(path)
    except OSError:
        pass
    return found


def cuda_runtime_function(name: str):
    """``name`` (a CUDA runtime function) from the CUDA runtime this process has loaded: the
    process's global symbols first, else the ``libcudart`` mapped into it (PyTorch loads its
    own, possibly with local symbols). None where there is none. Nothing new is loaded."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except AttributeError:
        pass
    for path in _mapped_libraries("libcudart.so"):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
            return getattr(lib, name)
        except (OSError, AttributeError):
            continue
    return None


class LibraryHandle(ctypes.CDLL):
    """The ``ctypes.CDLL`` of libtms.so. libtms.so links no CUDA library (one build serves CUDA
    12 and 13), so a CUDA runtime name it lacks (``cudaHostGetFlags``, ``cudaGetLastError``...)
    is looked up in the runtime already loaded in the process, as integrations of the existing
    library (whose file links the runtime) expect of this handle."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if not name.startswith("cuda"):
                raise
        func = cuda_runtime_function(name)
        if func is None:
            raise AttributeError(
                f"{name}: not in {self._name or 'this process'} nor in a CUDA runtime loaded in this process"
            )
        setattr(self, name, func)
        return func


class BinaryWrapper:
    """The loaded C ABI, with status checking. ``cdll`` is the ``ctypes.CDLL`` itself.

    ``BinaryWrapper(path_binary)`` (or ``BinaryWrapper(path_binary=...)``, as the existing
    library's own code calls it) loads the file; ``BinaryWrapper(cdll, path)`` wraps a handle
    already loaded. A ``path_binary`` of None (what preload mode's ``get_path_binary()`` gives
    in a process without the library preloaded) raises :class:`LibraryNotFoundError`."""

    def __init__(self, path_binary: "ctypes.CDLL | str | bytes | os.PathLike", path: Optional[str] = None) -> None:
        cdll = path_binary
        if cdll is None:
            raise LibraryNotFoundError(
                "BinaryWrapper(path_binary=None): no library to load (in preload mode, libtms.so is not in "
                "LD_PRELOAD of this process); pass the path of libtms.so, e.g. torch_memory_saver.get_binary_path()"
            )
        if isinstance(cdll, (str, bytes, os.PathLike)):
            path = os.fsdecode(cdll)
            try:
                cdll = LibraryHandle(path)
            except OSError as e:
                raise LibraryNotFoundError(f"cannot load {path}: {e}") from e
        self.cdll = cdll
        self.path = path
        for name, (res, args) in _SIGNATURES.items():
            f = getattr(cdll, name)
            f.restype = res
            f.argtypes = args
            setattr(self, name, f)

    def set_config(
        self,
        *,
        tag: str = "default",
        interesting_region: bool = True,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
        enable_disk_backup: bool = False,
    ) -> None:
        """Set this thread's region settings through the existing library's C names (the
        innermost region's; one is opened where none is). Raises on a refused value (a CPU and a
        disk backup together included: they are mutually exclusive), having changed nothing."""
        _check_tag(tag)
        if cpu_backup_backend is not None:
            _check_backend(cpu_backup_backend)
        if enable_disk_backup and enable_cpu_backup:
            raise InvalidArgumentError(
                "enable_cpu_backup and enable_disk_backup are mutually exclusive (a paused tensor keeps its "
                "contents in one place)"
            )
        self.check(self.tms_set_current_tag(tag.encode("utf-8")))
        self.check(self.tms_set_interesting_region(int(bool(interesting_region))))
        if enable_disk_backup:
            self.check(self.tms_set_enable_cpu_backup(0))
            self.check(self.tms_set_enable_disk_backup(1))
        else:
            self.check(self.tms_set_enable_disk_backup(0))
            self.check(self.tms_set_enable_cpu_backup(int(bool(enable_cpu_backup))))
        if cpu_backup_backend is not None:
            self.check(self.tms_set_cpu_backup_backend(cpu_backup_backend.encode("utf-8")))

    def last_error(self) -> str:
        """This thread's last error message from the library, whole (a message listing many
        allocations can run past any fixed buffer)."""
        buf = ctypes.create_string_buffer(4096)
        n = self.tms_last_error(buf, len(buf))
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self.tms_last_error(buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def check(self, status: int) -> None:
        """Raise the matching exception for a failed status."""
        if status != 0:
            raise error_for_status(status, self.last_error())

    def progress(self) -> Optional[Progress]:
        """The pause or resume running in the process, or None when none runs."""
        p = Progress()
        self.check(self.tms_get_progress(ctypes.byref(p), ctypes.sizeof(p)))
        return p if p.active else None

    def last_progress(self) -> Optional[Progress]:
        """This thread's last pause or resume once it succeeded (its true totals), or None."""
        p = Progress()
        self.check(self.tms_last_progress(ctypes.byref(p), ctypes.sizeof(p)))
        return p if p.op else None

    def last_changed(self) -> Optional[dict]:
        """What this thread's last pause or resume changed all the same where it failed, as the
        library says it (``allocations``, ``bytes``, ``communicators``; zeros where nothing), or
        None where it does not say (it succeeded, or the library cannot tell)."""
        c = Changed()
        self.check(self.tms_last_changed(ctypes.byref(c), ctypes.sizeof(c)))
        if not c.said:
            return None
        return {"allocations": c.allocations, "bytes": c.bytes, "communicators": c.communicators}

    def check_op(self, status: int) -> None:
        """:meth:`check` for the status of a pause or resume (any of the library's): where the
        library says what the failed call changed all the same, the exception carries it as its
        attribute ``errors.CHANGED``."""
        if status == 0:
            return
        error = error_for_status(status, self.last_error())
        try:
            changed = self.last_changed()
        except TorchMemorySaverError:
            changed = None  # not said: whoever undoes the call judges for itself
        if changed is not None:
            setattr(error, CHANGED, changed)
        raise error

    def call_with_room(self, room: int, attempt, refused: str, spare=lambda need: need):
        """``attempt(room)``: one call with room for ``room`` entries, as ``(status, need,
        answer)``, ``answer()`` reading what it wrote. Where the library says the room was too
        small (``BUFFER_TOO_SMALL``, needing ``need``), asked again with room ``spare(need)``:
        what it describes (another thread's allocations, say) may grow between calls, so after
        :data:`ROOM_TRIES` tries that each found it larger than the room made for it, raises
        :class:`InvalidStateError` with ``refused`` and the library's last message."""
        for _ in range(ROOM_TRIES):
            status, need, answer = attempt(room)
            if status == BUFFER_TOO_SMALL and need > room:
                room = spare(need)
                continue
            self.check(status)
            return answer()
        raise InvalidStateError(f"{refused}. Last: {self.last_error()}")

    def call_string(self, fn) -> str:
        """Call a ``(buf, cap, out_len)`` function, growing the buffer as needed. The answer
        (stats of allocations another thread is making, say) may grow between calls: after
        a few tries that each found it larger than the room made for it, raises
        :class:`InvalidStateError` saying so."""

        def attempt(cap: int):
            buf = ctypes.create_string_buffer(cap)
            need = ctypes.c_size_t(0)
            status = fn(buf, cap, ctypes.byref(need))
            return status, need.value + 1, lambda: buf.value.decode("utf-8")

        name = getattr(fn, "__name__", repr(fn))
        return self.call_with_room(
            4096,
            attempt,
            f"{name}: its answer was larger at each of {ROOM_TRIES} tries than the try before had room for "
            "(another thread keeps changing what it describes)",
            # Room to spare, so that an answer a little larger by the next call still fits.
            spare=lambda need: need + (need - 1) // 4,
        )


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


_lock = threading.Lock()
_preloaded: Optional[BinaryWrapper] = None
_loaded: dict[str, BinaryWrapper] = {}


def preloaded_path() -> Optional[str]:
    """The file of the libtms.so that ``LD_PRELOAD`` put into this process (under whatever
    name), or None."""
    try:
        process = ctypes.CDLL(None)
        addr = ctypes.cast(process.tms_region_enter, ctypes.c_void_p).value
        dladdr = process.dladdr
    except (OSError, AttributeError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    if not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def preloaded() -> Optional[BinaryWrapper]:
    """The libtms.so that ``LD_PRELOAD`` put into this process, or None."""
    global _preloaded
    with _lock:
        if _preloaded is None:
            try:
                h = LibraryHandle(None)
                getattr(h, "tms_region_enter")
            except (OSError, AttributeError):
                return None
            _preloaded = BinaryWrapper(h, preloaded_path())
        return _preloaded


def load(path: Optional[str] = None) -> BinaryWrapper:
    """Load libtms.so from ``path`` (default: the preloaded one if there is one, else the
    bundled one). A process holds one instance of the library: loading the file that is already
    preloaded gives that instance (the loader shares it), and a preloaded copy under another
    name is preferred over loading a second instance."""
    path = path or preloaded_path() or bundled_library_path()
    with _lock:
        lib = _loaded.get(path)
        if lib is None:
            try:
                h = LibraryHandle(path)
            except OSError as e:
                raise LibraryNotFoundError(f"cannot load {path}: {e}") from e
            lib = _loaded[path] = BinaryWrapper(h, path)
        return lib
