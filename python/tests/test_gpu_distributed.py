"""torch_memory_saver.distributed over real torch.distributed: several processes in one gloo
group on the simulated device (faults on one rank: out of memory, a full disk, a rank that
dies), several processes sharing the real GPU where one cannot resume because another process
holds the memory, and nccl across two GPUs. Needs torch and numpy: the gloo tests on the
simulated device run in the CPU suite's run with torch, the others in the GPU suite; the variant
without torch is test_distributed.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed  # noqa: E402

if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)
# torch.distributed.all_gather_object, which the ranks agree through, reads what it gathered with
# numpy, which torch does not install: without it the layer refuses every call
# (test_distributed.py proves that), so nothing here can run.
pytest.importorskip("numpy", reason="torch.distributed.all_gather_object needs numpy")

import torch_memory_saver as tms_pkg  # noqa: E402

from conftest import PRELUDE, SIM_ALLOC, clean_env  # noqa: E402

RANK = """
import datetime, time
import torch, torch.distributed as dist
from torch_memory_saver import distributed as tmsd
RANK = int(os.environ["RANK"]); WORLD = int(os.environ["WORLD_SIZE"])
MIB = 1 << 20
GIB = 1 << 30
dist.init_process_group(os.environ["DIST_BACKEND"], init_method="file://" + os.environ["INIT_FILE"],
                        rank=RANK, world_size=WORLD,
                        timeout=datetime.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT", "60"))))

def report(**kw):
    tag = kw.pop("tag")
    s = next(t for t in tms.stats()["tags"] if t["tag"] == tag)
    kw.update(active=s["active_allocations"], paused=s["paused_allocations"])
    print("RESULT " + json.dumps(kw), flush=True)

def attempt(f, *a, **k):
    try:
        out = f(*a, **k)
        return {"ok": True, "line": str(out), "total": out.total_bytes, "slowest": out.slowest.rank}
    except tmsd.DistributedError as e:
        return {"ok": False, "msg": str(e), "failed": sorted(e.failed)}

def wait_for(name):
    path = os.path.join(os.environ["SYNC_DIR"], name)
    while not os.path.exists(path):
        time.sleep(0.05)
"""

def start_ranks(tmp_path, world, body, backend="gloo", sim=True, per_rank_env=None, mode="preload"):
    (tmp_path / "sync").mkdir(exist_ok=True)
    procs = []
    for r in range(world):
        env = clean_env(
            RANK=str(r),
            WORLD_SIZE=str(world),
            DIST_BACKEND=backend,
            INIT_FILE=str(tmp_path / "init"),
            SYNC_DIR=str(tmp_path / "sync"),
            TMS_SOCKET_DIR=str(tmp_path / "sock"),
            TEST_HOOK_MODE=mode,
            PYTHONUNBUFFERED="1",
        )
        if sim:
            env.update(LD_PRELOAD=tms_pkg.get_binary_path(), TMS_BACKEND="sim", TMS_SIM_CAPACITY="256MiB")
        elif mode == "preload":
            env["LD_PRELOAD"] = tms_pkg.get_binary_path()
        env.update((per_rank_env or {}).get(r, {}))
        src = PRELUDE + RANK + (SIM_ALLOC if sim else "") + textwrap.dedent(body)
        procs.append(subprocess.Popen([sys.executable, "-c", src], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs, timeout=240):
    out = []
    for p in procs:
        o, e = p.communicate(timeout=timeout)
        out.append({"rc": p.returncode, "results": [json.loads(x[7:]) for x in o.splitlines() if x.startswith("RESULT ")], "err": e[-3000:]})
    return out


def test_sim_gloo_out_of_memory_on_one_rank(tmp_path):
    procs = start_ranks(
        tmp_path,
        3,
        """
        p, data = alloc("w", 96 * MIB, RANK, enable_cpu_backup=True)
        a = attempt(tmsd.pause, "w")
        report(tag="w", step="pause", **a)
        hog = alloc("hog", 200 * MIB, 9)[0] if RANK == 1 else None
        b = attempt(tmsd.resume, "w")
        report(tag="w", step="resume", **b)
        if hog is not None:
            assert cuda_free(hog) == 0
        c = attempt(tmsd.resume, "w")
        report(tag="w", step="again", intact=intact(p, data), **c)
        dist.destroy_process_group()
        """,
    )
    for rank, r in enumerate(finish(procs)):
        assert r["rc"] == 0, r["err"]
        pause, resume, again = r["results"]
        assert pause["ok"] and pause["total"] == 3 * 96 * (1 << 20), pause
        assert not resume["ok"] and resume["failed"] == [1] and "OutOfMemoryError" in resume["msg"], resume
        assert (resume["active"], resume["paused"]) == (0, 1), (rank, resume)
        assert again["ok"] and again["intact"] and (again["active"], again["paused"]) == (1, 0), (rank, again)


def test_sim_gloo_full_disk_on_one_rank(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    procs = start_ranks(
        tmp_path,
        3,
        f"""
        tms.set_disk_backup_dir({str(disk)!r})
        bufs = [alloc("w", 16 * MIB, RANK * 4 + i, enable_disk_backup=True) for i in range(3)]
        a = attempt(tmsd.pause, "w")
        report(tag="w", step="pause", intact=all(intact(p, d) for p, d in bufs), **a)
        dist.destroy_process_group()
        """,
        per_rank_env={2: {"TMS_DISK_FAULTS": "write:2:ENOSPC", "TMS_DISK_BACKUP_CHUNK_MB": "4"}},
    )
    for rank, r in enumerate(finish(procs)):
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and p["failed"] == [2] and "every rank undid it" in p["msg"], (rank, p)
        assert p["intact"] and (p["active"], p["paused"]) == (3, 0), (rank, p)


def test_sim_gloo_a_rank_killed_mid_operation(tmp_path):
    # Rank 2 is killed while the others pause: the collective fails (gloo notices the closed
    # connection, or the group's timeout ends it); the survivors undo and report it.
    procs = start_ranks(
        tmp_path,
        3,
        """
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        if RANK == 2:
            tms.pause("w")
            os.kill(os.getpid(), 9)
        a = attempt(tmsd.pause, "w")
        report(tag="w", step="pause", intact=intact(p, data), **a)
        """,
        per_rank_env={r: {"DIST_TIMEOUT": "15"} for r in range(3)},
    )
    res = finish(procs)
    assert res[2]["rc"] == -9
    for r in res[:2]:
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and "the group failed before the ranks could agree" in p["msg"], p
        assert "undid its own pause (done)" in p["msg"], p
        assert p["intact"] and (p["active"], p["paused"]) == (1, 0), p


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_cuda_gloo_one_rank_cannot_resume_while_another_process_holds_memory(tmp_path, mode):
    # Three ranks share GPU 0. While they are paused, another process takes all but room for
    # about two of them; the job-wide resume fails on at least one rank, every rank ends
    # paused with its backup, and once the other process lets go every rank resumes intact.
    procs = start_ranks(
        tmp_path,
        3,
        """
        tms.hook_mode = os.environ["TEST_HOOK_MODE"]
        torch.cuda.init()
        g = torch.Generator(device="cuda").manual_seed(RANK)
        with tms.region(tag="w", enable_cpu_backup=True):
            w = torch.randint(0, 256, (4 * GIB,), dtype=torch.uint8, device="cuda", generator=g)
        ref = int(w.view(torch.int64).sum().item())
        torch.cuda.synchronize()
        a = attempt(tmsd.pause, "w")
        report(tag="w", step="pause", **a)
        open(os.path.join(os.environ["SYNC_DIR"], f"paused{RANK}"), "w").close()
        wait_for("hogged")
        b = attempt(tmsd.resume, "w")
        report(tag="w", step="resume", **b)
        open(os.path.join(os.environ["SYNC_DIR"], f"tried{RANK}"), "w").close()
        wait_for("released")
        c = attempt(tmsd.resume, "w")
        report(tag="w", step="again", intact=int(w.view(torch.int64).sum().item()) == ref, **c)
        dist.destroy_process_group()
        """,
        sim=False,
        mode=mode,
    )
    sync = tmp_path / "sync"
    hog = None
    try:
        deadline = time.time() + 180
        while not all((sync / f"paused{r}").exists() for r in range(3)):
            assert time.time() < deadline and all(p.poll() is None for p in procs), "ranks did not pause"
            time.sleep(0.1)
        hog = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import torch, sys\n"
                "free = torch.cuda.mem_get_info()[0]\n"
                "x = torch.empty(free - 9 * (1 << 30), dtype=torch.uint8, device='cuda')\n"
                "print('HOG', flush=True)\n"
                "sys.stdin.readline()\n",
            ],
            env=clean_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert hog.stdout.readline().startswith("HOG")
        (sync / "hogged").touch()
        while not all((sync / f"tried{r}").exists() for r in range(3)):
            assert time.time() < deadline + 120 and all(p.poll() is None for p in procs), "ranks did not try"
            time.sleep(0.1)
        hog.communicate("\n", timeout=60)
        (sync / "released").touch()
        res = finish(procs)
    finally:
        for p in procs + ([hog] if hog else []):
            if p.poll() is None:
                p.kill()
    failed_sets = set()
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        pause, resume, again = r["results"]
        assert pause["ok"] and pause["total"] == 3 * 4 * (1 << 30), pause
        assert not resume["ok"] and resume["failed"] and "OutOfMemoryError" in resume["msg"], (rank, resume)
        failed_sets.add(tuple(resume["failed"]))
        assert (resume["active"], resume["paused"]) == (0, 1), (rank, resume)
        assert again["ok"] and again["intact"] and (again["active"], again["paused"]) == (1, 0), (rank, again)
    assert len(failed_sets) == 1, f"ranks disagree on who failed: {failed_sets}"


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
    reason="nccl needs two GPUs",
)
def test_cuda_nccl_two_gpus(tmp_path):
    # One rank per GPU over nccl: a job-wide pause and resume, then a resume that fails on
    # rank 1 (its GPU filled by another tensor of its own) and is undone on rank 0.
    procs = start_ranks(
        tmp_path,
        2,
        """
        torch.cuda.set_device(RANK)
        torch.cuda.init()
        with tms.region(tag="w", enable_cpu_backup=True):
            w = torch.full((2 * GIB,), RANK + 1, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        report(tag="w", step="pause", **attempt(tmsd.pause, "w"))
        report(tag="w", step="resume", **attempt(tmsd.resume, "w"))
        report(tag="w", step="pause2", **attempt(tmsd.pause, "w"))
        hog = None
        if RANK == 1:
            hog = torch.empty(torch.cuda.mem_get_info()[0] - GIB, dtype=torch.uint8, device="cuda")
        r = attempt(tmsd.resume, "w")
        report(tag="w", step="refused", **r)
        del hog
        torch.cuda.empty_cache()
        r = attempt(tmsd.resume, "w")
        report(tag="w", step="again", intact=bool((w[:: 1 << 20] == RANK + 1).all()), **r)
        dist.destroy_process_group()
        """,
        backend="nccl",
        sim=False,
    )
    for rank, r in enumerate(finish(procs)):
        assert r["rc"] == 0, r["err"]
        pause, resume, pause2, refused, again = r["results"]
        assert pause["ok"] and resume["ok"] and pause2["ok"], r["results"]
        assert not refused["ok"] and refused["failed"] == [1], (rank, refused)
        assert (refused["active"], refused["paused"]) == (0, 1), (rank, refused)
        assert again["ok"] and again["intact"], (rank, again)


def test_sim_gloo_a_rank_outside_the_group_is_refused_before_acting(tmp_path):
    # The group is rank 0's alone; rank 1 calls with it too. torch.distributed's collectives do
    # nothing on a rank outside their group, so rank 1 paused "w" with no rank to agree with and
    # returned an outcome of no rank (whose line raised ValueError). It must refuse without
    # acting; rank 0, the group's only rank, pauses as asked.
    procs = start_ranks(
        tmp_path,
        2,
        """
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        g = dist.new_group([0])
        try:
            out = tmsd.pause("w", group=g)
            a = {"raised": None, "ranks": [r.rank for r in out.ranks], "line": str(out)}
        except BaseException as e:  # noqa: BLE001 - which error is what is tested
            a = {"raised": type(e).__name__, "msg": str(e)}
        # Read only where active: paused memory is not mapped (the read would crash).
        active = next(t for t in tms.stats()["tags"] if t["tag"] == "w")["active_allocations"]
        report(tag="w", step="pause", intact=RANK == 0 or (active == 1 and intact(p, data)), **a)
        dist.destroy_process_group()
        """,
    )
    res = finish(procs)
    for r in res:
        assert r["rc"] == 0, r["err"]
    zero, one = (r["results"][0] for r in res)
    assert zero["raised"] is None and zero["ranks"] == [0] and (zero["active"], zero["paused"]) == (0, 1), zero
    assert one["raised"] == "InvalidArgumentError" and "not a member of the group" in one["msg"], one
    assert one["intact"] and (one["active"], one["paused"]) == (1, 0), one
