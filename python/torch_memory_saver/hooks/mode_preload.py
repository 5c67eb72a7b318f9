"""Preload mode: libtms.so is in ``LD_PRELOAD`` and interposes ``cudaMalloc``."""

from __future__ import annotations

import os
from typing import Any, Optional

from .. import binary_wrapper
from ..binary_wrapper import BinaryWrapper
from ..errors import LibraryNotFoundError, UnsupportedError
from .base import HookUtilBase

__all__ = ["HookUtilModePreload"]


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
