"""Fault campaigns on a real GPU, where the CUDA driver itself is made to fail. Run by
`scripts/gpu-test faults` with the wheel installed; needs PyTorch and one CUDA device.

A. Out of memory from another process: a plain PyTorch process (the hog) takes all but a random
   part of the device while a worker process has tags paused with CPU backups; two threads of the
   worker resume two tags at once. Every tag must end either resumed with its contents intact or
   still paused with its backup (no half-resumed tag), every refusal must be OutOfMemoryError, and
   once the hog lets go every tag resumes intact.
B. Allocation beyond capacity: threads of the worker allocate pauseable tensors whose sum exceeds
   the free memory (so cuMemCreate fails); each must get PyTorch's OutOfMemoryError, nothing
   else, the worker lives on, and the device's free memory returns to where it was.
C. A killed peer: a process pausing or resuming a tag with a disk backup (driven by tmsctl or by
   its own API) is killed with SIGKILL part way. tmsctl must report the death at once (not a
   timeout), the peer's device memory must come back, `tmsctl clean` must remove its backup
   files and socket, and the worker's own tags must be untouched.

Prints one line per fault tried and a count per campaign; the last line is the summary; exits
non-zero if any invariant did not hold.

    python3 scripts/gpu/fault_campaign.py [--rounds N] [--modes preload,torch]   (FC_ROUNDS=N too)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20

WORKER = r"""
import json, os, sys, threading, torch
from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = os.environ["FC_MODE"]
torch.cuda.init()
if os.environ.get("FC_DISK_DIR"):
    tms.set_disk_backup_dir(os.environ["FC_DISK_DIR"])
tensors = {}
sums = {}

def checksum(t):
    return int(t.view(torch.int64).sum().item())

def fill(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)

def free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]

def tag_state(tag):
    for t in tms.stats()["tags"]:
        if t["tag"] == tag:
            return {k: t[k] for k in ("active_allocations", "paused_allocations", "host_backup_bytes")}
    return None


def do(c):
    cmd = c["cmd"]
    if cmd == "alloc":
        kw = {"enable_cpu_backup": True} if c.get("backup") == "cpu" else {}
        if c.get("backup") == "disk":
            kw = {"enable_disk_backup": True}
        ts = []
        with tms.region(tag=c["tag"], **kw):
            for i, n in enumerate(c["sizes"]):
                ts.append(fill(n, c["seed"] + i))
        tensors[c["tag"]] = ts
        sums[c["tag"]] = [checksum(t) for t in ts]
        torch.cuda.synchronize()
        return {"ok": True}
    if cmd == "state":
        return {"ok": True, "state": tag_state(c["tag"])}
    if cmd == "state_bytes":
        for t in tms.stats()["tags"]:
            if t["tag"] == c["tag"]:
                return {"ok": True, "bytes": t["bytes_active"]}
        return {"ok": True, "bytes": 0}
    if cmd == "verify":
        got = [checksum(t) for t in tensors[c["tag"]]]
        return {"ok": got == sums[c["tag"]], "got": got, "want": sums[c["tag"]]}
    if cmd == "free":
        return {"ok": True, "free": free()}
    if cmd == "overalloc":
        # Threads allocate pauseable tensors at once; their sum exceeds what is free.
        res = []
        lock = threading.Lock()
        held = []
        def one(n):
            try:
                with tms.region(tag="over"):
                    t = torch.empty(n, dtype=torch.uint8, device="cuda")
                    t[:: 1 << 20].fill_(1)
                with lock:
                    held.append(t)
                    res.append("ok")
            except torch.OutOfMemoryError:
                with lock:
                    res.append("oom")
            except Exception as e:
                with lock:
                    res.append("other: " + type(e).__name__ + ": " + str(e)[:300])
        th = [threading.Thread(target=one, args=(n,)) for n in c["sizes"]]
        for t in th:
            t.start()
        for t in th:
            t.join()
        torch.cuda.synchronize()
        held.clear()
        return {"ok": True, "results": res}
    return common(c)
"""

# The end of every worker: `do` answers one JSON command a line, until "exit", and leaves the
# commands every worker answers alike to `common`.
SERVE = r"""
def common(c):
    cmd = c["cmd"]
    if cmd in ("pause", "resume"):
        try:
            getattr(tms, cmd)(c["tag"])
            return {"ok": True}
        except Exception as e:
            return err(e)
    if cmd == "resume_many":
        # Several tags resumed at once from as many threads, without blocking if asked.
        out = {}
        kw = {"non_blocking": True} if c.get("non_blocking") else {}
        def one(tag):
            try:
                tms.resume(tag, **kw)
                out[tag] = {"ok": True}
            except Exception as e:
                out[tag] = err(e)
        th = [threading.Thread(target=one, args=(t,)) for t in c["tags"]]
        for t in th:
            t.start()
        for t in th:
            t.join()
        return {"ok": True, "each": out}
    raise ValueError("unknown command " + cmd)

def err(e):
    return {"ok": False, "error": type(e).__module__ + "." + type(e).__name__, "msg": str(e)[:1000]}

print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    c = json.loads(line)
    if c["cmd"] == "exit":
        break
    try:
        r = do(c)
    except Exception as e:
        r = err(e)
    print(json.dumps(r), flush=True)
"""
WORKER += SERVE

HOG = r"""
import json, sys, torch
torch.cuda.init()
held = []
def free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    c = json.loads(line)
    if c["cmd"] == "exit":
        break
    if c["cmd"] == "leave":
        # Take everything but about `bytes`.
        want = free() - c["bytes"]
        step = 1 << 30
        while want >= (2 << 20):
            n = min(step, want) // (2 << 20) * (2 << 20)
            try:
                held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
                want -= n
            except torch.OutOfMemoryError:
                if step <= (2 << 20):
                    break
                step //= 2
        print(json.dumps({"ok": True, "free": free()}), flush=True)
    elif c["cmd"] == "release":
        held.clear()
        torch.cuda.empty_cache()
        print(json.dumps({"ok": True, "free": free()}), flush=True)
"""

# A peer for campaign C: a tag of `FC_GIB` GiB with a disk backup; pauses or resumes when told
# on stdin, or waits to be driven through its control socket.
PEER = r"""
import os, sys, torch
from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = os.environ["FC_MODE"]
torch.cuda.init()
tms.set_disk_backup_dir(os.environ["FC_DISK_DIR"])
with tms.region(tag="p", enable_disk_backup=True):
    x = torch.ones(int(float(os.environ["FC_GIB"]) * (1 << 30)), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("READY", os.getpid(), flush=True)
for line in sys.stdin:
    w = line.strip()
    if w in ("pause", "resume"):
        print("START", w, flush=True)
        getattr(tms, w)("p")
        print("DONE", w, flush=True)
"""


class Proc:
    """A child Python that answers JSON lines."""

    def __init__(self, code: str, env: dict, name: str):
        self.name = name
        self.p = subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.errlog: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        first = self.read(180)
        if "ready" not in first:
            raise RuntimeError(f"{name} did not start: {first}")

    def _drain(self) -> None:
        for line in self.p.stderr:
            self.errlog.append(line)
            del self.errlog[:-200]

    def read(self, timeout: float) -> dict:
        box: list = []
        t = threading.Thread(target=lambda: box.append(self.p.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(
                f"{self.name}: no answer within {timeout} s (exit {self.p.poll()}); "
                f"stderr tail: {''.join(self.errlog[-20:])}"
            )
        return json.loads(box[0])

    def ask(self, timeout: float = 300, **c) -> dict:
        self.p.stdin.write(json.dumps(c) + "\n")
        self.p.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"cmd": "exit"}\n')
                self.p.stdin.flush()
                self.p.wait(30)
            except Exception:
                self.p.kill()
                self.p.wait()


class Tally:
    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.failures: list[str] = []

    def check(self, campaign: str, ok: bool, what: str) -> bool:
        c = self.counts.setdefault(campaign, [0, 0])
        c[0] += 1
        c[1] += int(ok)
        print(f"{'held' if ok else 'BROKE'}  {campaign}: {what}", flush=True)
        if not ok:
            self.failures.append(f"{campaign}: {what}")
        return ok

    def finish(self, kind: str, title: str, t0: float, how: str) -> int:
        """Print the count per `kind` (campaign, sweep), the failures and the summary line last;
        the exit status."""
        print()
        for name in sorted(self.counts):
            tried, held = self.counts[name]
            print(f"{kind} {name}: {tried} checks, {held} held")
        tried = sum(c[0] for c in self.counts.values())
        held = sum(c[1] for c in self.counts.values())
        for f in self.failures:
            print("BROKE", f)
        print(f"{title}: {held} of {tried} checks held in {time.monotonic() - t0:.0f} s ({how})")
        return 0 if tried and held == tried else 1


def artefacts() -> tuple[str, str] | None:
    """The installed package's library, and tmsctl from TMS_BIN_DIR, else the one on PATH (the
    wheel's); None, said why, where there is no tmsctl."""
    import torch_memory_saver as pkg

    bin_dir = os.environ.get("TMS_BIN_DIR")
    ctl = (str(Path(bin_dir, "tmsctl").resolve()) if bin_dir else None) or shutil.which("tmsctl")
    if not ctl or not os.access(ctl, os.X_OK):
        print("no tmsctl (set TMS_BIN_DIR or install the wheel)")
        return None
    return pkg.get_binary_path(), ctl


def env_for(mode: str, lib: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_") and k != "LD_PRELOAD"}
    env.update(PYTHONUNBUFFERED="1", FC_MODE=mode)
    if mode == "preload":
        env["LD_PRELOAD"] = lib
    env.update(extra)
    return env


def campaign_a(t: Tally, mode: str, lib: str, rounds: int, rng: random.Random) -> None:
    w = Proc(WORKER, env_for(mode, lib), f"worker[{mode}]")
    hog = Proc(HOG, env_for("none", lib), "hog")
    try:
        sizes = {"a": [GIB, 512 * MIB, 3 * 64 * MIB], "b": [2 * GIB, 8 * MIB]}
        for i, (tag, s) in enumerate(sizes.items()):
            assert w.ask(cmd="alloc", tag=tag, sizes=s, backup="cpu", seed=100 * i + 7)["ok"]
        need = {tag: sum(s) for tag, s in sizes.items()}
        for r in range(rounds):
            for tag in sizes:
                p = w.ask(cmd="pause", tag=tag)
                if not t.check("A", p["ok"], f"{mode} round {r}: pause {tag} {p}"):
                    return
            # Leave room for nothing, for one tag, or for one tag and part of the other.
            room = rng.choice(
                [0, 256 * MIB, need["a"] + 64 * MIB, need["b"] + 64 * MIB, need["a"] + need["b"] // 2]
            )
            left = hog.ask(cmd="leave", bytes=room)["free"]
            res = w.ask(cmd="resume_many", tags=list(sizes))["each"]
            for tag in sizes:
                st = w.ask(cmd="state", tag=tag)["state"]
                if res[tag]["ok"]:
                    v = w.ask(cmd="verify", tag=tag)
                    t.check(
                        "A",
                        v["ok"] and st["paused_allocations"] == 0,
                        f"{mode} round {r}: room {room >> 20} MiB (free {left >> 20} MiB): {tag} resumed, "
                        f"contents {'intact' if v['ok'] else 'CHANGED'}, state {st}",
                    )
                else:
                    e = res[tag]
                    t.check(
                        "A",
                        e["error"].endswith("OutOfMemoryError")
                        and st["active_allocations"] == 0
                        and st["host_backup_bytes"] >= need[tag],
                        f"{mode} round {r}: room {room >> 20} MiB: {tag} refused ({e['error']}), still paused "
                        f"with its backup: {st}",
                    )
            hog.ask(cmd="release")
            for tag in sizes:
                if not res[tag]["ok"]:
                    again = w.ask(cmd="resume", tag=tag)
                    v = w.ask(cmd="verify", tag=tag)
                    t.check(
                        "A",
                        again["ok"] and v["ok"],
                        f"{mode} round {r}: {tag} resumed after the hog let go, contents "
                        f"{'intact' if v['ok'] else 'CHANGED'} {again}",
                    )
    finally:
        w.close()
        hog.close()


def campaign_b(t: Tally, mode: str, lib: str, rounds: int, rng: random.Random) -> None:
    w = Proc(WORKER, env_for(mode, lib), f"worker[{mode}]")
    try:
        base = w.ask(cmd="free")["free"]
        for r in range(rounds):
            threads = rng.choice([1, 2, 4, 8])
            total = int(base * rng.uniform(1.05, 1.6))
            sizes = [max(2 * MIB, (total // threads) // (2 * MIB) * (2 * MIB))] * threads
            if threads == 1:
                sizes = [total // (2 * MIB) * (2 * MIB)]
            res = w.ask(cmd="overalloc", sizes=sizes)["results"]
            after = w.ask(cmd="free")["free"]
            # PyTorch may keep freed blocks of the pool cached: those are still ours, not lost.
            over = w.ask(cmd="state_bytes", tag="over")["bytes"]
            lost = base - after - over
            others = [x for x in res if x not in ("ok", "oom")]
            t.check(
                "B",
                not others and "oom" in res and abs(lost) <= 512 * MIB,
                f"{mode} round {r}: {threads} thread(s) asked {sum(sizes) / GIB:.1f} GiB of "
                f"{base / GIB:.1f} GiB free: {res.count('ok')} ok, {res.count('oom')} out of memory"
                f"{', OTHER ' + repr(others) if others else ''}; free after {after / GIB:.2f} GiB, "
                f"{over / GIB:.2f} GiB still held by the tag's pool, {lost / MIB:.0f} MiB unaccounted",
            )
    finally:
        w.close()


def campaign_c(t: Tally, mode: str, lib: str, ctl: str, rounds: int, rng: random.Random) -> None:
    root = Path(tempfile.mkdtemp(prefix="tms-faults-"))
    socks = root / "sockets"
    disk = root / "disk"
    socks.mkdir(mode=0o700)
    disk.mkdir(mode=0o700)
    common = {"TMS_SOCKET_DIR": str(socks)}
    w = Proc(WORKER, env_for(mode, lib, **common), f"worker[{mode}]")
    try:
        assert w.ask(cmd="alloc", tag="mine", sizes=[GIB], backup="cpu", seed=5)["ok"]
        for r in range(rounds):
            base = w.ask(cmd="free")["free"]
            gib = rng.choice([4, 8])
            via_ctl = r % 2 == 0
            op = "pause" if r % 4 < 2 else "resume"
            env = env_for(mode, lib, FC_DISK_DIR=str(disk), FC_GIB=str(gib), **common)
            peer = subprocess.Popen(
                [sys.executable, "-c", PEER], env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            line = peer.stdout.readline()
            if not line.startswith("READY"):
                t.check("C", False, f"{mode} round {r}: peer did not start: {line} {peer.stderr.read()[-2000:]}")
                continue
            pid = int(line.split()[1])
            if op == "resume":
                peer.stdin.write("pause\n")
                peer.stdin.flush()
                while not peer.stdout.readline().startswith("DONE"):
                    pass
            delay = rng.uniform(0.05, 1.0)
            ctl_proc = None
            if via_ctl:
                ctl_proc = subprocess.Popen(
                    [ctl, op, "--pid", str(pid), "--tag", "p", "--timeout", "120"],
                    env={**os.environ, **common}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )
            else:
                peer.stdin.write(op + "\n")
                peer.stdin.flush()
            time.sleep(delay)
            killed_at = time.monotonic()
            peer.send_signal(signal.SIGKILL)
            peer.wait()
            what = f"{mode} round {r}: peer of {gib} GiB killed {delay:.2f} s into its {op}" + (
                " (driven by tmsctl)" if via_ctl else ""
            )
            if ctl_proc is not None:
                out, err = ctl_proc.communicate(timeout=60)
                waited = time.monotonic() - killed_at
                t.check(
                    "C",
                    (ctl_proc.returncode == 1 and waited < 10 and "without replying" in err)
                    or ctl_proc.returncode == 0,
                    f"{what}: tmsctl exit {ctl_proc.returncode} {waited:.1f} s after the kill: {err.strip()[:300]}",
                )
            # The driver hands a dead process's memory back; give it a moment.
            deadline = time.monotonic() + 30
            after = w.ask(cmd="free")["free"]
            while after < base - 512 * MIB and time.monotonic() < deadline:
                time.sleep(0.5)
                after = w.ask(cmd="free")["free"]
            t.check("C", after >= base - 512 * MIB,
                    f"{what}: device free {base / GIB:.1f} GiB before, {after / GIB:.1f} GiB after")
            cl = subprocess.run(
                [ctl, "clean", "--disk-dir", str(disk), "--json"],
                env={**os.environ, **common}, capture_output=True, text=True, timeout=60,
            )
            # A temporary file younger than a minute is left on purpose (it may be one a live
            # process is making); it exists only between a file's creation and its naming.
            young = sorted(p.name for p in disk.rglob(".tms-backup-new-*") if f"-{pid}-" in p.name)
            left = sorted(p.name for p in disk.rglob("tms-backup-*") if f"-{pid}-" in p.name)
            sock_left = sorted(p.name for p in socks.iterdir() if p.name.startswith(f"{pid}."))
            mine = any(p.name.startswith(f"{w.p.pid}.") for p in socks.iterdir())
            t.check("C", cl.returncode == 0 and not left and not sock_left and mine,
                    f"{what}: tmsctl clean exit {cl.returncode} {cl.stdout.strip()[:200]}; left behind: "
                    f"{left + sock_left}; the live worker's socket {'kept' if mine else 'REMOVED'}"
                    f"{'; young temporary files kept: ' + repr(young) if young else ''}")
            st = w.ask(cmd="state", tag="mine")["state"]
            v = w.ask(cmd="verify", tag="mine")
            t.check("C", v["ok"] and st["active_allocations"] == 1,
                    f"{what}: the worker's own tag untouched ({st})")
        # The worker's tag still pauses and resumes after all that.
        p, q = w.ask(cmd="pause", tag="mine"), w.ask(cmd="resume", tag="mine")
        v = w.ask(cmd="verify", tag="mine")
        t.check("C", p["ok"] and q["ok"] and v["ok"], f"{mode}: the worker pauses and resumes after the kills")
    finally:
        w.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("FC_ROUNDS", "8")))
    ap.add_argument("--modes", default="preload,torch")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("FC_SEED", "0")) or int(time.time()))
    a = ap.parse_args()
    found = artefacts()
    if found is None:
        return 1
    lib, ctl = found
    print(f"seed {a.seed}; library {lib}; tmsctl {ctl}", flush=True)
    rng = random.Random(a.seed)
    t = Tally()
    t0 = time.monotonic()
    for mode in a.modes.split(","):
        for name, fn in (
            ("A", lambda: campaign_a(t, mode, lib, a.rounds, rng)),
            ("B", lambda: campaign_b(t, mode, lib, a.rounds, rng)),
            ("C", lambda: campaign_c(t, mode, lib, ctl, max(4, a.rounds // 2), rng)),
        ):
            try:
                fn()
            except Exception as e:  # a campaign that could not run is a failure, never a pass
                t.check(name, False, f"{mode}: campaign stopped: {type(e).__name__}: {e}")
    return t.finish("campaign", "FAULT CAMPAIGNS", t0, f"seed {a.seed}")


if __name__ == "__main__":
    sys.exit(main())
