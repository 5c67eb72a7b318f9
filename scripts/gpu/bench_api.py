"""Pause and resume through the public torch_memory_saver API only, so that the same script
times this package and the original one side by side (each in a process of its own, found on
the import path).

Usage: python3 bench_api.py LABEL TOTAL COUNT [--disk DIR [--disk-total BYTES] [--disk-count N]]
       [--mode torch|preload]

For one tensor of TOTAL and COUNT tensors of TOTAL/COUNT, in a region with a CPU backup (the
default backend, no retention): three pause/resume cycles, the first pause into fresh host
memory; with --disk, one tensor of --disk-total and --disk-count tensors (default: TOTAL and
COUNT) in a region with a disk backup in DIR, two cycles. Every cycle's contents are compared
on the GPU with a copy kept outside the regions. A scenario the package lacks (an unknown
argument, say) is reported as such. Prints `API_ROW` lines (label,
scenario, seconds, GiB/s) and exits 1 if contents differed or a run failed; asserts nothing
about time. `--mode preload` needs the package's preload library in LD_PRELOAD.
"""

import argparse
import sys

import torch

from benchlib import GIB, parse_bytes, timed


class Bench:
    def __init__(self, label: str, saver):
        self.label, self.saver = label, saver
        self.problems = []

    def row(self, what: str, nbytes: int, seconds: float) -> None:
        print(f"API_ROW {self.label} | {what} | {seconds:.4f} s | {nbytes / seconds / GIB:.2f} GiB/s",
              flush=True)

    def scenario(self, name: str, n: int, size: int, cycles: int, **region) -> None:
        tag = f"{name}-{n}"
        saver = self.saver
        try:
            with saver.region(tag=tag, **region):
                tensors = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(n)]
        except (TypeError, ValueError, NotImplementedError, AttributeError) as e:
            print(f"API_ROW {self.label} | {tag} | not offered: {type(e).__name__}: {e}", flush=True)
            return
        # Reference copies outside every region, filled from one random source.
        refs = []
        for i, t in enumerate(tensors):
            g = torch.Generator(device="cuda").manual_seed(i + 1)
            t.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=g))
            refs.append(t.clone())
        total = n * size
        for c in range(1, cycles + 1):
            first = " (fresh host memory)" if c == 1 and "enable_cpu_backup" in region else ""
            self.row(f"{tag}: pause #{c}{first}", total, timed(lambda: saver.pause(tag)))
            self.row(f"{tag}: resume #{c}", total, timed(lambda: saver.resume(tag)))
            bad = sum(1 for t, r in zip(tensors, refs) if not torch.equal(t, r))
            if bad:
                self.problems.append(f"{tag} cycle {c}: {bad} of {n} tensors differ")
        del tensors, refs
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("label")
    p.add_argument("total", type=parse_bytes)
    p.add_argument("count", type=int)
    p.add_argument("--disk")
    p.add_argument("--disk-total", type=parse_bytes)
    p.add_argument("--disk-count", type=int)
    p.add_argument("--mode", default="torch", choices=["torch", "preload"])
    a = p.parse_args()
    from torch_memory_saver import torch_memory_saver as saver

    saver.hook_mode = a.mode
    b = Bench(a.label, saver)
    import torch_memory_saver

    print(f"{a.label}: torch_memory_saver from {torch_memory_saver.__file__}, {a.mode} mode",
          flush=True)
    # A warm-up: the first pause of a process also loads the library and makes its streams.
    b.scenario("warm-up", 1, 64 << 20, 1, enable_cpu_backup=True)
    shapes = [(1, a.total), (a.count, a.total // a.count)]
    for n, size in shapes:
        b.scenario("cpu", n, size, 3, enable_cpu_backup=True)
    if a.disk:
        try:
            saver.set_disk_backup_dir(a.disk)
        except AttributeError as e:
            print(f"API_ROW {a.label} | disk | not offered: {e}", flush=True)
        else:
            total, count = a.disk_total or a.total, a.disk_count or a.count
            for n, size in [(1, total), (count, total // count)]:
                b.scenario("disk", n, size, 2, enable_disk_backup=True)
    for m in b.problems:
        print(f"PROBLEM {a.label}: {m}", flush=True)
    print(f"{a.label}: {'FAIL' if b.problems else 'OK'} (contents compared after every resume)")
    return 1 if b.problems else 0


if __name__ == "__main__":
    sys.exit(main())
