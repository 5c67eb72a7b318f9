"""The interface of a hook mode."""

from __future__ import annotations

from typing import Any, Callable, Dict, Literal, Optional

from ..binary_wrapper import BinaryWrapper
from ..errors import InvalidArgumentError

__all__ = ["HOOK_MODES", "HookMode", "HookUtilBase"]

HOOK_MODES = ("preload", "torch")
HookMode = Literal["preload", "torch"]
"""The type of a hook mode's name (the existing library's name)."""

# What builds each builtin mode's object, by name, for HookUtilBase.create: filled by the package
# (hooks/__init__.py, which any import of this module runs first), as the modes import this module.
_MODES: Dict[str, Callable[[], "HookUtilBase"]] = {}


class HookUtilBase:
    """How one hook mode finds libtms.so and which allocator its pools use."""

    hook_mode: str = ""

    @staticmethod
    def create(hook_mode: str) -> "HookUtilBase":
        """The object of ``hook_mode`` (``"preload"`` or ``"torch"``)."""
        if hook_mode not in _MODES:
            raise InvalidArgumentError(f"hook_mode must be one of {HOOK_MODES}, not {hook_mode!r}")
        return _MODES[hook_mode]()

    def get_path_binary(self) -> Optional[str]:
        """Path of the libtms.so this mode uses (None where the loader found it by name)."""
        raise NotImplementedError

    def get_allocator(self) -> Any:
        """The allocator of this mode's pools, as ``torch.cuda.MemPool`` takes it (a
        ``torch._C._cuda_CUDAAllocator``), or None (the default) for PyTorch's own."""
        return None

    def binary_wrapper(self) -> BinaryWrapper:
        """The loaded library (raises :class:`LibraryNotFoundError` saying how to provide it)."""
        from .. import binary_wrapper

        return binary_wrapper.load(self.get_path_binary())
