"""RL colocation on one GPU (issue 40, part 4): a "trainer" process and an "inference" process
share the device and take turns, through the public torch_memory_saver API only, so that the
same script times this package and the original one (each found on the import path, as
scripts/gpu-test's vs_original step arranges).

Usage: python3 rl_colocation.py LABEL [--train-gib 65] [--infer-gib 65] [--frozen-share 0.25]
       [--switches 5] [--skip-frozen]

- trainer (torch hook mode): weights, gradients and optimizer state in a region with a CPU
  backup (tag "train", TRAIN_GIB in all), of which FROZEN_SHARE is a frozen part (a reference
  model, tag "frozen", same backup) that no step changes;
- inference: weights with a CPU backup, retained (tag "weights", 40% of INFER_GIB), a KV cache
  without backup (tag "kv", the rest) and a CUDA graph over the weights (tag "graph").

One switch: inference pauses everything and the trainer resumes ("to training"), the trainer
steps (every trainable byte changes), then the trainer pauses and inference resumes and replays
its graph ("to inference"). Each direction's wall clock is printed per switch, with the best
and the median; `--skip-frozen` (this package only) retains the trainer's backups and turns on
skip-unchanged for the frozen part and the inference weights (`set_checks`). Contents are
checked at the end against checksums taken before the first switch (frozen and weights) and
after the last step (trainable). Prints `RL_ROW` lines and exits 1 if anything differed;
asserts nothing about time.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

GIB = 1 << 30

CHILD = r'''
import os, sys, time, torch
import torch_memory_saver as pkg
from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = "torch"
role, gib, frozen_share, skip = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
GIB = 1 << 30
CHUNK = GIB // 2  # bytes per tensor
def tensors(total, seed):
    out, left = [], int(total)
    while left > 0:
        n = min(CHUNK, left)
        g = torch.Generator(device="cuda").manual_seed(seed + len(out))
        out.append(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g))
        left -= n
    return out
def digest(ts):
    return [int(t[: t.numel() // 4 * 4].view(torch.int32).sum(dtype=torch.int64)) for t in ts]
def say(*a):
    print(*a, flush=True)
if skip or hasattr(tms, "retain_cpu_backup"):
    try:
        tms.retain_cpu_backup = True
    except Exception as e:  # the original may not have it
        say("NOTE retain_cpu_backup:", e)
if role == "trainer":
    frozen_bytes = gib * frozen_share * GIB
    with tms.region(tag="train", enable_cpu_backup=True):
        train = tensors(gib * GIB - frozen_bytes, 100)
    with tms.region(tag="frozen", enable_cpu_backup=True):
        frozen = tensors(frozen_bytes, 900)
    if skip:
        tms.set_checks("frozen", skip_unchanged=True)
    keep = {"frozen": digest(frozen)}
    tms.pause()
    def step():
        for t in train:
            t.add_(1)
        torch.cuda.synchronize()
else:
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = tensors(gib * 0.4 * GIB, 500)
    with tms.region(tag="kv"):
        kv = [torch.empty(CHUNK, dtype=torch.uint8, device="cuda") for _ in range(int(gib * 0.6 * GIB) // CHUNK)]
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(weights[0][:4096].to(torch.int64).sum())
    torch.cuda.current_stream().wait_stream(s)
    with tms.cuda_graph(cuda_graph=g, tag="graph"):
        out.copy_(weights[0][:4096].to(torch.int64).sum())
    g.replay(); torch.cuda.synchronize()
    want_out = int(out.item())
    if skip:
        tms.set_checks("weights", skip_unchanged=True)
    keep = {"weights": digest(weights)}
say("READY")
for line in sys.stdin:
    cmd = line.strip()
    t0 = time.perf_counter()
    if cmd == "pause":
        tms.pause(); torch.cuda.synchronize()
    elif cmd == "resume":
        tms.resume(); torch.cuda.synchronize()
        if role == "inference":
            out.zero_(); g.replay(); torch.cuda.synchronize()
            if int(out.item()) != want_out:
                say("PROBLEM graph replay after resume:", int(out.item()), "!=", want_out)
    elif cmd == "step":
        step()
    elif cmd == "check":
        bad = []
        if role == "trainer":
            if digest(frozen) != keep["frozen"]:
                bad.append("frozen")
            if digest(train) != keep.get("train", digest(train)):
                bad.append("train")
        elif digest(weights) != keep["weights"]:
            bad.append("weights")
        say("CHECK", "ok" if not bad else "differ: " + ",".join(bad))
        continue
    elif cmd == "remember":
        keep["train"] = digest(train)
    elif cmd == "quit":
        break
    say("DONE", f"{time.perf_counter() - t0:.4f}")
'''


class Child:
    def __init__(self, role: str, gib: float, frozen_share: float, skip: bool):
        self.role = role
        self.p = subprocess.Popen(
            [sys.executable, "-c", CHILD, role, str(gib), str(frozen_share), "1" if skip else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.expect("READY")

    def expect(self, word: str) -> str:
        for line in self.p.stdout:
            if line.startswith("PROBLEM") or line.startswith("NOTE"):
                print(f"{self.role}: {line.strip()}", flush=True)
                if line.startswith("PROBLEM"):
                    PROBLEMS.append(f"{self.role}: {line.strip()}")
                continue
            if line.startswith(word):
                return line.strip()
        raise SystemExit(f"{self.role} ended (exit {self.p.wait()}) before {word}")

    def do(self, cmd: str) -> float:
        self.p.stdin.write(cmd + "\n")
        return float(self.expect("DONE").split()[1])

    def check(self) -> str:
        self.p.stdin.write("check\n")
        return self.expect("CHECK")

    def quit(self) -> None:
        self.p.stdin.write("quit\n")
        self.p.stdin.close()
        self.p.wait(timeout=600)


PROBLEMS = []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--train-gib", type=float, default=65)
    ap.add_argument("--infer-gib", type=float, default=65)
    ap.add_argument("--frozen-share", type=float, default=0.25)
    ap.add_argument("--switches", type=int, default=5)
    ap.add_argument("--skip-frozen", action="store_true")
    a = ap.parse_args()
    import torch_memory_saver as pkg

    if a.skip_frozen and not hasattr(pkg.torch_memory_saver, "set_checks"):
        print(f"RL_ROW {a.label} | skip-unchanged | not offered", flush=True)
        return 0
    t0 = time.perf_counter()
    trainer = Child("trainer", a.train_gib, a.frozen_share, a.skip_frozen)  # starts paused
    infer = Child("inference", a.infer_gib, a.frozen_share, a.skip_frozen)
    print(f"set up in {time.perf_counter() - t0:.1f} s: trainer {a.train_gib} GiB "
          f"({a.frozen_share:.0%} frozen), inference {a.infer_gib} GiB", flush=True)
    to_train, to_infer = [], []
    for i in range(a.switches):
        s0 = time.perf_counter()
        infer.do("pause")
        trainer.do("resume")
        to_train.append(time.perf_counter() - s0)
        trainer.do("step")
        trainer.do("remember")
        s1 = time.perf_counter()
        trainer.do("pause")
        infer.do("resume")
        to_infer.append(time.perf_counter() - s1)
        print(f"RL_ROW {a.label} | switch {i + 1} | to training {to_train[-1]:.3f} s | "
              f"to inference {to_infer[-1]:.3f} s", flush=True)
    for what, xs in (("to training", to_train), ("to inference", to_infer)):
        print(f"RL_ROW {a.label} | {what} | best {min(xs):.3f} s | median {statistics.median(xs):.3f} s",
              flush=True)
    # Contents: the inference side is resumed; the trainer is resumed once more to be checked.
    infer_check = infer.check()
    infer.do("pause")
    trainer.do("resume")
    train_check = trainer.check()
    for role, c in (("inference", infer_check), ("trainer", train_check)):
        print(f"{role}: {c}", flush=True)
        if c != "CHECK ok":
            PROBLEMS.append(f"{role}: {c}")
    trainer.quit()
    infer.quit()
    for p in PROBLEMS:
        print("PROBLEM", p)
    print("RL COLOCATION", "OK" if not PROBLEMS else "FAILED", flush=True)
    return 1 if PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main())
