"""Helpers that integrations import: where the library files are, a scoped environment
change, and whether the accelerator is an Intel XPU."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Optional

from .binary_wrapper import bundled_library_path
from .errors import LibraryNotFoundError

__all__ = ["LIBRARY_STEMS", "get_binary_path_from_package", "change_env", "is_xpu"]

LIBRARY_STEMS = tuple(
    f"torch_memory_saver_hook_mode_{mode}{cuda}" for mode in ("preload", "torch") for cuda in ("", "_cu12", "_cu13")
)
"""The names the library is installed under beside the package (one build serves them all)."""


def get_binary_path_from_package(stem: str) -> Path:
    """Path of the library file named ``stem`` (e.g. ``"torch_memory_saver_hook_mode_preload"``):
    ``<site-packages>/<stem>.abi3.so`` (or another ``<stem>.*so`` there). In a source checkout,
    where those files are not installed, the names of :data:`LIBRARY_STEMS` (and ``"libtms"``)
    give the library :func:`torch_memory_saver.get_binary_path` uses."""
    if not isinstance(stem, str) or not stem or "/" in stem:
        raise ValueError(f"stem must be a file name without suffix, not {stem!r}")
    root = Path(__file__).resolve().parent.parent
    exact = root / f"{stem}.abi3.so"
    if exact.is_file():
        return exact
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
