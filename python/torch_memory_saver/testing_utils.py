"""Small helpers for tests of programs that use torch_memory_saver (the names the existing
library's tests import: ``is_xpu``, ``get_device``, ``empty_cache``,
``get_and_print_gpu_memory``)."""

from __future__ import annotations

import logging
from typing import Any

from .utils import is_xpu

__all__ = ["empty_cache", "get_and_print_gpu_memory", "get_device", "gpu_used_bytes", "is_xpu"]

logger = logging.getLogger("torch_memory_saver")


def _device_module() -> Any:
    """``torch.xpu`` on an Intel XPU, else ``torch.cuda``."""
    import torch

    return torch.xpu if is_xpu() else torch.cuda


def get_device() -> str:
    """The accelerator's device type for ``torch.empty(..., device=get_device())``: ``"xpu"``
    on an Intel XPU, else ``"cuda"`` (also on ROCm, where PyTorch calls HIP devices cuda)."""
    return "xpu" if is_xpu() else "cuda"


def empty_cache() -> None:
    """Give the accelerator memory PyTorch caches but no tensor uses back to the device."""
    _device_module().empty_cache()


def gpu_used_bytes(gpu_id: int = 0) -> int:
    """Bytes in use on device ``gpu_id`` as the driver counts them (every process's, not only
    PyTorch's cache): total minus free, after the device's queued work has finished."""
    module = _device_module()
    module.synchronize(gpu_id)
    free, total = module.mem_get_info(gpu_id)
    return total - free


def get_and_print_gpu_memory(message: str, gpu_id: int = 0) -> int:
    """Print and return the bytes in use on device ``gpu_id`` (see :func:`gpu_used_bytes`)."""
    used = gpu_used_bytes(gpu_id)
    print(f"GPU {gpu_id} memory used: {used / (1 << 30):.3f} GiB ({message})", flush=True)
    return used
