"""Exceptions raised by torch_memory_saver. Every failure derives from TorchMemorySaverError;
the message carries the device, tag, sizes and the driver's error name where they apply."""

from __future__ import annotations

__all__ = [
    "TorchMemorySaverError",
    "OutOfMemoryError",
    "DriverError",
    "InvalidArgumentError",
    "InvalidStateError",
    "NotFoundError",
    "UnsupportedError",
    "InternalError",
    "LibraryNotFoundError",
]


class TorchMemorySaverError(RuntimeError):
    """Base class of every error of this package.

    ``status`` is the library's status code (see ``tms.h``), ``None`` for errors raised by the
    Python side itself.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class OutOfMemoryError(TorchMemorySaverError):
    """Device (or host) memory ran out. Nothing changed: after ``resume`` the tag is still
    paused with its backups intact, so free memory and call ``resume`` again."""


class DriverError(TorchMemorySaverError):
    """A CUDA or HIP driver call failed (other than out of memory)."""


class InvalidArgumentError(TorchMemorySaverError, ValueError):
    """A bad argument or setting (also a ``ValueError``)."""


class InvalidStateError(TorchMemorySaverError):
    """The call is not valid now (for example in a process forked after the library started)."""


class NotFoundError(TorchMemorySaverError, LookupError):
    """The address or tag is not known to the library."""


class UnsupportedError(TorchMemorySaverError):
    """Not available here (no CUDA driver, or an unsupported setting)."""


class InternalError(TorchMemorySaverError):
    """A bug inside the library; the process carries on."""


class LibraryNotFoundError(TorchMemorySaverError):
    """libtms.so could not be found or loaded."""


# The attribute a failed pause or resume of the library sets on its error where the library
# says what the call changed all the same and left so (``tms_last_changed``): a dict of
# ``allocations``, ``bytes`` and ``communicators`` (zeros: it changed nothing). The job-wide
# undo (``distributed``) decides from it whether the call needs undoing.
CHANGED = "_tms_changed"


# Each status of the library's one table (status::TABLE in preload/src/error.rs), which
# tests/tests/header.rs checks this against.
_BY_STATUS = {
    1: OutOfMemoryError,
    2: DriverError,
    3: InvalidArgumentError,
    4: InvalidStateError,
    5: NotFoundError,
    6: UnsupportedError,
    7: TorchMemorySaverError,
    8: InternalError,
    9: InternalError,
}


def error_for_status(status: int, message: str) -> TorchMemorySaverError:
    """The exception for a library status code."""
    cls = _BY_STATUS.get(status, TorchMemorySaverError)
    return cls(message or f"torch-memory-saver call failed with status {status}", status)
