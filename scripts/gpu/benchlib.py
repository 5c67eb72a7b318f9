"""What the GPU benchmark scripts share: byte sizes and timing a call on the GPU."""

import time

import torch

GIB = float(1 << 30)
UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(s: str) -> int:
    """`16GiB`, `512m`, `4096`: a byte count (powers of 1024)."""
    s = s.strip().lower().removesuffix("ib").removesuffix("b")
    if s and s[-1] in UNITS:
        return int(s[:-1]) * UNITS[s[-1]]
    return int(s)


def timed(fn) -> float:
    """Seconds `fn()` takes, the device synchronized before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0
