"""The package's identity and its install check (issue 35, item 3): ``python -m
torch_memory_saver`` names the implementation, version and commit; ``__implementation__`` says
which implementation is imported; an install where another one (the original, which shares the
distribution name) replaced some files says so at import and in ``python -m``, instead of
half-working. Installs are built in a temporary site folder from this package's files."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch_memory_saver as tms_pkg

from conftest import clean_env

STEMS = [f"torch_memory_saver_hook_mode_{m}{c}" for m in ("preload", "torch") for c in ("", "_cu12", "_cu13")]


def _site(tmp_path: Path) -> Path:
    """A site folder holding a whole install: the package's Python files, its library inside,
    and copies under the original's names beside it."""
    site = tmp_path / "site"
    pkg = site / "torch_memory_saver"
    src = Path(tms_pkg.__file__).parent
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    lib = tms_pkg.get_binary_path()
    shutil.copyfile(lib, pkg / "libtms.abi3.so")
    for stem in STEMS:
        shutil.copyfile(lib, site / f"{stem}.abi3.so")
    return site


def _py(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = clean_env(PYTHONPATH=str(site))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=60, cwd=site)


def test_the_implementation_is_named_in_code():
    assert tms_pkg.__implementation__ == "rust"


def test_python_m_names_implementation_version_and_commit():
    r = subprocess.run([sys.executable, "-m", "torch_memory_saver"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith(f"torch_memory_saver {tms_pkg.__version__}: the Rust implementation"), first
    commit = re.search(r"commit (\S+)$", first)
    assert commit and re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", commit.group(1)), first
    assert f"library  {tms_pkg.get_binary_path()}" in r.stdout, r.stdout
    assert "install  whole" in r.stdout, r.stdout


def test_a_whole_install_imports_without_a_warning(tmp_path):
    site = _site(tmp_path)
    r = _py(site, "-W", "error::RuntimeWarning", "-c", "import torch_memory_saver as t; print(t.__file__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(site)), r.stdout
    m = _py(site, "-m", "torch_memory_saver")
    assert m.returncode == 0 and "install  whole" in m.stdout, m.stdout + m.stderr


def test_the_originals_library_beside_the_package_is_named_at_import(tmp_path):
    site = _site(tmp_path)
    theirs = site / "torch_memory_saver_hook_mode_preload.abi3.so"
    theirs.write_bytes(b"\x7fELF another library")
    r = _py(site, "-c", "import torch_memory_saver")
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" in r.stderr and "not installed whole" in r.stderr, r.stderr
    assert str(theirs) in r.stderr and "LD_PRELOAD" in r.stderr and "force-reinstall" in r.stderr, r.stderr
    m = _py(site, "-m", "torch_memory_saver")
    assert m.returncode == 1 and "NOT whole" in m.stdout and str(theirs) in m.stdout, m.stdout


def test_a_missing_library_is_named_at_import(tmp_path):
    site = _site(tmp_path)
    (site / "torch_memory_saver" / "libtms.abi3.so").unlink()
    r = _py(site, "-c", "import torch_memory_saver")
    assert "libtms*.so) is missing" in r.stderr, r.stderr


def test_the_originals_python_files_over_ours_are_named(tmp_path):
    site = _site(tmp_path)
    # The original's package has no __implementation__ (nor a __main__ of its own: ours is left).
    (site / "torch_memory_saver" / "__init__.py").write_text("__version__ = '0.0.9'\n")
    m = _py(site, "-m", "torch_memory_saver")
    assert m.returncode == 1, m.stdout + m.stderr
    assert "is another implementation" in m.stdout and "0.0.9" in m.stdout, m.stdout


def test_an_install_record_of_another_package_is_named(tmp_path):
    site = _site(tmp_path)
    record = site / "torch_memory_saver-0.0.9.dist-info"
    record.mkdir()
    (record / "RECORD").write_text("torch_memory_saver/__init__.py,,\n")
    m = _py(site, "-m", "torch_memory_saver")
    assert m.returncode == 1 and "torch_memory_saver-0.0.9.dist-info is another package's" in m.stdout, m.stdout
