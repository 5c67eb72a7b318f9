"""Which implementation this package is, and whether its installed files are whole.

This package and the original share the distribution name ``torch_memory_saver``, and frameworks
pin the original (``==0.0.9``): an install can put some of the original's files over ours, or
leave ours beside its. Half of each half-works, so the package says so instead: a cheap check
at import (file names and sizes only; a warning), and a thorough one in ``python -m
torch_memory_saver``."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional

IMPLEMENTATION = "rust"
"""``torch_memory_saver.__implementation__``: this package's; the original has no such name."""

_HERE = Path(__file__).resolve().parent
# The names the original's library files have beside the package in site-packages; ours are
# copies of our one library under the same names.
_BESIDE_GLOB = "torch_memory_saver_hook_mode_*.so"
_FIX = "reinstall this package (pip install --no-deps --force-reinstall <its wheel>) or remove both and install one"


def _is_checkout(here: Path) -> bool:
    """A source checkout (``python/torch_memory_saver`` of the repository), not an install."""
    return (here.parent.parent / "Cargo.toml").is_file()


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def problems(here: Path = _HERE, thorough: bool = False) -> List[str]:
    """What is wrong with the installed package at ``here``: our library missing, a file beside
    the package under the original's names that is not a copy of ours, and (``thorough``) the
    install record (``*.dist-info``) not this package's, or more than one. Empty for a source
    checkout, and for a whole install."""
    if _is_checkout(here):
        return []
    found: List[str] = []
    ours = sorted(here.glob("libtms*.so"))
    if not ours:
        found.append(f"this package's library (libtms*.so) is missing from {here}: another install removed or replaced it")
    else:
        size = ours[0].stat().st_size
        digest = _digest(ours[0]) if thorough else None
        for f in sorted(here.parent.glob(_BESIDE_GLOB)):
            try:
                same = f.stat().st_size == size and (digest is None or _digest(f) == digest)
            except OSError:
                same = False
            if not same:
                found.append(
                    f"{f} is not a copy of this package's library (another install's, the original's?): "
                    "LD_PRELOAD paths built from its name load it"
                )
    if thorough:
        records = sorted(here.parent.glob("torch_memory_saver-*.dist-info"))
        if len(records) > 1:
            found.append(f"several installs of torch_memory_saver are recorded: {', '.join(r.name for r in records)}")
        for r in records:
            try:
                listed = (r / "RECORD").read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            if "torch_memory_saver/_install.py" not in listed:
                found.append(f"the install record {r.name} is another package's (the original's?), not this one's")
    return found


def warn_if_broken() -> None:
    """At import: a warning naming what another install replaced, where it did."""
    try:
        found = problems()
    except OSError:  # an unreadable folder tells nothing; the import goes on
        return
    if found:
        warnings.warn(
            "torch_memory_saver (the Rust implementation) is not installed whole: "
            + "; ".join(found)
            + f". Fix: {_FIX}; `python -m torch_memory_saver` checks again.",
            RuntimeWarning,
            stacklevel=3,
        )


def _library_info(path: str) -> Dict[str, Optional[str]]:
    """The version and commit a library file says it was built from (``tms_version``,
    ``tms_build_info``; loading it does no work: the library starts at its first use)."""
    lib = ctypes.CDLL(path)
    info: Dict[str, Optional[str]] = {"version": None, "commit": None}
    texts = {}
    for name in ("tms_version", "tms_build_info"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_char_p
            fn.argtypes = []
            raw = fn()
            texts[name] = raw.decode("utf-8", "replace") if raw else ""
    info["version"] = texts.get("tms_version") or None
    found = re.search(r"commit ([^)\s]+)\)", texts.get("tms_build_info", ""))
    info["commit"] = found.group(1) if found else None
    return info


def describe(version: str) -> Dict[str, Any]:
    """Implementation, ``version`` (the package's), commit, where the package, its library and
    ``tmsctl`` are, and the problems :func:`problems` finds (thorough)."""
    from .binary_wrapper import bundled_library_path

    out: Dict[str, Any] = {
        "implementation": IMPLEMENTATION,
        "version": version,
        "package": str(_HERE),
        "library": None,
        "library_version": None,
        "commit": None,
        "tmsctl": None,
        "problems": problems(thorough=True),
    }
    try:
        out["library"] = bundled_library_path()
        info = _library_info(out["library"])
        out["library_version"], out["commit"] = info["version"], info["commit"]
    except Exception as e:  # noqa: BLE001 - reported, not raised: this is the diagnosis
        out["problems"].append(f"the library cannot be loaded: {e}")
    scripts = Path(sys.executable).parent / "tmsctl"
    out["tmsctl"] = str(scripts) if scripts.is_file() else shutil.which("tmsctl")
    return out


def main(pkg: ModuleType) -> int:
    """``python -m torch_memory_saver``: print the identity and the install check of ``pkg``
    (the package ``import torch_memory_saver`` gives, which may be another implementation's);
    1 where the install is not whole."""
    if getattr(pkg, "__implementation__", None) != IMPLEMENTATION:
        print(
            f"torch_memory_saver at {os.path.dirname(pkg.__file__ or '?')} is another implementation "
            f"(the original, version {getattr(pkg, '__version__', '?')}), with files of the Rust "
            f"implementation left in it. Fix: {_FIX}."
        )
        return 1
    d = describe(pkg.__version__)
    print(
        f"torch_memory_saver {d['version']}: the Rust implementation (Torch Memory Saver), "
        f"commit {d['commit'] or 'unknown'}"
    )
    print(f"package  {d['package']}")
    lib = d["library"] or "not found"
    if d["library_version"]:
        lib += f" (version {d['library_version']}, commit {d['commit'] or 'unknown'})"
    print(f"library  {lib}")
    print(f"tmsctl   {d['tmsctl'] or 'not found on PATH'}")
    if not d["problems"]:
        print("install  whole")
        return 0
    print("install  NOT whole:")
    for p in d["problems"]:
        print(f"  - {p}")
    print(f"Fix: {_FIX}.")
    return 1
