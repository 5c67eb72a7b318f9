"""Torch mode: pools whose allocator is libtms.so's pluggable-allocator entry points."""

from __future__ import annotations

import threading
from typing import Any, Optional

from .. import binary_wrapper
from ..binary_wrapper import BinaryWrapper
from .base import HookUtilBase

__all__ = ["HookUtilModeTorch"]


class HookUtilModeTorch(HookUtilBase):
    hook_mode = "torch"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._allocator: Any = None

    def get_path_binary(self) -> Optional[str]:
        # A process that also preloads the library (under any name) keeps one instance of it.
        return binary_wrapper.preloaded_path() or binary_wrapper.bundled_library_path()

    def get_allocator(self) -> Any:
        """libtms.so's allocator, as ``torch.cuda.MemPool`` takes it (the existing library's
        contract: the ``CUDAPluggableAllocator``'s own ``allocator()``, made once)."""
        with self._lock:
            if self._allocator is None:
                from torch.cuda.memory import CUDAPluggableAllocator

                path = self.binary_wrapper().path
                self._allocator = CUDAPluggableAllocator(path, "tms_torch_malloc", "tms_torch_free")
            return self._allocator.allocator()

    def binary_wrapper(self) -> BinaryWrapper:
        return binary_wrapper.load(self.get_path_binary())
