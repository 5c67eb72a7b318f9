"""Checks every layer applies to what callers pass, the ctypes wrapper included (which must not
import :mod:`.arguments`: that imports ``utils``, which imports the wrapper): a tag, and the
name of a CPU backup backend."""

from __future__ import annotations

from typing import Any, Optional

from .errors import InvalidArgumentError

BACKENDS = ("pinned", "mmap")


def _check_backend(backend: Any) -> None:
    """Refuse a CPU backup backend that is not one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        hint = " (a disk backup is enable_disk_backup=True)" if backend == "disk" else ""
        raise InvalidArgumentError(f'cpu_backup_backend must be "mmap" or "pinned", not {backend!r}{hint}')


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
    try:
        tag.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"tag must be text UTF-8 can encode, not {tag!r} ({e.reason})") from None
    return tag
