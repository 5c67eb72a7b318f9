"""The basic example: two 1 GiB tensors in pauseable regions, one of them with a CPU backup.

pause() gives their 2 GiB back to the device, resume() takes it again at the same addresses;
the backed-up tensor comes back with identical contents, the other one's contents are
undefined until written again.

    python examples/simple.py [--hook-mode {preload,torch}]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import GiB, check, free_bytes, gib  # noqa: E402

import torch  # noqa: E402

from torch_memory_saver import torch_memory_saver  # noqa: E402


def main() -> None:
    _common.setup(__doc__)
    n = GiB

    # Each region's tensors come from a torch.cuda.MemPool of the region's own (in both hook
    # modes), so nothing cached from before is reused for them, and their blocks never serve
    # tensors made outside. Returning PyTorch's cache first only makes the numbers below clean.
    torch.cuda.empty_cache()
    free_start = free_bytes()

    with torch_memory_saver.region():  # tag "default", no backup
        a = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
    with torch_memory_saver.region(tag="kv", enable_cpu_backup=True):
        kv = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    kv_before = kv.cpu()
    ptrs = (a.data_ptr(), kv.data_ptr())

    free_alloc = free_bytes()
    print(f"allocated 2 x 1 GiB at {ptrs[0]:#x} and {ptrs[1]:#x}")
    check("the allocations took 2 GiB", free_start - free_alloc >= 0.99 * 2 * n, f"free fell by {gib(free_start - free_alloc)}")
    for tag in ("default", "kv"):
        st = _common.tag_stats(tag)
        check(
            f"tag {tag!r} holds a pauseable allocation of >= 1 GiB",
            st is not None and st["bytes_active"] >= n and st["allocations"] >= 1,
            f"{st['allocations']} allocation(s), {gib(st['bytes_active'])} active" if st else "no such tag in stats()",
        )

    torch_memory_saver.pause()
    free_paused = free_bytes()
    check(
        "pause() gave back >= 0.99 x 2 GiB",
        free_paused - free_alloc >= 0.99 * 2 * n,
        f"free {gib(free_alloc)} -> {gib(free_paused)} (+{gib(free_paused - free_alloc)})",
    )
    print(torch_memory_saver.summary())

    torch_memory_saver.resume()
    free_resumed = free_bytes()
    check(
        "resume() took the 2 GiB again",
        free_paused - free_resumed >= 0.99 * 2 * n,
        f"free {gib(free_paused)} -> {gib(free_resumed)} (-{gib(free_paused - free_resumed)})",
    )
    check("same addresses after resume", (a.data_ptr(), kv.data_ptr()) == ptrs)
    check("the backed-up tensor ('kv') is identical after resume", torch.equal(kv.cpu(), kv_before))
    # 'a' had no backup: its contents are undefined now. It is usable memory again, though.
    a.fill_(42)
    check("the tensor without backup is usable after resume", a.min().item() == 42 and a.max().item() == 42)

    print(torch_memory_saver.summary())
    _common.finish()


if __name__ == "__main__":
    main()
