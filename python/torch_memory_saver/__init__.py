"""torch_memory_saver: give the GPU memory of selected tensors back and take it again later at
the same addresses (tensors, pointers and CUDA graphs stay valid), optionally keeping contents
in host memory.

    from torch_memory_saver import torch_memory_saver

    with torch_memory_saver.region(tag="kv", enable_cpu_backup=True):
        kv = torch.zeros(1 << 30, dtype=torch.uint8, device="cuda")
    torch_memory_saver.pause("kv")
    torch_memory_saver.resume("kv")

Run under ``LD_PRELOAD=<libtms.so>`` (hook_mode "preload", the default; see
``configure_subprocess``) or set ``torch_memory_saver.hook_mode = "torch"`` (or a mode of an
integration's own, ``register_hook_mode``). Importing this
package needs neither a GPU nor torch; ``pause``, ``resume`` and ``stats`` work without torch.

Modules integrations use: ``entrypoint`` (``TorchMemorySaver``, the class of the instance, whose
``_impl`` does the work), ``binary_wrapper`` (the ctypes binding; ``_impl._binary_wrapper.cdll``),
``hooks`` (the hook modes), ``utils`` (``get_binary_path_from_package``, ``change_env``,
``is_xpu``) and ``testing_utils``. ``distributed`` pauses and resumes every rank of a
``torch.distributed`` group or none. An installed package also holds the library beside itself in
site-packages as ``torch_memory_saver_hook_mode_{preload,torch}[_cu12|_cu13].abi3.so``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _install, binary_wrapper, distributed, entrypoint, hooks, testing_utils, utils
from .binary_wrapper import bundled_library_path
from .entrypoint import TorchMemorySaver, register_hook_mode
from .hooks import mode_preload as _mode_preload
from .errors import (
    DriverError,
    InternalError,
    InvalidArgumentError,
    InvalidStateError,
    LibraryNotFoundError,
    NotFoundError,
    OutOfMemoryError,
    TorchMemorySaverError,
    UnsupportedError,
)

from importlib import metadata as _metadata

try:  # the installed distribution's, which the build took from Cargo.toml
    __version__ = _metadata.version("torch_memory_saver")
except _metadata.PackageNotFoundError:  # a source checkout on sys.path, never installed
    __version__ = "0+unknown"

__implementation__ = _install.IMPLEMENTATION
"""``"rust"``: this package is the Rust implementation (the original has no such name).
``python -m torch_memory_saver`` prints the version and commit and checks the install."""

__all__ = [
    "TorchMemorySaver",
    "torch_memory_saver",
    "configure_subprocess",
    "register_hook_mode",
    "get_binary_path",
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

torch_memory_saver = TorchMemorySaver()
"""The process-wide instance."""


def _instance() -> TorchMemorySaver:
    """The process-wide instance this module holds now (one put in its place included): what
    ``distributed`` acts on, asked at each call."""
    return torch_memory_saver


distributed._saver = _instance


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """Child processes started inside get this library first in ``LD_PRELOAD``, as
    ``hooks.mode_preload.configure_subprocess()`` does, where the hook mode of
    ``torch_memory_saver`` uses the preload (``"preload"``, ``"torch"``, and modes registered
    with ``uses_preload=True``); under a mode registered with ``uses_preload=False`` the
    environment is left alone. A mode no registration names (integrations that patch
    ``_ensure_initialized`` use such names) keeps the preload, as before modes could be
    registered."""
    mode = torch_memory_saver.hook_mode
    reg = entrypoint._HOOK_MODE_REGISTRY.get(mode) if isinstance(mode, str) else None
    if reg is not None and not reg.uses_preload:
        yield
        return
    # Looked up now, so that a patched hooks.mode_preload.configure_subprocess is the one used.
    with _mode_preload.configure_subprocess():
        yield


def get_binary_path() -> str:
    """Path of the libtms.so bundled with this package (what ``LD_PRELOAD`` should name)."""
    return bundled_library_path()


_install.warn_if_broken()
