"""Small helpers for tests of programs that use torch_memory_saver."""

from __future__ import annotations

import logging

__all__ = ["get_and_print_gpu_memory", "gpu_used_bytes"]

logger = logging.getLogger("torch_memory_saver")


def gpu_used_bytes(gpu_id: int = 0) -> int:
    """Bytes in use on device ``gpu_id`` as the driver counts them (every process's, not only
    PyTorch's cache): total minus free."""
    import torch

    torch.cuda.synchronize(gpu_id)
    free, total = torch.cuda.mem_get_info(gpu_id)
    return total - free


def get_and_print_gpu_memory(message: str, gpu_id: int = 0) -> int:
    """Print and return the bytes in use on device ``gpu_id`` (see :func:`gpu_used_bytes`)."""
    used = gpu_used_bytes(gpu_id)
    print(f"GPU {gpu_id} memory used: {used / (1 << 30):.3f} GiB ({message})", flush=True)
    return used
