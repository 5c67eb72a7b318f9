"""Helpers that integrations import: where the library files are, a scoped environment
change, and whether the accelerator is an Intel XPU."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Iterator, Optional

from .binary_wrapper import bundled_library_path
from .errors import LibraryNotFoundError

__all__ = ["LIBRARY_STEMS", "get_binary_path_from_package", "change_env", "is_xpu"]

LIBRARY_STEMS = tuple(
    f"torch_memory_saver_hook_mode_{mode}{cuda}" for mode in ("preload", "torch") for cuda in ("", "_cu12", "_cu13")
)
"""The names the library is installed under beside the package (one build serves them all)."""


def _cuda_major() -> Optional[int]:
    """The CUDA major version the library files are chosen by: that of the PyTorch in use (an
    imported ``torch`` first, so a test's stand-in counts), else of the CUDA runtime this
    process can load; None on ROCm or where neither tells."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F811
        except Exception:  # no torch, or a broken one: probe the runtime instead
            torch = None
    version = getattr(torch, "version", None)
    if version is not None:
        if getattr(version, "hip", None):
            return None
        cuda = getattr(version, "cuda", None)
        if cuda:
            try:
                return int(str(cuda).split(".")[0])
            except ValueError:
                return None
    return _runtime_cuda_major()


def _runtime_cuda_major() -> Optional[int]:
    """``cudaRuntimeGetVersion`` of a CUDA runtime already in the process or on the loader's
    path (12040 -> 12), else None."""
    import ctypes
    import ctypes.util

    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.insert(0, found)
    for name in names:
        try:
            fn = ctypes.CDLL(name).cudaRuntimeGetVersion
        except (OSError, AttributeError):
            continue
        v = ctypes.c_int(0)
        if fn(ctypes.byref(v)) == 0 and v.value > 0:
            return v.value // 1000
    return None


def get_binary_path_from_package(stem: str) -> Path:
    """Path of the library file named ``stem`` (e.g. ``"torch_memory_saver_hook_mode_preload"``)
    in site-packages, as the existing library picks it: ``<stem>_cu<major>.abi3.so`` by the CUDA
    major version of the PyTorch in use (or of the CUDA runtime, probed), the unsuffixed
    ``<stem>.abi3.so`` on ROCm and where that file is the one there (or another ``<stem>*.so``).
    One build serves every name. In a source checkout, where those files are not installed, the
    names of :data:`LIBRARY_STEMS` (and ``"libtms"``) give the library
    :func:`torch_memory_saver.get_binary_path` uses; any other name raises
    :class:`LibraryNotFoundError`."""
    if not isinstance(stem, str) or not stem or "/" in stem or "\0" in stem:
        raise ValueError(f"stem must be a file name without suffix, not {stem!r}")
    # Read at call time: a test may point the module elsewhere.
    root = Path(__file__).parent.parent
    candidates = []
    if not re.search(r"_cu\d+$", stem):
        major = _cuda_major()
        if major is not None:
            candidates.append(root / f"{stem}_cu{major}.abi3.so")
    candidates.append(root / f"{stem}.abi3.so")
    for path in candidates:
        if path.is_file():
            return path
    found = sorted(p for p in root.glob(f"{stem}.*so") if p.is_file())
    if found:
        return found[0]
    if stem in LIBRARY_STEMS or stem == "libtms":
        return Path(bundled_library_path())
    raise LibraryNotFoundError(f"no library named {stem!r} in {root} (known names: {', '.join(LIBRARY_STEMS)})")


@contextlib.contextmanager
def change_env(key: str, value: Optional[str]) -> Iterator[None]:
    """Set environment variable ``key`` to ``value`` (None: remove it) inside the block; on exit
    restore what was there, an absent variable as absent."""
    old = os.environ.get(key)
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def is_xpu() -> bool:
    """True when PyTorch is installed and its accelerator is an Intel XPU (this package then
    has nothing to hook: it works on CUDA devices)."""
    try:
        import torch
    except ImportError:
        return False
    xpu = getattr(torch, "xpu", None)
    try:
        return bool(xpu is not None and xpu.is_available())
    except Exception:  # a broken XPU runtime is no XPU
        return False
