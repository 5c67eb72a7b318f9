"""``python -m torch_memory_saver``: which implementation is installed (this one: the Rust
implementation), its version, the commit its library was built from, where its files are, and
whether the install is whole. Exits 1 where it is not."""

import sys

from ._install import main

sys.exit(main())
