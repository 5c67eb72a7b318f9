"""Pause/resume through PyTorch and the torch_memory_saver package, in one hook mode.

Usage: python3 bench_torch.py preload|torch TOTAL COUNT [--plain-only]
(preload mode needs LD_PRELOAD=libtms.so; scripts/bench runs both modes.)

Measures, with every byte verified on the GPU against a copy kept outside the regions:
- allocating pauseable tensors against plain PyTorch allocation of the same shapes;
- pause/resume with CPU backup (first pause into fresh host memory, retained cycles, a resume
  that releases host memory, and the share of that release), pinned and mmap, for one tensor of
  TOTAL and COUNT tensors of TOTAL/COUNT, and the process RSS before and after;
- pause/resume without backup of COUNT tensors (5 cycles, and their medians), against the
  median of 5 rounds of the bare VMM calls for the same sizes made from this process through
  ctypes and timed the same way (device synchronized before and after), and the engine's own
  time for each operation.
Limits: pinned copy bandwidth through PyTorch's own pinned memory, measured here; the fresh-fill
rate and the bare VMM call times from tms-bench in the same run (TMS_BENCH_LIMITS, JSON).
Prints a table; asserts nothing about time; exits 1 if contents differ.
"""

import ctypes
import json
import os
import statistics
import sys
import time

import torch
from torch_memory_saver import torch_memory_saver as tms

from benchlib import GIB, parse_bytes, timed


mode, total, count = sys.argv[1], parse_bytes(sys.argv[2]), int(sys.argv[3])
plain_only = sys.argv[4:] == ["--plain-only"]
limits = json.loads(os.environ.get("TMS_BENCH_LIMITS") or "{}")
tms.hook_mode = mode
rows = []
problems = []


def row(what: str, nbytes: int, seconds: float, vs: str = "") -> None:
    rate = nbytes / seconds / GIB if seconds > 0 else 0.0
    print(f"  {what:<52} {seconds:>9.4f} s {rate:>8.2f} GiB/s  {vs}", flush=True)
    rows.append((what, nbytes, seconds, rate, vs))


def pct(rate: float, limit, name: str) -> str:
    return f"{rate / limit * 100:.0f}% of {name}" if limit else ""


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def copy_limits():
    n = min(total, 4 << 30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h2d = min(timed(lambda: dev.copy_(host, non_blocking=True)) for _ in range(3))
    d2h = min(timed(lambda: host.copy_(dev, non_blocking=True)) for _ in range(3))
    del dev, host
    row("copy H2D from pinned memory (torch, best of 3)", n, h2d)
    row("copy D2H to pinned memory (torch, best of 3)", n, d2h)
    return n / h2d / GIB, n / d2h / GIB


def alloc_cost(size: int, n: int, reps: int = 3) -> None:
    """Median time to allocate n fresh tensors of size bytes, plain and pauseable."""
    plain, pauseable = [], []
    for k in range(reps):
        torch.cuda.empty_cache()
        ts = []
        plain.append(timed(lambda: ts.extend(torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(n))))
        del ts
        torch.cuda.empty_cache()
        tag = f"alloc-{size}-{k}"
        ts = []
        with tms.region(tag=tag):
            pauseable.append(
                timed(lambda: ts.extend(torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(n)))
            )
        del ts
        tms.pause(tag)  # give the device memory back; the pool keeps only address ranges
    p, q = statistics.median(plain), statistics.median(pauseable)
    what = f"{n} x {size / (1 << 20):.0f} MiB"
    row(f"allocate {what}, plain PyTorch", n * size, p)
    row(f"allocate {what}, pauseable ({mode})", n * size, q, f"{q / p:.2f}x plain")


def backup_scenario(backend: str, n: int, size: int, h2d: float, d2h: float) -> None:
    tag = f"{backend}-{n}"
    print(f"\n{backend} backup, {n} x {size / GIB:.3f} GiB", flush=True)
    with tms.region(tag=tag, enable_cpu_backup=True, cpu_backup_backend=backend):
        ts = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(n)]
    for t in ts:
        t.random_(0, 256)
    ref = [t.clone() for t in ts]
    nbytes = n * size
    fill = limits.get("fill_gib_s")

    def release_share() -> str:
        last = next(t for t in tms.stats()["tags"] if t["tag"] == tag)["last_resume"]
        return (
            f"release {last['release_seconds']:.4f} s of {last['seconds']:.4f} s "
            f"({last['release_seconds'] / max(last['seconds'], 1e-9) * 100:.0f}%)"
        )

    # Without retention: each pause takes fresh host memory, each resume gives it back.
    tms.retain_cpu_backup = False
    rss0 = rss()
    dt = timed(lambda: tms.pause(tag))
    row(f"{tag}: pause without retention (fresh memory)", nbytes, dt, pct(nbytes / dt / GIB, fill, "fresh fill"))
    dt = timed(lambda: tms.resume(tag))
    row(f"{tag}: resume without retention", nbytes, dt, pct(nbytes / dt / GIB, h2d, "pinned H2D"))
    rss1 = rss()
    print(
        f"  {release_share()}; RSS before the pause {rss0 / GIB:.2f} GiB, after the resume "
        f"{rss1 / GIB:.2f} GiB ({(rss1 - rss0) / rss0 * 100:+.1f}%)",
        flush=True,
    )
    tms.retain_cpu_backup = True
    dt = timed(lambda: tms.pause(tag))
    paused_at = time.perf_counter()
    row(f"{tag}: first pause (fresh host memory)", nbytes, dt, pct(nbytes / dt / GIB, fill, "fresh fill"))
    dt = timed(lambda: tms.resume(tag))
    row(f"{tag}: resume #1 right after, retained", nbytes, dt, pct(nbytes / dt / GIB, h2d, "pinned H2D"))
    if backend == "pinned":
        # Retained pinned backups are page-locked in the background; later cycles copy them
        # straight. Wait for it, as a workload that does not pause again at once would.
        while time.perf_counter() - paused_at < 120:
            t = next(t for t in tms.stats()["tags"] if t["tag"] == tag)
            if t["host_pinned_bytes"] >= t["host_backup_bytes"]:
                break
            time.sleep(0.05)
        print(f"  background page-locking done {time.perf_counter() - paused_at:.2f} s after the first pause", flush=True)
    for cycle in (2, 3):
        for t in ts:  # new contents each cycle, so a stale backup cannot pass
            t.add_(1)
        for r in ref:
            r.add_(1)
        dt = timed(lambda: tms.pause(tag))
        row(f"{tag}: pause #{cycle}, retained", nbytes, dt, pct(nbytes / dt / GIB, d2h, "pinned D2H"))
        dt = timed(lambda: tms.resume(tag))
        row(f"{tag}: resume #{cycle}, retained", nbytes, dt, pct(nbytes / dt / GIB, h2d, "pinned H2D"))
    tms.pause(tag)
    tms.retain_cpu_backup = False
    dt = timed(lambda: tms.resume(tag))
    row(f"{tag}: resume, retention turned off", nbytes, dt, pct(nbytes / dt / GIB, h2d, "pinned H2D"))
    rss2 = rss()
    print(f"  {release_share()}; RSS after {rss2 / GIB:.2f} GiB ({(rss2 - rss0) / rss0 * 100:+.1f}%)", flush=True)
    for i, (t, r) in enumerate(zip(ts, ref)):
        if not torch.equal(t, r):
            problems.append(f"{tag}: tensor {i} differs after the cycles")
    del ts, ref


class _Prop(ctypes.Structure):
    """CUmemAllocationProp: pinned device memory on one device."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("handle_types", ctypes.c_int),
        ("loc_type", ctypes.c_int),
        ("loc_id", ctypes.c_int),
        ("win32", ctypes.c_void_p),
        ("flags", ctypes.c_ubyte * 8),
    ]


class _Access(ctypes.Structure):
    """CUmemAccessDesc."""

    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def bare_vmm(n: int, size: int, reps: int = 5):
    """Median seconds over reps of the bare driver calls a pause and a resume without backup make
    for n allocations of size bytes (unmap+release; create+map+access), from this process, timed
    like the library's calls (device synchronized before and after)."""
    cu = ctypes.CDLL("libcuda.so.1")
    u64 = ctypes.c_uint64

    def ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA error {rc}")

    dev = torch.cuda.current_device()
    prop = _Prop(type=1, handle_types=0, loc_type=1, loc_id=dev)
    access = _Access(loc_type=1, loc_id=dev, flags=3)
    g = 2 << 20
    mapped = -(-size // g) * g
    ptrs = []
    for _ in range(n):
        p = u64()
        ok(cu.cuMemAddressReserve(ctypes.byref(p), u64(mapped), u64(0), u64(0), u64(0)), "cuMemAddressReserve")
        ptrs.append(p.value)
    handles = [u64() for _ in range(n)]

    def create_map():
        for p, h in zip(ptrs, handles):
            ok(cu.cuMemCreate(ctypes.byref(h), u64(mapped), ctypes.byref(prop), u64(0)), "cuMemCreate")
            ok(cu.cuMemMap(u64(p), u64(mapped), u64(0), h, u64(0)), "cuMemMap")
            ok(cu.cuMemSetAccess(u64(p), u64(mapped), ctypes.byref(access), u64(1)), "cuMemSetAccess")

    def unmap_release():
        for p, h in zip(ptrs, handles):
            ok(cu.cuMemUnmap(u64(p), u64(mapped)), "cuMemUnmap")
            ok(cu.cuMemRelease(h), "cuMemRelease")

    maps, unmaps = [], []
    try:
        for _ in range(reps):
            maps.append(timed(create_map))
            unmaps.append(timed(unmap_release))
    finally:
        for p in ptrs:
            cu.cuMemAddressFree(u64(p), u64(mapped))
    return statistics.median(unmaps), statistics.median(maps)


def plain_scenario(n: int, size: int) -> None:
    print(f"\nno backup, {n} x {size / (1 << 20):.0f} MiB", flush=True)
    with tms.region(tag="plain"):
        ts = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(n)]
    nbytes = n * size
    bare_unmap, bare_map = bare_vmm(n, size)
    row(f"bare unmap+release, {n} allocs (here, median of 5)", nbytes, bare_unmap)
    row(f"bare create+map+access, {n} allocs (here, median of 5)", nbytes, bare_map)
    same_count = limits.get("count") == n

    def vs(dt: float, here: float, engine: float, limit_key: str) -> str:
        out = f"{dt / here:.2f}x bare here; engine {engine:.4f} s"
        if same_count and limits.get(limit_key):
            out += f", {engine / limits[limit_key]:.2f}x tms-bench bare"
        return out

    def engine_s(op: str) -> float:
        return next(t for t in tms.stats()["tags"] if t["tag"] == "plain")[op]["seconds"]

    pauses, resumes = [], []
    for cycle in (1, 2, 3, 4, 5):
        dt = timed(lambda: tms.pause("plain"))
        pauses.append(dt)
        row(f"plain: pause #{cycle}", nbytes, dt, vs(dt, bare_unmap, engine_s("last_pause"), "vmm_unmap_s"))
        dt = timed(lambda: tms.resume("plain"))
        resumes.append(dt)
        row(f"plain: resume #{cycle}", nbytes, dt, vs(dt, bare_map, engine_s("last_resume"), "vmm_map_s"))
    p, r = statistics.median(pauses), statistics.median(resumes)
    row("plain: pause, median of 5 cycles", nbytes, p, f"{p / bare_unmap:.2f}x bare here (median)")
    row("plain: resume, median of 5 cycles", nbytes, r, f"{r / bare_map:.2f}x bare here (median)")
    del ts


def main() -> int:
    print(f"torch bench, hook mode {mode}: torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    torch.empty(1, device="cuda")
    with tms.region(tag="warm-up"):
        torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    if not plain_only:
        h2d, d2h = copy_limits()
        alloc_cost(32 << 20, min(count, 256))
        alloc_cost(1 << 20, 2048)
        for backend in ("pinned", "mmap"):
            for n in (1, count):
                backup_scenario(backend, n, total // n, h2d, d2h)
    plain_scenario(count, total // count)
    print(f"\nTORCH BENCH TABLE ({mode} mode)")
    print(f"{'what':<52} {'GiB':>8} {'seconds':>10} {'GiB/s':>8}  vs limit")
    for what, nbytes, seconds, rate, vs in rows:
        print(f"{what:<52} {nbytes / GIB:>8.2f} {seconds:>10.4f} {rate:>8.2f}  {vs}")
    for p in problems:
        print(f"PROBLEM {p}")
    print("torch bench OK (contents verified)" if not problems else "torch bench FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
