"""The Python distribution takes its version from the Cargo workspace ([workspace.package] in
Cargo.toml), so the wheel, the crates and `tmsctl --version` never disagree. Everything else is
declared in pyproject.toml."""

import sys
from pathlib import Path

from setuptools import setup

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

cargo = tomllib.loads((Path(__file__).resolve().parent / "Cargo.toml").read_text(encoding="utf-8"))
setup(version=cargo["workspace"]["package"]["version"])
