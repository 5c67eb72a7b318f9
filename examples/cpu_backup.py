"""CPU backups: both backends ("pinned": page-locked once retained, "mmap": pageable memory),
get_cpu_backup() (a copy, or a zero-copy view of the backup itself), and retention.

For each backend, a uint8 and a float32 tensor (256 MiB each) in a region with a backup:
  - no backup exists before the first pause (get_cpu_backup returns None);
  - paused: get_cpu_backup(t) and get_cpu_backup(t, zero_copy=True) equal the contents, with
    t's dtype and shape, also for a slice inside the tensor;
  - resumed: identical contents, same address; without retention the backup is gone (None);
  - retain_cpu_backup = True: after resume the backup is still there (not None); new contents,
    a second pause reuses the same host buffer and holds the new contents, resume restores them;
  - retain_cpu_backup = False again: after the next resume the backup is gone.
Then: a tag without backup has no backup while paused; get_cpu_backup of a tensor outside any
region returns None (as the existing library does); a non-contiguous tensor raises
InvalidArgumentError (a ValueError).

    python examples/cpu_backup.py [--hook-mode {preload,torch}]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import MiB, check, free_bytes, gib  # noqa: E402

import torch  # noqa: E402

import torch_memory_saver as tms_pkg  # noqa: E402
from torch_memory_saver import torch_memory_saver  # noqa: E402

SIZE = 256 * MiB  # per tensor; a multiple of 2 MiB above 10 MiB: a segment of exactly its size


def allocate(tag: str, **region_kwargs):
    with torch_memory_saver.region(tag=tag, **region_kwargs):
        u8 = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        f32 = torch.empty((4096, SIZE // (4096 * 4)), dtype=torch.float32, device="cuda")
    ts = {"u8": u8, "f32": f32}
    refill(ts)
    return ts


def refill(tensors) -> None:
    """New random contents, in place (no allocation)."""
    tensors["u8"].random_(0, 256)
    tensors["f32"].normal_()


def snapshot(tensors):
    return {name: t.cpu() for name, t in tensors.items()}


def backups_equal(tensors, refs, zero_copy=False) -> bool:
    for name, t in tensors.items():
        b = torch_memory_saver.get_cpu_backup(t, zero_copy=zero_copy)
        if b is None or b.device.type != "cpu" or b.dtype != t.dtype or b.shape != t.shape:
            return False
        if not torch.equal(b, refs[name]):
            return False
        del b  # a zero-copy view must not outlive the backup (gone at resume without retention)
    return True


def contents_equal(tensors, refs) -> bool:
    return all(torch.equal(t.cpu(), refs[name]) for name, t in tensors.items())


def host_bytes(tag: str) -> int:
    st = _common.tag_stats(tag)
    return st["host_backup_bytes"] if st else 0


def pause_measured(tag: str, expected: int, label: str) -> None:
    f0 = free_bytes()
    torch_memory_saver.pause(tag)
    f1 = free_bytes()
    check(f"{label} pause gave back the tensors' memory", f1 - f0 >= 0.99 * expected, f"+{gib(f1 - f0)} of {gib(expected)}")


def run_backend(backend: str) -> None:
    tag = f"backup_{backend}"
    lb = f"[{backend}]"
    print(f"\n== backend {backend!r} (tag {tag!r})")
    ts = allocate(tag, enable_cpu_backup=True, cpu_backup_backend=backend)
    nbytes = sum(t.numel() * t.element_size() for t in ts.values())
    ptrs = {name: t.data_ptr() for name, t in ts.items()}
    refs = snapshot(ts)

    check(f"{lb} no backup before the first pause", all(torch_memory_saver.get_cpu_backup(t) is None for t in ts.values()))

    # -- pause: the backup holds the contents
    pause_measured(tag, nbytes, lb)
    check(f"{lb} paused: host backup of the tag's size", host_bytes(tag) >= nbytes, f"{gib(host_bytes(tag))}")
    check(f"{lb} paused: get_cpu_backup(t) (a copy) equals the contents", backups_equal(ts, refs))
    check(f"{lb} paused: get_cpu_backup(t, zero_copy=True) equals the contents", backups_equal(ts, refs, zero_copy=True))
    flat = ts["f32"].view(-1)
    lo, hi = 123_457, 123_457 + 10_000  # a range strictly inside the allocation
    part = torch_memory_saver.get_cpu_backup(flat[lo:hi])
    check(
        f"{lb} paused: get_cpu_backup of a slice equals that slice",
        part is not None and part.shape == (hi - lo,) and torch.equal(part, refs["f32"].view(-1)[lo:hi]),
    )
    copy_kept = torch_memory_saver.get_cpu_backup(ts["u8"])  # a copy: stays valid after resume

    # -- resume without retention
    torch_memory_saver.resume(tag)
    check(f"{lb} resumed: same addresses", {n: t.data_ptr() for n, t in ts.items()} == ptrs)
    check(f"{lb} resumed: contents identical", contents_equal(ts, refs))
    check(
        f"{lb} resumed without retention: get_cpu_backup returns None, no host memory held",
        all(torch_memory_saver.get_cpu_backup(t) is None for t in ts.values()) and host_bytes(tag) == 0,
        f"host {gib(host_bytes(tag))}",
    )
    check(f"{lb} a copy taken while paused outlives the resume", torch.equal(copy_kept, refs["u8"]))
    del copy_kept

    # -- retention on: the backup stays across resume and is reused by the next pause
    torch_memory_saver.retain_cpu_backup = True
    check(f"{lb} retain_cpu_backup reads back True", torch_memory_saver.retain_cpu_backup is True)
    pause_measured(tag, nbytes, f"{lb} retained:")
    torch_memory_saver.resume(tag)
    check(f"{lb} retained: contents identical after resume", contents_equal(ts, refs))
    kept = torch_memory_saver.get_cpu_backup(ts["u8"])
    check(f"{lb} retained: get_cpu_backup after resume is not None", kept is not None)
    check(
        f"{lb} retained: it holds the contents as of the last pause",
        kept is not None and torch.equal(kept, refs["u8"]),
    )
    del kept
    held = host_bytes(tag)
    check(f"{lb} retained: host memory still held after resume", held >= nbytes, gib(held))

    refill(ts)  # new contents; the next pause must back these up
    refs2 = snapshot(ts)
    pause_measured(tag, nbytes, f"{lb} retained, 2nd:")
    check(f"{lb} retained, 2nd pause: backup holds the new contents", backups_equal(ts, refs2))
    check(f"{lb} retained, 2nd pause: the host buffer was reused (no more host memory)", host_bytes(tag) == held,
          f"{gib(host_bytes(tag))} vs {gib(held)}")
    torch_memory_saver.resume(tag)
    check(f"{lb} retained, 2nd resume: new contents identical", contents_equal(ts, refs2))

    # -- retention off again: consulted at resume, so the backup goes at the next resume
    torch_memory_saver.retain_cpu_backup = False
    check(f"{lb} retain_cpu_backup reads back False", torch_memory_saver.retain_cpu_backup is False)
    torch_memory_saver.pause(tag)
    torch_memory_saver.resume(tag)
    check(f"{lb} retention off: contents identical after pause/resume", contents_equal(ts, refs2))
    check(
        f"{lb} retention off: get_cpu_backup returns None after resume, no host memory held",
        all(torch_memory_saver.get_cpu_backup(t) is None for t in ts.values()) and host_bytes(tag) == 0,
    )

    # Done with them: their blocks go back to the region's pool (still pauseable and tagged,
    # only ever reused by tensors of that region).
    del ts, flat


def expect_raises(label: str, fn, classes) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        ok = all(isinstance(e, c) for c in classes)
        check(label, ok, f"{type(e).__name__}: {e}")
    else:
        check(label, False, "no exception")


def main() -> None:
    _common.setup(__doc__)
    torch.manual_seed(0)
    if "TMS_RETAIN_CPU_BACKUP" not in os.environ:
        check("retain_cpu_backup is off by default", torch_memory_saver.retain_cpu_backup is False)
    torch_memory_saver.retain_cpu_backup = False
    for backend in ("pinned", "mmap"):
        run_backend(backend)

    print("\n== a tag without backup")
    ts = allocate("no_backup")
    torch_memory_saver.pause("no_backup")
    check("paused without backup: get_cpu_backup returns None",
          all(torch_memory_saver.get_cpu_backup(t) is None for t in ts.values()))
    torch_memory_saver.resume("no_backup")
    check("resumed without backup: get_cpu_backup returns None",
          all(torch_memory_saver.get_cpu_backup(t) is None for t in ts.values()))

    print("\n== errors")
    outside = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # ordinary memory, no region
    # Nothing to back up, as the existing library answers (integrations fall back on None).
    check(
        "get_cpu_backup of a tensor outside any region returns None",
        torch_memory_saver.get_cpu_backup(outside) is None
        and torch_memory_saver.get_cpu_backup(outside, zero_copy=True) is None,
    )
    expect_raises(
        "get_cpu_backup of a non-contiguous tensor raises InvalidArgumentError (ValueError)",
        lambda: torch_memory_saver.get_cpu_backup(ts["f32"][:, ::2]),
        (tms_pkg.InvalidArgumentError, tms_pkg.TorchMemorySaverError, ValueError),
    )
    expect_raises(
        "get_cpu_backup of something that is not a tensor raises TypeError",
        lambda: torch_memory_saver.get_cpu_backup(b"bytes"),
        (TypeError,),
    )

    print()
    print(torch_memory_saver.summary())
    _common.finish()


if __name__ == "__main__":
    main()
