"""Fault sweeps of issue 36: the non-blocking resume's failures and `--atomic`'s every-or-none,
with several copy workers, several threads and slow or killed peers. Run by `scripts/gpu-test
sweeps` on a GPU (both hook modes); `--device sim` runs the same sweeps on the simulated device
under LD_PRELOAD (no GPU, no torch: scripts/test does so with a few rounds).

D. Non-blocking resume, a disk read failing part way: a fresh worker per round, its k-th disk
   read made to fail (`TMS_DISK_FAULTS=read:k:EIO`, k swept over the resume's reads and beyond),
   1, 2 or 4 copy workers, one tag resumed or two at once from two threads; in some rounds the
   device is first filled (another tag) to leave room for only part of the tag, so the mapping
   fails before the call returns (OutOfMemoryError, nothing held). Each resumed tag must
   end in one of three true states: the call raised and the tag is still paused (a blocking
   resume then restores it intact); or the data landed (`wait()` True, contents intact); or the
   restore failed after the call returned, and then `wait()` raises, again on a second call,
   `stats()` shows `failed_restore` and unrestored (not paused) bytes, another tag pauses and
   resumes as ever, and a pause gives the memory back before a resume restores it intact. Where
   the pause comes first, it raises the failure itself. Nothing may hang.
E. `tmsctl pause|resume --all --atomic` over three peers, one of them stopped (SIGSTOP) before or
   during the job, stopped briefly, or killed (SIGKILL) part way. tmsctl must end within its
   bound; exit 0 means every peer reached the target state; a failure that says
   `every_process_as_before: true` must be true of every live peer once the stopped one is let
   go and every operation has ended; one that says false must name the process. Afterwards
   every live peer resumes with its contents intact, and a killed peer's device memory is back.

Prints one line per check and a count per sweep; the last line is the summary; exits non-zero if
any check did not hold.

    python3 scripts/gpu/fault_sweeps.py [--device cuda|sim] [--rounds N] [--modes preload,torch]
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_campaign import GIB, HOG, MIB, SERVE, Proc, Tally, artefacts, env_for  # noqa: E402

# A process holding tags, answering JSON lines on stdin: on a GPU through PyTorch (either hook
# mode), on the simulated device through cudaMalloc (LD_PRELOAD).
WORKER = r"""
import ctypes, hashlib, json, os, random, sys, threading
from torch_memory_saver import torch_memory_saver as tms
CUDA = os.environ["FS_DEVICE"] == "cuda"
if CUDA:
    import torch
    tms.hook_mode = os.environ["FC_MODE"]
    torch.cuda.init()
else:
    libc = ctypes.CDLL(None)
if os.environ.get("FS_DISK_DIR"):
    tms.set_disk_backup_dir(os.environ["FS_DISK_DIR"])
held = {}  # tag -> [(tensor or address, size, digest)]

def make(n, seed):
    if CUDA:
        g = torch.Generator(device="cuda").manual_seed(seed)
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
        return t, t.data_ptr()
    p = ctypes.c_void_p(0)
    rc = libc.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n))
    if rc != 0:
        raise MemoryError(f"cudaMalloc({n}) = {rc}")
    ctypes.memmove(p.value, random.Random(seed).randbytes(n), n)
    return p.value, p.value

hog = []

def make_empty(n):
    # An allocation of n bytes, contents undefined; MemoryError where none is had.
    p = ctypes.c_void_p(0)
    rc = libc.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n))
    if rc != 0:
        raise MemoryError(f"cudaMalloc({n}) = {rc}")
    return p.value, p.value

def drop(o):
    libc.cudaFree(ctypes.c_void_p(o))

def digest(obj, n):
    if CUDA:
        v = obj.view(torch.int64)
        w = torch.arange(1, v.numel() + 1, device="cuda", dtype=torch.int64)
        return [int(v.sum().item()), int((v * w).sum().item())]
    return hashlib.sha256(ctypes.string_at(obj, n)).hexdigest()

def free():
    if CUDA:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]
    return None

def state(tag):
    for t in tms.stats()["tags"]:
        if t["tag"] == tag:
            keys = ("active_allocations", "paused_allocations", "bytes_active", "bytes_paused",
                    "bytes_unrestored", "bytes_restoring", "restoring_allocations", "failed_restore")
            return {k: t.get(k) for k in keys}
    return None

def do(c):
    cmd = c["cmd"]
    if cmd == "alloc":
        kw = {"enable_cpu_backup": True} if c["backup"] == "cpu" else {"enable_disk_backup": True}
        out = []
        with tms.region(tag=c["tag"], **kw):
            for i, n in enumerate(c["sizes"]):
                out.append(make(n, c["seed"] + i) + (n,))
        if CUDA:
            torch.cuda.synchronize()
        held[c["tag"]] = [(o, n, digest(o, n)) for o, _, n in out]
        return {"ok": True}
    if cmd == "wait":
        try:
            landed = [tms.wait(o, timeout=c["secs"]) for o, _, _ in held[c["tag"]]]
            return {"ok": True, "landed": all(landed)}
        except Exception as e:
            return err(e)
    if cmd == "state":
        return {"ok": True, "state": state(c["tag"])}
    if cmd == "verify":
        if CUDA:
            torch.cuda.synchronize()
        bad = [i for i, (o, n, d) in enumerate(held[c["tag"]]) if digest(o, n) != d]
        return {"ok": not bad, "changed": bad}
    if cmd == "free":
        return {"ok": True, "free": free()}
    if cmd == "hog":
        # The simulated device only (each process has its own): fill it with pauseable
        # allocations of `unit` bytes (tag "hog", no backup) until one fails, then give back
        # about `room` bytes of them. On a GPU another process takes the memory (HOG).
        hog.clear()
        while True:
            try:
                with tms.region(tag="hog"):
                    o, _ = make_empty(c["unit"])
                hog.append(o)
            except (MemoryError, RuntimeError):
                break
        filled = len(hog)
        for _ in range(-(-c["room"] // c["unit"])):
            if hog:
                drop(hog.pop())
        return {"ok": True, "filled": filled, "kept": len(hog)}
    if cmd == "unhog":
        while hog:
            drop(hog.pop())
        return {"ok": True}
    return common(c)
"""
WORKER += SERVE


class Setup:
    """Sizes and environment of one device kind."""

    def __init__(self, device: str, lib: str, ctl: str, root: Path) -> None:
        self.device, self.lib, self.ctl, self.root = device, lib, ctl, root
        self.sim = device == "sim"
        # Tag sizes: several allocations each; on the sim small, on a GPU large enough that a
        # restore takes a while and a signal lands inside it.
        self.unit = MIB if self.sim else 128 * MIB
        self.chunk_mb = 1 if self.sim else 64
        self.ctl_timeout = 2 if self.sim else 5
        self.ask_timeout = 60 if self.sim else 300

    def env(self, mode: str, **extra: str) -> dict:
        extra = {"FS_DEVICE": self.device, "TMS_SOCKET_DIR": str(self.root / "sockets"), **extra}
        if self.sim:
            extra.update(TMS_BACKEND="sim", TMS_SIM_CAPACITY="256MiB")
        return env_for(mode, self.lib, **extra)

    def worker(self, mode: str, name: str, **extra: str) -> Proc:
        disk = self.root / "disk"
        return Proc(WORKER, self.env(mode, FS_DISK_DIR=str(disk), **extra), name)

    def ask(self, w: Proc, **c) -> dict:
        return w.ask(timeout=self.ask_timeout, **c)


def resume_intact(s: Setup, w: Proc, tag: str) -> tuple[bool, str]:
    """Resume `tag` (blocking) and check its contents. The armed read may fail this resume
    instead: then the tag must still be paused, and the next resume restores it (a fault fires
    once). Paused memory is never read (unmapped, it faults)."""
    n = len(SIZES[tag])
    tries = []
    for _ in range(2):
        q = s.ask(w, cmd="resume", tag=tag)
        tries.append("ok" if q["ok"] else q["error"])
        if q["ok"]:
            v = s.ask(w, cmd="verify", tag=tag)
            return v["ok"], f"resume {tries}, contents {'intact' if v['ok'] else 'CHANGED'}"
        st = s.ask(w, cmd="state", tag=tag)["state"]
        if st["paused_allocations"] != n or st["bytes_unrestored"] != 0:
            return False, f"resume {tries} left {st}"
    return False, f"resume {tries}"


def held(st: dict) -> int:
    """The device memory a tag holds: active, and restoring or left unrestored by a non-blocking
    resume (mapped, neither active nor paused)."""
    return sum(st.get(k) or 0 for k in ("bytes_active", "bytes_restoring", "bytes_unrestored"))


def landed_or_raised(s: Setup, t: Tally, w: Proc, tag: str, what: str, free0,
                     paused0: list[str]) -> str:
    """After a non-blocking resume of `tag` returned: which of the true states it ends in.
    `free0`: the device's free memory when the tags `paused0` were all paused."""
    n = len(SIZES[tag])
    first = s.ask(w, cmd="wait", tag=tag, secs=s.ask_timeout / 2)
    if first["ok"]:
        st = s.ask(w, cmd="state", tag=tag)["state"]
        v = s.ask(w, cmd="verify", tag=tag)
        t.check("D", first["landed"] and v["ok"] and st["active_allocations"] == n,
                f"{what}: {tag} landed ({first}), contents {'intact' if v['ok'] else 'CHANGED'}, {st}")
        return "landed"
    again = s.ask(w, cmd="wait", tag=tag, secs=s.ask_timeout / 2)
    st = s.ask(w, cmd="state", tag=tag)["state"]
    # What landed before the failure stays restored (active); the rest is unrestored: held,
    # neither active nor paused. The pause below keeps the landed contents (resume_intact).
    t.check("D", not again["ok"] and st["failed_restore"] and st["bytes_unrestored"] > 0
            and st["bytes_paused"] == 0 and st["active_allocations"] < n
            and st["active_allocations"] + st["paused_allocations"] == n,
            f"{what}: {tag} failed after the return: wait raised {first['error']}, again "
            f"{'raised' if not again['ok'] else 'DID NOT'}; {st}")
    # Other tags run as ever.
    ctrl = [s.ask(w, cmd=c, tag="c") for c in ("pause", "resume", "verify")]
    t.check("D", all(r["ok"] for r in ctrl), f"{what}: tag c pauses and resumes meanwhile: {ctrl}")
    p = s.ask(w, cmd="pause", tag=tag)
    st = s.ask(w, cmd="state", tag=tag)["state"]
    after = s.ask(w, cmd="free")["free"]
    # The other tags paused at free0 may hold memory now (resumed meanwhile): not this tag's.
    others = sum(held(s.ask(w, cmd="state", tag=x)["state"]) for x in paused0 if x != tag)
    freed = free0 is None or after >= free0 - others - 512 * MIB
    t.check("D", p["ok"] and st["paused_allocations"] == n and st["bytes_unrestored"] == 0
            and not st["failed_restore"] and freed,
            f"{what}: the pause after the report gives {tag}'s memory back: {p}, {st}"
            + ("" if free0 is None else f", free {free0 / GIB:.2f} -> {after / GIB:.2f} GiB, "
               f"{others / GIB:.2f} GiB held by the other tags resumed since"))
    return "failed after the return"


SIZES = {"a": [4, 2, 6], "b": [3, 5], "c": [2]}


class Room:
    """Leaves the device room for only part of a tag: on the simulated device the worker fills
    its own (each process has one), on a GPU another process takes the memory."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.hog = None if s.sim else Proc(HOG, env_for("none", s.lib), "hog")

    def leave(self, w: Proc, room: int) -> tuple[bool, str]:
        if self.hog is None:
            h = self.s.ask(w, cmd="hog", room=room, unit=2 * MIB)
            return h["ok"] and h["filled"] > h["kept"], f"{h}"
        h = self.hog.ask(cmd="leave", bytes=room)
        return h["ok"] and h["free"] < room + 512 * MIB, f"{h['free'] / MIB:.0f} MiB free"

    def back(self, w: Proc) -> None:
        if self.hog is None:
            self.s.ask(w, cmd="unhog")
        else:
            self.hog.ask(cmd="release")

    def close(self) -> None:
        if self.hog is not None:
            self.hog.close()


def sweep_d(s: Setup, t: Tally, mode: str, rounds: int, rng: random.Random) -> None:
    counts: dict[str, int] = {}
    room_for = Room(s)
    try:
        for r in range(rounds):
            sweep_d_round(s, t, mode, r, rng, room_for, counts)
    finally:
        room_for.close()
    print(f"sweep D [{mode}] outcomes: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), flush=True)


def sweep_d_round(s: Setup, t: Tally, mode: str, r: int, rng: random.Random, room_for: Room,
                  counts: dict[str, int]) -> None:
    threads = rng.choice([1, 2, 4])
    two = rng.random() < 0.4
    tags = ["a", "b"] if two else ["a"]
    reads = sum(sum(SIZES[x]) * s.unit // (s.chunk_mb * MIB) for x in tags)
    k = rng.randint(1, reads + 2)
    first = rng.choice(["wait", "pause"])
    # Or the device has room for only part of the tag: the mapping fails before the return.
    short = 0.0 if two or rng.random() < 0.7 else rng.uniform(0.2, 0.8)
    what = (f"{mode} round {r}: read {k} of {reads} fails, {threads} copy worker(s), "
            f"{'two tags from two threads' if two else 'one tag'}, then {first}"
            + (f", room for {short:.0%} of the tag" if short else ""))
    w = s.worker(mode, f"worker[{mode}]", TMS_DISK_FAULTS=f"read:{k}:EIO",
                 TMS_COPY_THREADS=str(threads), TMS_DISK_BACKUP_CHUNK_MB=str(s.chunk_mb))
    try:
        for i, tag in enumerate(("a", "b", "c")):
            backup = "cpu" if tag == "c" else "disk"
            sizes = [m * s.unit for m in SIZES[tag]]
            assert s.ask(w, cmd="alloc", tag=tag, sizes=sizes, backup=backup, seed=31 * r + i)["ok"]
        for tag in tags:
            assert s.ask(w, cmd="pause", tag=tag)["ok"]
        free0 = s.ask(w, cmd="free")["free"]
        if short:
            ok, how = room_for.leave(w, int(short * sum(SIZES["a"]) * s.unit))
            t.check("D", ok, f"{what}: the device filled: {how}")
        each = s.ask(w, cmd="resume_many", tags=tags, non_blocking=True)["each"]
        if short:
            res = each["a"]
            st = s.ask(w, cmd="state", tag="a")["state"]
            room_for.back(w)
            # Out of memory mapping, or the armed read if it failed first (the pipeline copies
            # item i while it maps item i+1): either way before the return.
            t.check("D", not res["ok"]
                    and st["paused_allocations"] == len(SIZES["a"]) and st["bytes_unrestored"] == 0
                    and st["active_allocations"] == 0,
                    f"{what}: the call raised {res.get('error')} before returning, nothing held: {st}")
        for tag in tags:
            n = len(SIZES[tag])
            res = each[tag]
            if not res["ok"]:
                st = s.ask(w, cmd="state", tag=tag)["state"]
                ok, how = resume_intact(s, w, tag)
                t.check("D", st["paused_allocations"] == n and st["bytes_unrestored"] == 0 and ok,
                        f"{what}: {tag} raised before returning ({res['error']}: "
                        f"{res['msg'][:120]}), still paused ({st}); then {how}")
                outcome = "raised before the return"
            elif first == "wait":
                outcome = landed_or_raised(s, t, w, tag, what, free0, tags)
                if outcome != "landed":
                    ok, how = resume_intact(s, w, tag)
                    t.check("D", ok, f"{what}: {tag} after the failure: {how}")
            else:
                p = s.ask(w, cmd="pause", tag=tag)
                st = s.ask(w, cmd="state", tag=tag)["state"]
                reported = not p["ok"] and "failed after it returned" in p["msg"]
                t.check("D", (p["ok"] or reported) and st["paused_allocations"] == n
                        and st["bytes_unrestored"] == 0,
                        f"{what}: the pause first {'raised the failure' if reported else p}, {tag} paused: {st}")
                ok, how = resume_intact(s, w, tag)
                t.check("D", ok, f"{what}: {tag} after the pause: {how}")
                outcome = "failed after the return (pause first)" if reported else "landed (pause first)"
            counts[outcome] = counts.get(outcome, 0) + 1
        v = s.ask(w, cmd="verify", tag="c")
        t.check("D", v["ok"], f"{what}: tag c intact at the end")
    except Exception as e:  # a round that could not run is a failure, never a pass
        t.check("D", False, f"{what}: stopped: {type(e).__name__}: {e}")
    finally:
        w.close()


def ctl_json(s: Setup, *args: str, timeout: float = 60) -> tuple[int, dict, str]:
    r = subprocess.run([s.ctl, *args, "--json"], env={**os.environ, "TMS_SOCKET_DIR": str(s.root / "sockets")},
                       capture_output=True, text=True, timeout=timeout)
    try:
        j = json.loads(r.stdout)
    except ValueError:
        j = {}
    return r.returncode, j, r.stderr


def settle(s: Setup, pid: int) -> bool:
    """Wait until `pid` runs no pause or resume (status lists none); False if it still does."""
    deadline = time.monotonic() + s.ask_timeout
    while time.monotonic() < deadline:
        rc, j, _ = ctl_json(s, "status", "--pid", str(pid))
        if rc == 0 and not j.get("operations"):
            return True
        time.sleep(0.2)
    return False


def sweep_e(s: Setup, t: Tally, mode: str, rounds: int, rng: random.Random) -> None:
    sizes = [m * s.unit for m in (2, 3)]
    peers: list[Proc] = []

    def spawn(i: int) -> Proc:
        p = s.worker(mode, f"peer{i}[{mode}]", TMS_COPY_THREADS=str(rng.choice([1, 4])))
        assert s.ask(p, cmd="alloc", tag="kv", sizes=sizes, backup=rng.choice(["cpu", "disk"]), seed=7 * i)["ok"]
        return p

    def paused(p: Proc) -> bool:
        return s.ask(p, cmd="state", tag="kv")["state"]["paused_allocations"] == len(sizes)

    try:
        peers = [spawn(i) for i in range(3)]
        for r in range(rounds):
            op = rng.choice(["pause", "resume"])
            # Every peer is active here (each round ends so): the device's free memory then.
            free0 = s.ask(peers[0], cmd="free")["free"]
            if op == "resume":
                for p in peers:
                    assert s.ask(p, cmd="pause", tag="kv")["ok"]
            fault = rng.choice(["stop before", "stop during", "stop briefly", "kill during", "none"])
            victim = rng.choice(peers)
            delay = rng.uniform(0, 0.3 if s.sim else 1.5)
            what = f"{mode} round {r}: {op} --atomic, peer {victim.p.pid} {fault}"
            before = {p.p.pid: paused(p) for p in peers}
            if fault == "stop before":
                victim.p.send_signal(signal.SIGSTOP)
            job = subprocess.Popen(
                [s.ctl, op, "--all", "--atomic", "--tag", "kv", "--timeout", str(s.ctl_timeout), "--json"],
                env={**os.environ, "TMS_SOCKET_DIR": str(s.root / "sockets")},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            if fault != "stop before" and fault != "none":
                time.sleep(delay)
                victim.p.send_signal(signal.SIGKILL if fault == "kill during" else signal.SIGSTOP)
                if fault == "stop briefly":
                    time.sleep(rng.uniform(0, s.ctl_timeout / 2))
                    victim.p.send_signal(signal.SIGCONT)
            bound = 12 * s.ctl_timeout + 60
            try:
                out, err = job.communicate(timeout=bound)
            except subprocess.TimeoutExpired:
                job.kill()
                out, err = job.communicate()
                t.check("E", False, f"{what}: tmsctl still running after {bound} s")
            victim.p.send_signal(signal.SIGCONT)
            if fault == "kill during":
                victim.p.wait()
            try:
                j = json.loads(out)
            except ValueError:
                j = {}
            live = [p for p in peers if p.p.poll() is None]
            settled = all(settle(s, p.p.pid) for p in live)
            t.check("E", settled, f"{what}: every live peer's operations ended")
            after = {p.p.pid: paused(p) for p in live}
            target = op == "pause"
            summary = err.strip().splitlines()[-1] if err.strip() else ""
            if job.returncode == 0:
                t.check("E", j.get("ok") is True and all(v == target for v in after.values()),
                        f"{what}: exit 0, every peer {op}d: {after}")
            elif j.get("every_process_as_before") is True:
                t.check("E", all(after[pid] == before[pid] for pid in after),
                        f"{what}: exit {job.returncode}, claims every process as before: {after} vs {before}; {summary}")
            else:
                t.check("E", "every_process_as_before" in j and "NOT every process is as before" in summary
                        and any(str(pid) in summary for pid in before),
                        f"{what}: exit {job.returncode}, says which process is not as before: {summary[:300]}")
            # Nothing lost: every live peer resumes intact; a killed peer's memory is back.
            for p in live:
                if paused(p):
                    s.ask(p, cmd="resume", tag="kv")
                v = s.ask(p, cmd="verify", tag="kv")
                t.check("E", v["ok"] and not paused(p), f"{what}: peer {p.p.pid} resumed intact ({v})")
            if fault == "kill during" and free0 is not None:
                deadline = time.monotonic() + 30
                # The live peers are active again, as at the round's start; the killed one's
                # memory is back.
                want = free0 + sum(sizes) - 512 * MIB
                got = s.ask(live[0], cmd="free")["free"]
                while got < want and time.monotonic() < deadline:
                    time.sleep(0.5)
                    got = s.ask(live[0], cmd="free")["free"]
                t.check("E", got >= want, f"{what}: the killed peer's memory is back ({got / GIB:.2f} GiB free)")
            peers = [p if p.p.poll() is None else spawn(i) for i, p in enumerate(peers)]
    finally:
        for p in peers:
            p.p.send_signal(signal.SIGCONT)
            p.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "sim"], default="cuda")
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("FS_ROUNDS", "8")))
    ap.add_argument("--modes", default=None, help="hook modes (default: preload,torch; the sim: preload)")
    ap.add_argument("--sweeps", default="D,E")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("FC_SEED", "0")) or int(time.time()))
    a = ap.parse_args()
    found = artefacts()
    if found is None:
        return 1
    lib, ctl = found
    modes = (a.modes or ("preload" if a.device == "sim" else "preload,torch")).split(",")
    if a.device == "sim" and modes != ["preload"]:
        print("the simulated device runs under LD_PRELOAD only (--modes preload)")
        return 2
    print(f"seed {a.seed}; device {a.device}; library {lib}; tmsctl {ctl}", flush=True)
    rng = random.Random(a.seed)
    t = Tally()
    t0 = time.monotonic()
    for mode in modes:
        for name in a.sweeps.split(","):
            root = Path(tempfile.mkdtemp(prefix="tms-sweeps-"))
            for d in ("sockets", "disk"):
                (root / d).mkdir(mode=0o700)
            s = Setup(a.device, lib, ctl, root)
            try:
                if name == "D":
                    sweep_d(s, t, mode, a.rounds, rng)
                elif name == "E":
                    sweep_e(s, t, mode, a.rounds, rng)
                else:
                    raise ValueError(f"no sweep {name} (D or E)")
            except Exception as e:  # a sweep that could not run is a failure, never a pass
                t.check(name, False, f"{mode}: sweep stopped: {type(e).__name__}: {e}")
            finally:
                shutil.rmtree(root, ignore_errors=True)
    return t.finish("sweep", "FAULT SWEEPS", t0, f"seed {a.seed}, {a.device}")


if __name__ == "__main__":
    sys.exit(main())
