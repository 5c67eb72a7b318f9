"""A plain PyTorch process (no LD_PRELOAD) for scripts/gpu/ctl_check.sh.

  ctl_user.py probe                      print the device's free bytes (JSON)
  ctl_user.py fill --leave-gib L --must-exceed B
      allocate 1 GiB tensors until less than L GiB is free, write every byte, free them all;
      succeed only if more than B bytes were allocated (B: what was free before the other
      process paused, so the excess can only be memory the pause gave back)
"""

import argparse
import json
import sys

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["probe", "fill"])
    ap.add_argument("--leave-gib", type=float, default=2.0)
    ap.add_argument("--must-exceed", type=int, default=0)
    a = ap.parse_args()
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    if a.mode == "probe":
        print(json.dumps({"free": free, "total": total}), flush=True)
        return 0
    chunk = 1 << 30
    held = []
    try:
        while True:
            free, _ = torch.cuda.mem_get_info()
            if free < a.leave_gib * chunk + chunk:
                break
            t = torch.empty(chunk, dtype=torch.uint8, device="cuda")
            t.fill_(len(held) % 251)
            held.append(t)
    except torch.cuda.OutOfMemoryError:
        pass
    torch.cuda.synchronize()
    used = len(held) * chunk
    ok = all(int(t[-1]) == i % 251 for i, t in enumerate(held))
    del held
    torch.cuda.empty_cache()
    print(json.dumps({"used": used, "must_exceed": a.must_exceed, "contents_ok": ok}), flush=True)
    if not ok:
        print("USER FAILED: a tensor did not hold what was written", flush=True)
        return 1
    if used <= a.must_exceed:
        print(f"USER FAILED: allocated {used} bytes, not more than the {a.must_exceed} free before the pause", flush=True)
        return 1
    print(f"USER OK: allocated, wrote and freed {used / chunk:.0f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
