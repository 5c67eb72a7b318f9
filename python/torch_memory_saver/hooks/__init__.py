"""Hook modes: how allocations reach libtms.so.

- ``preload`` (:class:`~.mode_preload.HookUtilModePreload`): the process runs with libtms.so in
  ``LD_PRELOAD``, which interposes ``cudaMalloc``; PyTorch's own allocator is used.
- ``torch`` (:class:`~.mode_torch.HookUtilModeTorch`): no preload; pools whose allocator is
  libtms.so's pluggable-allocator entry points (``torch.cuda.memory.CUDAPluggableAllocator``).

``HookUtilBase.create(hook_mode)`` gives the object of a mode; an integration may subclass
:class:`~.base.HookUtilBase` to route allocations elsewhere, or register a mode of its own whose
implementation takes every call (``torch_memory_saver.register_hook_mode``).
"""

from . import base, mode_preload, mode_torch
from .base import HOOK_MODES, HookMode, HookUtilBase
from .mode_preload import HookUtilModePreload
from .mode_torch import HookUtilModeTorch

# What HookUtilBase.create builds for each builtin mode: the class its module holds at the call
# (so a patch of, say, ``mode_torch.HookUtilModeTorch`` applies). Listed here, as base cannot
# import the modes, which import it.
base._MODES.update(
    preload=lambda: mode_preload.HookUtilModePreload(),
    torch=lambda: mode_torch.HookUtilModeTorch(),
)

__all__ = ["HOOK_MODES", "HookMode", "HookUtilBase", "HookUtilModePreload", "HookUtilModeTorch"]
