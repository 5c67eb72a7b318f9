"""An unmodified PyTorch program for scripts/gpu/ctl_check.sh: it knows nothing about
torch_memory_saver. Run it with LD_PRELOAD=libtms.so TMS_INIT_ENABLE=1
TMS_INIT_ENABLE_CPU_BACKUP=1, so every cudaMalloc is pauseable with a CPU backup.

It allocates GIB tensors of 1 GiB with known contents (each row of each tensor its own byte)
plus 64 MiB of random bytes, writes <dir>/ready.json ({"pid", "gib", "ptrs"}), then waits,
touching nothing on the GPU, until <dir>/go exists (meanwhile tmsctl pauses and resumes it
from outside). Then it checks every tensor (same address, same contents) and exits 0 with
"VERIFY OK", or 1 with "VERIFY FAILED ...".
"""

import argparse
import json
import os
import sys
import time

import torch

ROWS = 1024


def row_values(i, device):
    v = (torch.arange(ROWS, dtype=torch.int64) * 31 + i * 7) % 251 + 1
    return v.to(torch.uint8).to(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=20)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--wait", type=float, default=1800.0, help="seconds to wait for <dir>/go")
    a = ap.parse_args()

    n = 1 << 30
    tensors, values = [], []
    t0 = time.time()
    for i in range(a.gib):
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        v = row_values(i, "cuda")
        t.view(ROWS, -1).copy_(v.view(ROWS, 1).expand(ROWS, n // ROWS))
        tensors.append(t)
        values.append(v)
    rand = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
    rand_host = rand.cpu()
    torch.cuda.synchronize()
    ptrs = [t.data_ptr() for t in tensors]
    print(f"holder: {a.gib} GiB allocated and filled in {time.time() - t0:.1f} s", flush=True)

    tmp = os.path.join(a.dir, "ready.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "gib": a.gib, "ptrs": ptrs}, f)
    os.rename(tmp, os.path.join(a.dir, "ready.json"))

    go = os.path.join(a.dir, "go")
    deadline = time.time() + a.wait
    while not os.path.exists(go):
        if time.time() > deadline:
            print("VERIFY FAILED: never told to verify", flush=True)
            return 1
        time.sleep(0.2)

    torch.cuda.synchronize()
    bad = []
    for i, (t, v) in enumerate(zip(tensors, values)):
        if t.data_ptr() != ptrs[i]:
            bad.append(f"tensor {i} moved")
            continue
        rows = t.view(ROWS, -1)
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)
        if not (torch.equal(lo, v) and torch.equal(hi, v)):
            k = int((lo != v).logical_or(hi != v).nonzero()[0])
            bad.append(f"tensor {i} row {k}: min {int(lo[k])} max {int(hi[k])}, want {int(v[k])}")
    if not torch.equal(rand.cpu(), rand_host):
        bad.append("random tensor differs")
    if bad:
        print("VERIFY FAILED: " + "; ".join(bad[:5]), flush=True)
        return 1
    print(f"VERIFY OK: {a.gib} GiB of tensors and 64 MiB of random bytes intact at the same addresses", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
