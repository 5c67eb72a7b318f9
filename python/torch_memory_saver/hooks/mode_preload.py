"""Preload mode: libtms.so is in ``LD_PRELOAD`` and interposes ``cudaMalloc``."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Any, Iterator, Optional

from .. import binary_wrapper
from ..binary_wrapper import BinaryWrapper
from ..errors import LibraryNotFoundError, UnsupportedError
from ..utils import get_binary_path_from_package
from .base import HookUtilBase

__all__ = ["HookUtilModePreload", "configure_subprocess"]

PRELOAD_STEM = "torch_memory_saver_hook_mode_preload"

# The basenames our library is installed or built under (upstream names included).
_OUR_FILE = re.compile(r"^(torch_memory_saver_hook_mode_(preload|torch)(_cu\d+)?(\..*)?\.so|libtms(\..*)?\.so)$")


def _is_our_library(entry: str, path: str) -> bool:
    """Whether an ``LD_PRELOAD`` entry is (another copy of) this library: the same path or
    file, or a file under one of its names."""
    if entry == path or _OUR_FILE.match(os.path.basename(entry)):
        return True
    try:
        return os.path.samefile(entry, path)
    except OSError:
        return False


def _mapped_cudart_dir(maps_path: str = "/proc/self/maps") -> Optional[str]:
    """The folder of the CUDA runtime (``libcudart.so*``) mapped into this process (read from
    ``maps_path``, a ``/proc/<pid>/maps`` file), or None."""
    found = binary_wrapper._mapped_libraries("libcudart.so", maps_path)
    return os.path.dirname(found[0]) if found else None


def preload_library_path() -> str:
    """The library a child should preload: the file this process already preloads (one copy
    per process tree), else ``TMS_LIBRARY_PATH`` (the one this process loads in torch mode),
    else the site-packages file under the existing library's name for the CUDA version in use
    (``torch_memory_saver_hook_mode_preload[_cuNN].abi3.so``)."""
    preloaded = binary_wrapper.preloaded_path()
    if preloaded:
        return preloaded
    if os.environ.get("TMS_LIBRARY_PATH"):
        return binary_wrapper.bundled_library_path()  # checked: LibraryNotFoundError where it names no library
    return str(get_binary_path_from_package(PRELOAD_STEM))


def _preload_entry(path: str) -> "tuple[str, Optional[str]]":
    """How ``LD_PRELOAD`` names the library at ``path``: ``(path, None)``; where the path holds a
    space or a colon, which the loader takes for the end of an entry (there is no escaping them),
    ``(its file name, its folder)``, the folder to go first in ``LD_LIBRARY_PATH``, where the
    loader looks such a name up (and which only colons and semicolons split). A path neither way
    can name raises :class:`UnsupportedError`."""
    if not re.search(r"[: ]", path):
        return path, None
    folder, name = os.path.split(path)
    if re.search(r"[: ]", name) or re.search(r"[:;]", folder) or not folder:
        raise UnsupportedError(
            f"{path!r} cannot be preloaded by child processes: the loader splits LD_PRELOAD at spaces and "
            "colons, and LD_LIBRARY_PATH at colons and semicolons. Install the package (or point "
            "TMS_LIBRARY_PATH) at a path without them"
        )
    return name, folder


# configure_subprocess() blocks of every thread: the first to enter keeps the environment it
# found, the last to leave puts it back (threads overlap without nesting, so each putting back
# what it found would leave the preload set for good).
_env_lock = threading.Lock()
_env_users = 0
_env_saved: "dict[str, Optional[str]]" = {}


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """Child processes started inside get this library first in ``LD_PRELOAD`` (preload
    mode); every other entry is kept, any other copy of this library is left out (a process
    must hold one). Where this process has a CUDA runtime loaded, its folder goes first in
    ``LD_LIBRARY_PATH``, so a child finds the same runtime. Where the library's path holds a
    space or a colon (which end an ``LD_PRELOAD`` entry), ``LD_PRELOAD`` names its file and its
    folder goes first in ``LD_LIBRARY_PATH`` too (a child whose ``LD_LIBRARY_PATH`` drops it
    goes without the library); a path neither can name (a folder with a colon or semicolon, a
    file name with a space or colon) raises :class:`UnsupportedError` as the block is entered.
    Both variables are restored when the last block open (of any thread) ends (an absent one as
    absent)."""
    global _env_users
    path = preload_library_path()
    entry, folder = _preload_entry(path)
    cudart = _mapped_cudart_dir()
    with _env_lock:
        if _env_users == 0:
            _env_saved.clear()
            _env_saved.update((k, os.environ.get(k)) for k in ("LD_PRELOAD", "LD_LIBRARY_PATH"))
        old = os.environ.get("LD_PRELOAD")
        rest = [p for p in re.split(r"[: ]+", old or "") if p and not _is_our_library(p, path)]
        os.environ["LD_PRELOAD"] = ":".join([entry, *rest])
        first = [d for d in (cudart, folder) if d]
        if first:
            others = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and d not in first]
            os.environ["LD_LIBRARY_PATH"] = ":".join([*first, *others])
        _env_users += 1
    try:
        yield
    finally:
        with _env_lock:
            _env_users -= 1
            if _env_users == 0:
                for key, value in _env_saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value


def expandable_segments_setting() -> Optional[str]:
    """The allocator setting variable that turns expandable segments on, if any."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in os.environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return var
    return None


class HookUtilModePreload(HookUtilBase):
    hook_mode = "preload"

    def get_path_binary(self) -> Optional[str]:
        return binary_wrapper.preloaded_path()

    def get_allocator(self) -> Any:
        # PyTorch's own allocator: its cudaMalloc reaches the preloaded library.
        return None

    def binary_wrapper(self) -> BinaryWrapper:
        var = expandable_segments_setting()
        if var:
            raise UnsupportedError(
                f"{var} has expandable_segments:True: PyTorch then maps memory itself and never calls "
                "cudaMalloc, so preload mode cannot make it pauseable. Remove the setting, or use "
                "torch_memory_saver.hook_mode = 'torch'."
            )
        lib = binary_wrapper.preloaded()
        if lib is None:
            try:
                path = binary_wrapper.bundled_library_path()
            except LibraryNotFoundError:
                path = "/path/to/libtms.so"
            raise LibraryNotFoundError(
                "hook_mode 'preload' needs libtms.so in LD_PRELOAD, and this process does not have it: "
                f"run `LD_PRELOAD={path} python ...`, start child processes inside "
                "`torch_memory_saver.configure_subprocess()`, or set torch_memory_saver.hook_mode = 'torch'"
            )
        return lib
