"""``python -m torch_memory_saver``: which implementation is installed (this one: the Rust
implementation), its version, the commit its library was built from, where its files are, and
whether the install is whole. Exits 1 where it is not."""

import sys

import torch_memory_saver

from ._install import main

# The package is handed over, not imported by _install, which the package imports.
sys.exit(main(torch_memory_saver))
