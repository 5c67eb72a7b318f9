"""What callers pass, checked and converted for the library: tags, backup settings, chunk
sizes and indices, the targets of chunk calls, tensors and streams as the C ABI takes them; and
which accelerator this is, read at call time (:func:`set_xpu_check`)."""

from __future__ import annotations

import operator
import os
from typing import Any, Callable, Optional

from ._checks import BACKENDS, _check_backend, _check_tag
from .errors import InvalidArgumentError, UnsupportedError
from .utils import is_xpu

# BACKENDS and the checks of a tag and of a backend live in _checks (the ctypes wrapper needs
# them too); imported here for this module and for those that take them from it.

_U64_MAX = (1 << 64) - 1


class _JobRecord:
    """``save_chunk_state`` / ``restore_chunk_state`` value of job-wide operations
    (``distributed``): their own record of chunk states, for their undo, so that they never
    replace the program's (``pause(tag, save_chunk_state=True)``)."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "JOB_RECORD"


JOB_RECORD = _JobRecord()


# The attribute a failed ``pause_range``/``resume_range`` sets on its error: the chunks it was to
# act on (a ``range``; the library says so before acting), which the job-wide undo reverses.
RANGE_ASKED = "_tms_range_asked"


def _record(flag: Any) -> int:
    """The C ABI's value for a record: 2 the job's, 1 the program's."""
    return 2 if flag is JOB_RECORD else 1


# What tells an Intel XPU. The facade installs a check that reads ``entrypoint.is_xpu`` at each
# call (integrations patch that name); this module cannot import the facade, which imports it.
_xpu_check: Callable[[], Any] = is_xpu


def set_xpu_check(check: Callable[[], Any]) -> None:
    """Make ``check()`` what says, at each call from now on, whether the accelerator is an XPU."""
    global _xpu_check
    _xpu_check = check


def _is_xpu() -> bool:
    """Whether the accelerator is an XPU, read at call time (``entrypoint.is_xpu``, a module name
    integrations patch). ROCm needs no check of its own: every setting works there."""
    return bool(_xpu_check())


def resolve_cpu_backup_backend(enable_cpu_backup: Any, backend: Any) -> Optional[str]:
    """The host memory a region's CPU backups go to: ``backend`` where given (``"pinned"`` or
    ``"mmap"``; refused without ``enable_cpu_backup``, and ``"mmap"`` on XPU), else
    ``TMS_INIT_CPU_BACKUP_BACKEND``, else ``"pinned"``; None without a CPU backup. Errors are
    :class:`InvalidArgumentError` (a ``ValueError``) in the existing library's words."""
    if backend is not None:
        _check_backend(backend)
        if not enable_cpu_backup:
            raise InvalidArgumentError(
                f"cpu_backup_backend={backend!r} requires enable_cpu_backup=True (there is no backup to put in it)"
            )
        # ROCm takes it (the existing library refuses it there): pageable backups are filled and
        # read through page-locked staging buffers, which HIP registers as CUDA does.
        if backend == "mmap" and _is_xpu():
            raise InvalidArgumentError(
                "cpu_backup_backend='mmap' is not supported on XPU (pageable backups need CUDA or ROCm); use 'pinned'"
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
    if backend is not None and _is_xpu():
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


def _address(x: Any, expected: str = "a tag (str) or a torch.Tensor") -> int:
    """The device address of a tensor (``x.data_ptr()``); else a TypeError saying that the caller
    takes ``expected``."""
    data_ptr = getattr(x, "data_ptr", None)
    if isinstance(x, (bytes, type)) or not callable(data_ptr):
        raise TypeError(f"expected {expected}, not {type(x).__name__}")
    return int(data_ptr())


def _tensor_or_address(x: Any) -> int:
    """A tensor, or a device address (an entry of ``order=``, the target of ``wait``)."""
    if isinstance(x, int) and not isinstance(x, bool):
        if not 0 < x <= _U64_MAX:
            raise InvalidArgumentError(f"device address {x} is out of range")
        return x
    return _address(x, "a torch.Tensor or a device address (int)")


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
