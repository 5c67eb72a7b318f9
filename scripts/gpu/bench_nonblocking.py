#!/usr/bin/env python3
"""The non-blocking resume against the blocking one, on a GPU: `bench_nonblocking.py [GIB] [COUNTS]`.

For each hook mode (preload, torch) and each allocation count (default 1 and 512) of GIB GiB
(default 16) with a pinned CPU backup, resumed without retention: how long until the call
returns, until a first kernel on the first restored tensor has completed, and until every byte
has landed, for
  - blocking       resume(tag), then the kernel on the current stream;
  - non-blocking   resume(tag, non_blocking=True, order=[first]), the kernel on the current
                   stream (which waits for the whole restore);
  - first-tensor   the same, the kernel on a side stream made to wait for the first tensor only
                   (wait(first, stream=side)).
Also the machine's limit measured in the same run: pinned host-to-device copy of the same bytes.
Each scenario runs 3 times; the best is printed. Contents are checked; times are reported,
never asserted. Exits 1 if a run failed. Uses the installed torch_memory_saver.
"""
import json
import os
import subprocess
import sys
import textwrap

import torch_memory_saver

CHILD = r"""
import json, os, sys, time, torch
from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = os.environ["TEST_HOOK_MODE"]
total, count, rounds = int(sys.argv[1]), int(sys.argv[2]), 3
size = total // count
torch.cuda.init()
with tms.region(tag="b", enable_cpu_backup=True):
    ts = [torch.full((size,), i % 250 + 1, dtype=torch.uint8, device="cuda") for i in range(count)]
torch.cuda.synchronize()
first = ts[0]
probe = first[: 1 << 20]
def kernel_done(stream):
    with torch.cuda.stream(stream):
        x = probe.sum(dtype=torch.int64)
        ev = torch.cuda.Event()
        ev.record(stream)
    ev.synchronize()
    return x
out = {}
for scenario in ("blocking", "non-blocking", "first-tensor"):
    best = None
    for _ in range(rounds):
        tms.pause("b")
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        cur = torch.cuda.current_stream()
        t0 = time.perf_counter()
        if scenario == "blocking":
            tms.resume("b")
            t_ret = time.perf_counter()
            x = kernel_done(cur)
        else:
            tms.resume("b", non_blocking=True, order=[first])
            t_ret = time.perf_counter()
            if scenario == "first-tensor":
                tms.wait(first, stream=side)
                x = kernel_done(side)
            else:
                x = kernel_done(cur)
        t_kernel = time.perf_counter()
        tms.wait()
        torch.cuda.synchronize()
        t_all = time.perf_counter()
        assert int(x) == probe.numel(), int(x)   # the first tensor holds ones: it had landed
        row = (t_ret - t0, t_kernel - t0, t_all - t0)
        best = row if best is None or row[1] < best[1] else best
    out[scenario] = best
for i, t in enumerate(ts):
    assert int(t[:4096].sum()) == (i % 250 + 1) * 4096, i
# The limit: the same bytes from page-locked host memory, in 1 GiB copies.
h = torch.empty(min(total, 1 << 30), dtype=torch.uint8).pin_memory()
d = torch.empty_like(h, device="cuda")
d.copy_(h, non_blocking=True); torch.cuda.synchronize()
t0 = time.perf_counter()
left = total
while left > 0:
    n = min(left, h.numel())
    d[:n].copy_(h[:n], non_blocking=True)
    left -= n
torch.cuda.synchronize()
out["link"] = time.perf_counter() - t0
print("RESULT " + json.dumps(out))
"""


def main():
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 16
    counts = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 512]
    total = int(gib * (1 << 30))
    lib = torch_memory_saver.get_binary_path()
    failed = False
    print(f"non-blocking resume, {gib:g} GiB, pinned backup, no retention; best of 3 (seconds)")
    print(f"{'mode':<8} {'allocs':>6} {'scenario':<13} {'returned':>9} {'1st kernel':>10} {'all landed':>10}   link")
    for mode in ("preload", "torch"):
        for count in counts:
            env = {**os.environ, "TEST_HOOK_MODE": mode, "PYTHONUNBUFFERED": "1"}
            if mode == "preload":
                env["LD_PRELOAD"] = lib
            p = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(total), str(count)],
                               env=env, capture_output=True, text=True, timeout=900)
            line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                failed = True
                print(f"{mode} {count}: FAILED ({p.returncode})\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
                continue
            r = json.loads(line[7:])
            for s in ("blocking", "non-blocking", "first-tensor"):
                ret, ker, landed = r[s]
                print(f"{mode:<8} {count:>6} {s:<13} {ret:>9.4f} {ker:>10.4f} {landed:>10.4f}   {r['link']:.4f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
