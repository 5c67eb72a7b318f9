"""The job-wide layer (torch_memory_saver.distributed) without torch: several processes, each
preloaded on its own simulated device, agree through a file-based gather that stands in for
torch.distributed's all_gather_object (the layer's only use of it). Faults are injected on one
rank: out of memory on resume, a full disk on pause, a rank that dies before agreeing, a bad
chunk index. Every rank must end in the same state as the others and report the same error.
The same scenarios run over real torch.distributed (gloo) in test_gpu_distributed.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import BUF, PRELUDE, SIM_ALLOC, clean_env

RANK_CODE = """
import time
from torch_memory_saver import distributed as tmsd
RANK = int(os.environ["RANK"]); WORLD = int(os.environ["WORLD"]); DIR = os.environ["GATHER_DIR"]
MIB = 1 << 20
rounds = [0]

def gather(mine):
    # Each round: write ours, wait for everyone's (a dead rank never writes: a timeout).
    rounds[0] += 1
    d = os.path.join(DIR, f"round{rounds[0]}")
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{RANK}.tmp")
    with open(tmp, "w") as f:
        json.dump(mine, f)
    os.rename(tmp, os.path.join(d, f"{RANK}.json"))
    deadline = time.time() + float(os.environ.get("GATHER_TIMEOUT", "20"))
    while True:
        names = [os.path.join(d, f"{r}.json") for r in range(WORLD)]
        missing = [r for r, n in enumerate(names) if not os.path.exists(n)]
        if not missing:
            out = []
            for n in names:
                with open(n) as f:
                    out.append(json.load(f))
            return out
        if time.time() > deadline:
            raise TimeoutError(f"ranks {missing} did not answer")
        time.sleep(0.01)

def report(**kw):
    s = tag_stats(kw.pop("tag"))
    kw.update(active=s["active_allocations"], paused=s["paused_allocations"])
    print("RESULT " + json.dumps(kw), flush=True)

def fail_here(name, why):
    # This rank's own `tms.<name>` fails, out of memory (injected).
    def failing(*a, **k):
        raise tms_pkg.OutOfMemoryError(f"injected: {why}")
    setattr(tms, name, failing)

def leave_unrestored(tag, n):
    # A non-blocking resume of `tag` whose restore fails after it returned (the rank's
    # TMS_SIM_FAULTS arms it), its failure raised once by a wait: `n` bytes left unrestored.
    tms.resume(tag, non_blocking=True)
    try:
        tms.wait()
    except tms_pkg.TorchMemorySaverError:
        pass
    assert tag_stats(tag)["bytes_unrestored"] == n, tag_stats(tag)

def attempt(f, *a):
    try:
        out = f(*a, gather, RANK)
        return {"ok": True, "line": str(out), "total": out.total_bytes, "ranks": len(out.ranks)}
    except tmsd.DistributedError as e:
        return {"ok": False, "msg": str(e), "failed": sorted(e.failed)}
"""


def run_ranks(tmp_path, libtms, world: int, body: str, per_rank_env=None, timeout: int = 120) -> list:
    """Start `world` ranks running `body` at once; return each rank's RESULT dicts (in order)."""
    gdir = tmp_path / "gather"
    gdir.mkdir()
    procs = []
    for r in range(world):
        env = clean_env(
            LD_PRELOAD=libtms,
            TMS_BACKEND="sim",
            TMS_SIM_CAPACITY="256MiB",
            TMS_SOCKET_DIR=str(tmp_path / "sock"),
            RANK=str(r),
            WORLD=str(world),
            GATHER_DIR=str(gdir),
        )
        env.update((per_rank_env or {}).get(r, {}))
        src = PRELUDE + SIM_ALLOC + RANK_CODE + textwrap.dedent(body)
        procs.append(subprocess.Popen([sys.executable, "-c", src], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        results.append(
            {
                "rc": p.returncode,
                "results": [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")],
                "err": err[-3000:],
            }
        )
    return results


def test_every_rank_pauses_and_resumes_with_one_outcome(tmp_path, libtms):
    res = run_ranks(
        tmp_path,
        libtms,
        3,
        """
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        a = attempt(tmsd._pause_tag, "w")
        report(tag="w", step="pause", **a)
        b = attempt(tmsd._resume_tag, "w")
        report(tag="w", step="resume", intact=intact(p, data), **b)
        """,
    )
    for r in res:
        assert r["rc"] == 0, r["err"]
        pause, resume = r["results"]
        assert pause["ok"] and pause["ranks"] == 3 and pause["total"] == 3 * 8 << 20, pause
        assert "pause of tag 'w' on 3 ranks: 0.02 GiB released" in pause["line"], pause
        assert (pause["active"], pause["paused"]) == (0, 1), pause
        assert resume["ok"] and resume["intact"] and (resume["active"], resume["paused"]) == (1, 0), resume


def test_resume_out_of_memory_on_one_rank_leaves_every_rank_paused(tmp_path, libtms):
    # Rank 1's device fills while "w" is paused (another tag takes the room): its resume runs
    # out of memory, the others undo theirs, every rank raises naming rank 1; once the memory
    # is free a second job-wide resume brings every rank back intact.
    res = run_ranks(
        tmp_path,
        libtms,
        3,
        """
        p, data = alloc("w", 96 * MIB, RANK, enable_cpu_backup=True)
        a = attempt(tmsd._pause_tag, "w")
        hog = None
        if RANK == 1:
            hog, _ = alloc("hog", 200 * MIB, 9)
        b = attempt(tmsd._resume_tag, "w")
        report(tag="w", step="resume", **b)
        if hog is not None:
            assert cuda_free(hog) == 0
        c = attempt(tmsd._resume_tag, "w")
        report(tag="w", step="again", intact=intact(p, data), **c)
        """,
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        first, again = r["results"]
        assert not first["ok"] and first["failed"] == [1], first
        assert "rank 1" in first["msg"] and "OutOfMemoryError" in first["msg"], first
        assert "every rank undid it" in first["msg"], first
        assert (first["active"], first["paused"]) == (0, 1), (rank, first)
        assert again["ok"] and again["intact"] and (again["active"], again["paused"]) == (1, 0), (rank, again)


def test_a_resume_undo_is_not_blocked_by_an_allocation_kept_resident(tmp_path, libtms):
    # Issue 36, item 3: a resident allocation of the tag is active before the job-wide resume,
    # but a pause leaves it mapped, so the undo (a pause) is exact and must run: rank 1 fails,
    # and every rank ends as before, the resident one active and the other paused.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        """
        kept, _ = alloc("r", 4 * MIB, 7, enable_cpu_backup=True)
        size = ctypes.c_uint64(0)
        lib = tms._impl._binary_wrapper
        lib.check(lib.tms_keep_resident_ex(kept, ctypes.byref(size)))
        assert size.value == 4 * MIB, size.value
        p, data = alloc("r", 8 * MIB, RANK, enable_cpu_backup=True)
        tms.pause("r")
        assert tag_stats("r")["resident_allocations"] == 1, tag_stats("r")
        if RANK == 1:
            fail_here("resume", "the device is full")
        a = attempt(tmsd._resume_tag, "r")
        report(tag="r", step="resume", **a)
        """,
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (first,) = r["results"]
        assert not first["ok"] and first["failed"] == [1], (rank, first)
        assert "skipped" not in first["msg"] and "every rank undid it" in first["msg"], (rank, first)
        assert (first["active"], first["paused"]) == (1, 1), (rank, first)


def test_a_job_wide_pause_keeps_the_programs_chunk_state_record(tmp_path, libtms):
    # Issue 36, item 4: the job's pause records the chunk states for its own undo, in a record
    # of its own: the one the program saved with pause(save_chunk_state=True) is still there.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        """
        p, data = alloc("k", 8 * MIB, RANK, chunk=2 * MIB, enable_cpu_backup=True)
        tms.pause_chunks("k", [1])
        tms.pause("k", save_chunk_state=True)            # the program's record: [1, 0, 1, 1]
        tms.resume("k")
        a = attempt(tmsd._pause_tag, "k")
        b = attempt(tmsd._resume_tag, "k")
        tms.pause("k")
        tms.resume("k", restore_chunk_state=True)
        report(tag="k", step="after", states=tms.get_chunk_states("k"), a=a["ok"], b=b["ok"])
        """,
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (after,) = r["results"]
        assert after["a"] and after["b"], (rank, after)
        assert after["states"] == [True, False, True, True], (rank, after)


def test_a_full_disk_on_one_rank_undoes_the_pause_everywhere(tmp_path, libtms):
    # Rank 2's disk fills at its second write: its pause stops part-way; every rank resumes
    # what it paused, so every rank ends active with its contents, and the error names rank 2.
    disk = tmp_path / "disk"
    disk.mkdir()
    res = run_ranks(
        tmp_path,
        libtms,
        3,
        f"""
        tms.set_disk_backup_dir({str(disk)!r})
        bufs = [alloc("w", 16 * MIB, RANK * 4 + i, enable_disk_backup=True) for i in range(3)]
        a = attempt(tmsd._pause_tag, "w")
        report(tag="w", step="pause", intact=all(intact(p, d) for p, d in bufs), **a)
        """,
        per_rank_env={2: {"TMS_DISK_FAULTS": "write:2:ENOSPC", "TMS_DISK_BACKUP_CHUNK_MB": "4"}},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and p["failed"] == [2], (rank, p)
        assert "rank 2" in p["msg"] and "every rank undid it" in p["msg"], (rank, p)
        assert p["intact"] and (p["active"], p["paused"]) == (3, 0), (rank, p)


def test_a_pause_undo_leaves_what_was_paused_before_alone(tmp_path, libtms):
    # One allocation of the tag was paused before the job-wide pause; a failure elsewhere
    # undoes the pause, which brings back only what that pause paused.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        """
        old, _ = alloc("w", 4 * MIB, 1, enable_cpu_backup=True)
        tms.pause("w")
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)  # made active in a paused tag
        if RANK == 1:
            # Fails before pausing anything, as a pause refused for host memory does.
            fail_here("pause", "host memory is short")
        a = attempt(tmsd._pause_tag, "w")
        report(tag="w", step="pause", intact=intact(p, data), **a)
        """,
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and p["failed"] == [1], (rank, p)
        assert p["intact"], (rank, p)
        # The 8 MiB allocation is active again, the older one still paused.
        assert (p["active"], p["paused"]) == (1, 1), (rank, p)


def test_a_rank_that_dies_before_agreeing_makes_the_others_undo(tmp_path, libtms):
    res = run_ranks(
        tmp_path,
        libtms,
        3,
        """
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        if RANK == 2:
            tms.pause("w")
            os._exit(3)  # dies after acting, before agreeing
        a = attempt(tmsd._pause_tag, "w")
        report(tag="w", step="pause", intact=intact(p, data), **a)
        """,
        per_rank_env={r: {"GATHER_TIMEOUT": "3"} for r in range(3)},
    )
    assert res[2]["rc"] == 3
    for r in res[:2]:
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and "the group failed before the ranks could agree" in p["msg"], p
        assert "ranks [2] did not answer" in p["msg"] and "undid its own pause (done)" in p["msg"], p
        assert p["intact"] and (p["active"], p["paused"]) == (1, 0), p


def test_a_late_rank_never_leaves_the_job_half_paused(tmp_path, libtms):
    # Issue 36, item 2: rank 1 acts after rank 0 gave up waiting (and undid its pause); rank 1
    # still finds rank 0's first answer, but not its confirmation, so it undoes its own too.
    # Neither claims what it has not seen.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        """
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        if RANK == 1:
            time.sleep(3)
        a = attempt(tmsd._pause_tag, "w")
        report(tag="w", step="pause", intact=intact(p, data), **a)
        """,
        per_rank_env={r: {"GATHER_TIMEOUT": "2"} for r in range(2)},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and "has not seen the other ranks" in p["msg"], (rank, p)
        assert p["intact"] and (p["active"], p["paused"]) == (1, 0), (rank, p)


# A Ctrl-C (KeyboardInterrupt) on one rank, caught below as a program's own handler would
# catch it: what the rank was left as, and what the error it came with said. `ctrl_c_after`
# makes a call of the module raise it once the call itself has returned.
INTERRUPTED = """
def interrupted(f, *a):
    try:
        f(*a, gather, RANK)
    except tmsd.DistributedError as e:
        return {"raised": "DistributedError", "msg": str(e), "failed": sorted(e.failed)}
    except KeyboardInterrupt as e:
        c = e.__cause__
        return {"raised": "KeyboardInterrupt", "cause": type(c).__name__ if c else None, "msg": str(c or "")}
    return {"raised": None}

def ctrl_c_after(name):
    real = getattr(tms, name)
    def then_ctrl_c(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt
    setattr(tms, name, then_ctrl_c)
"""


def interrupted_pause(tmp_path, libtms, setup, timeout):
    """Two ranks pause tag "w" (8 MiB, CPU backup) after running `setup` (script lines: where
    the Ctrl-C comes); every rank must end with "w" active and intact. The reports of ranks 0
    and 1."""
    script = (
        INTERRUPTED
        + 'p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)\n'
        + textwrap.dedent(setup)
        + textwrap.dedent(
            """
            a = interrupted(tmsd._pause_tag, "w")
            # Read only where active: paused memory is not mapped (the read would crash).
            report(tag="w", intact=tag_stats("w")["active_allocations"] == 1 and intact(p, data), **a)
            """
        )
    )
    res = run_ranks(tmp_path, libtms, 2, script, per_rank_env={r: {"GATHER_TIMEOUT": timeout} for r in range(2)})
    for r in res:
        assert r["rc"] == 0, r["err"]
    zero, one = res[0]["results"][0], res[1]["results"][0]
    for p in (zero, one):
        assert p["intact"] and (p["active"], p["paused"]) == (1, 0), (p["active"], p["paused"], p)
    return zero, one


def test_a_ctrl_c_during_one_ranks_pause_undoes_it_on_every_rank(tmp_path, libtms):
    # Rank 1's pause is interrupted right after it paused (a Ctrl-C that lands once the C call
    # has returned): it fails that rank like any failure. Every rank undoes the pause, the others
    # raise DistributedError naming rank 1 without waiting for the group's timeout, and rank 1's
    # KeyboardInterrupt goes on to the program once its own pause is undone.
    zero, one = interrupted_pause(tmp_path, libtms, """
        if RANK == 1:
            ctrl_c_after("pause")
        """, "3")
    assert zero["raised"] == "DistributedError" and zero["failed"] == [1], zero
    assert "rank 1" in zero["msg"] and "KeyboardInterrupt" in zero["msg"], zero
    assert "every rank undid it" in zero["msg"], zero
    assert one["raised"] == "KeyboardInterrupt" and one["cause"] == "DistributedError", one
    assert "every rank undid it" in one["msg"], one


def test_a_ctrl_c_during_the_agreement_undoes_the_ranks_own_change(tmp_path, libtms):
    # Rank 1 paused, then Ctrl-C lands while it waits for the others: as when the group fails,
    # it has not seen them, so it undoes its own pause and its KeyboardInterrupt goes on saying
    # so (a DistributedError as its cause); rank 0, never answered, undoes its own too.
    zero, one = interrupted_pause(tmp_path, libtms, """
        if RANK == 1:
            def gather(mine):
                raise KeyboardInterrupt
        """, "2")
    assert zero["raised"] == "DistributedError" and "undid its own pause (done)" in zero["msg"], zero
    assert one["raised"] == "KeyboardInterrupt" and one["cause"] == "DistributedError", one
    assert "undid its own pause (done)" in one["msg"], one


def test_a_ctrl_c_during_the_undo_still_lets_the_ranks_agree(tmp_path, libtms):
    # Rank 0's pause fails; rank 1's undo (its resume) is interrupted as it returns. Rank 1
    # still tells the others how its undo went (not as done: it was interrupted), so rank 0 is
    # not left waiting for it until the group's timeout, and every rank raises naming it.
    zero, one = interrupted_pause(tmp_path, libtms, """
        if RANK == 0:
            fail_here("pause", "host memory is short")
        if RANK == 1:
            ctrl_c_after("resume")
        """, "3")
    assert zero["raised"] == "DistributedError" and zero["failed"] == [0], zero
    assert "not every rank could undo it: rank 1: failed: KeyboardInterrupt" in zero["msg"], zero
    assert one["raised"] == "KeyboardInterrupt" and one["cause"] == "DistributedError", one
    assert "rank 1: failed: KeyboardInterrupt" in one["msg"], one


def test_chunks_of_one_rank_fail_and_every_rank_restores_its_chunks(tmp_path, libtms):
    # Rank 0 asks for a chunk its allocation lacks: it fails before changing anything; rank 1
    # paused chunks 1-2 (chunk 3 was paused before) and must resume exactly 1-2.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        """
        p, data = alloc("kv", 8 * MIB, RANK, chunk=2 * MIB, enable_cpu_backup=True)
        tms.pause_chunks("kv", [3])
        idx = [1, 2, 7] if RANK == 0 else [1, 2]
        a = attempt(lambda g, r: tmsd._chunk_op(
            True, "kv", lambda: tms.pause_chunks("kv", idx), tmsd._indices_asked(idx), "chunks", "pause_chunks", g, r))
        report(tag="kv", step="chunks", states=tms.get_chunk_states("kv"),
               intact=ctypes.string_at(p, 6 * MIB) == data[: 6 * MIB], **a)
        """,
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (c,) = r["results"]
        assert not c["ok"] and c["failed"] == [0], (rank, c)
        assert c["states"] == [True, True, True, False], (rank, c)
        assert c["intact"], (rank, c)


# A stand-in for torch without CUDA whose torch.distributed is initialised with one rank: its
# all_gather_object hands back the rank's own object and, as the real one does
# (distributed_c10d._tensor_to_object), reads it through numpy.
FAKE_DIST = """
import types
def all_gather_object(out, obj, group=None):
    import numpy  # noqa: F401
    out[0] = json.loads(json.dumps(obj))
dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 0,
                             get_world_size=lambda group=None: 1, all_gather_object=all_gather_object)
sys.modules["torch"] = types.SimpleNamespace(distributed=dist, cuda=types.SimpleNamespace(is_available=lambda: False))
sys.modules["torch.distributed"] = dist
from torch_memory_saver import distributed as tmsd
"""


def test_without_numpy_every_call_is_refused_before_acting(preloaded):
    r = preloaded(
        SIM_ALLOC
        + FAKE_DIST
        + """
p, data = alloc("w", 8 << 20, 1, enable_cpu_backup=True)
q, _ = alloc("kv", 8 << 20, 2, chunk=2 << 20)
sys.modules["numpy"] = None  # as where numpy is not installed: importing it raises ImportError
for call in (lambda: tmsd.pause("w"), lambda: tmsd.pause_chunks("kv", [0])):
    try:
        call()
        raise SystemExit("should refuse")
    except tms_pkg.UnsupportedError as e:
        print("REFUSED", e)
assert tag_stats("w")["paused_allocations"] == 0 and intact(p, data)
assert tms.get_chunk_states("kv") == [True] * 4
print("OK")
"""
    )
    assert r.stdout.count("REFUSED torch_memory_saver.distributed needs numpy") == 2, r.stdout
    assert r.stdout.strip().endswith("OK"), r.stdout


def test_chunk_calls_take_the_existing_librarys_keywords(preloaded):
    r = preloaded(
        SIM_ALLOC
        + FAKE_DIST
        + """
sys.modules["numpy"] = types.ModuleType("numpy")  # all the stand-in gather needs of it
p, _ = alloc("kv", 8 << 20, 2, chunk=2 << 20)
out = tmsd.pause_chunks(tag="kv", chunk_indices=[1, 3])
assert tms.get_chunk_states("kv") == [True, False, True, False], tms.get_chunk_states("kv")
tmsd.resume_chunks("kv", chunk_indices=[3])
assert tms.get_chunk_states("kv") == [True, False, True, True]
for bad in (dict(tag="kv"), dict(tag="kv", chunk_indices=[1], indices=[1])):
    try:
        tmsd.pause_chunks(**bad)
        raise SystemExit(f"should refuse {bad}")
    except TypeError as e:
        print("TYPE", e)
for call in (lambda: tmsd.pause_range(7, 0, 1), lambda: tmsd.pause_chunks(7, [0])):
    try:
        call()
        raise SystemExit("a target that is neither a tag nor a tensor was taken")
    except TypeError as e:
        print("TARGET", e)
print("OK", out.ok)
"""
    )
    assert "TYPE pause_chunks() needs the chunk indices" in r.stdout, r.stdout
    assert "TYPE pause_chunks() got the chunk indices twice" in r.stdout, r.stdout
    assert r.stdout.count("TARGET expected a tag or a torch.Tensor, not int") == 2, r.stdout
    assert r.stdout.strip().endswith("OK True"), r.stdout


def test_a_resume_of_every_tag_undoes_the_tags_it_changed(tmp_path, libtms):
    # Tag "a" paused, tag "b" wholly active on every rank; rank 1's resume of every tag fails.
    # The resume changed only "a" (an active tag is left as it is), so pausing "a" again undoes
    # it exactly: every rank is as before, and says so (before, the undo was skipped whole
    # because "b" was active, and the job stayed half resumed).
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        """
        pa, da = alloc("a", 8 * MIB, RANK, enable_cpu_backup=True)
        pb, db = alloc("b", 4 * MIB, RANK + 5, enable_cpu_backup=True)
        tms.pause("a")
        if RANK == 1:
            fail_here("resume", "the device is full")
        r = attempt(tmsd._resume_tag, None)
        b = tag_stats("b")
        report(tag="a", step="resume", b=(b["active_allocations"], b["paused_allocations"]), **r)
        """,
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (first,) = r["results"]
        assert not first["ok"] and first["failed"] == [1], (rank, first)
        assert "every rank undid it" in first["msg"] and "skipped" not in first["msg"], (rank, first)
        assert (first["active"], first["paused"]) == (0, 1), (rank, first)
        assert first["b"] == [1, 0], (rank, first)


def test_an_undo_never_calls_a_rank_with_memory_being_restored_as_before(tmp_path, libtms):
    # Rank 0's own non-blocking resume of "w" is still restoring (a slow link) when the job's
    # resume of "w" starts; rank 1's fails. A pause would not bring rank 0 back to "restoring":
    # its undo is skipped and said so, the message names it, and its restore completes.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        """
        p, data = alloc("w", 64 * MIB, RANK, enable_cpu_backup=True)
        tms.pause("w")
        if RANK == 0:
            tms.resume("w", non_blocking=True)
            assert tag_stats("w")["restoring_allocations"] == 1, tag_stats("w")
        if RANK == 1:
            fail_here("resume", "the device is full")
        r = attempt(tmsd._resume_tag, "w")
        landed = tms.wait() if RANK == 0 else None
        report(tag="w", step="resume", landed=landed, intact=intact(p, data) if RANK == 0 else None, **r)
        """,
        per_rank_env={0: {"TMS_SIM_BANDWIDTH": "32MiB"}},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (first,) = r["results"]
        assert not first["ok"] and first["failed"] == [1], (rank, first)
        assert "not every rank could undo it" in first["msg"] and "rank 0: skipped" in first["msg"], (rank, first)
        assert "restoring" in first["msg"], (rank, first)
    zero = res[0]["results"][0]
    assert zero["landed"] is True and zero["intact"] and (zero["active"], zero["paused"]) == (1, 0), zero


def test_an_undo_names_a_rank_whose_unrestored_memory_the_call_settled(tmp_path, libtms):
    # Rank 0's own non-blocking resume of "w" failed after it returned: "w" is unrestored (its
    # memory held, the failure kept). The job's pause gives that memory back and settles the
    # failure; rank 1's pause fails, and the undo restores rank 0's record, paused: not as
    # before, and the message says so instead of "every rank is as before".
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        """
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        tms.pause("w")
        if RANK == 0:
            leave_unrestored("w", 8 * MIB)
        else:
            tms.resume("w")
            fail_here("pause", "the host is full")
        r = attempt(tmsd._pause_tag, "w")
        report(tag="w", step="pause", **r)
        """,
        per_rank_env={0: {"TMS_SIM_FAULTS": "copy_h2d:1"}},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (first,) = r["results"]
        assert not first["ok"] and first["failed"] == [1], (rank, first)
        assert "not every rank could undo it" in first["msg"], (rank, first)
        assert "rank 0: done, but not as before for 'w'" in first["msg"], (rank, first)


def test_a_resume_undo_pauses_unrestored_memory_again_and_says_so(tmp_path, libtms):
    # As above, for a resume: rank 0's "w" is unrestored before the job's resume, which
    # restores it; rank 1's fails. Rank 0's undo pauses "w" again, like every rank's, but that
    # is paused, not unrestored: its undo and the error say it is not as before.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        """
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        tms.pause("w")
        if RANK == 0:
            leave_unrestored("w", 8 * MIB)
        else:
            fail_here("resume", "the device is full")
        r = attempt(tmsd._resume_tag, "w")
        s = tag_stats("w")
        report(tag="w", step="resume", unrestored=s["bytes_unrestored"], **r)
        """,
        per_rank_env={0: {"TMS_SIM_FAULTS": "copy_h2d:1"}},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (first,) = r["results"]
        assert not first["ok"] and first["failed"] == [1], (rank, first)
        assert "rank 0: done, but not as before for 'w'" in first["msg"], (rank, first)
        assert (first["active"], first["paused"], first["unrestored"]) == (0, 1, 0), (rank, first)


def test_without_torch_a_call_over_torch_distributed_is_unsupported_saying_why(preloaded):
    # It used to raise a bare ModuleNotFoundError, not one of the package's errors.
    r = preloaded(
        """
        sys.modules["torch"] = None  # as where PyTorch is not installed
        from torch_memory_saver import distributed as tmsd
        try:
            tmsd.pause("a")
            raise SystemExit("should have raised")
        except tms_pkg.UnsupportedError as e:
            print("MSG", e)
        """
    )
    assert "needs PyTorch (torch.distributed)" in r.stdout, r.stdout


def test_a_gather_that_pairs_ranks_in_different_steps_fails_and_undoes():
    """The agreement reads what it gathered: a rank late by a step (the others gave up on it,
    undid theirs and went on; its collective pairs with their next one) must not take another
    step's data for an outcome, nor for a confirmation. Either way the rank undoes its own change
    and raises DistributedError, never returns success in a half-changed job nor a bare error."""
    from torch_memory_saver import distributed as tmsd

    def run(answers):
        calls = {"act": 0, "undo": 0}
        sent = []

        def gather(mine):
            sent.append(mine)
            return answers[len(sent) - 1](mine)

        def act():
            calls["act"] += 1

        def undo():
            calls["undo"] += 1

        try:
            out = tmsd._agree("pause", "tag 'kv'", act, undo, lambda: 0, gather, 0)
        except tmsd.DistributedError as e:
            return calls, f"DistributedError: {e}"
        except BaseException as e:  # noqa: BLE001 - what the test is about
            return calls, f"{type(e).__name__}: {e}"
        return calls, f"returned ok={out.ok}"

    other_ok = {"rank": 1, "host": "h", "pid": 1, "ok": True, "bytes": 0, "seconds": 0.0, "error": None, "message": None}
    # The other rank is a step ahead: its confirmation of an earlier call comes back as its outcome.
    calls, said = run([lambda mine: [mine, {"rank": 1, "confirmed": True}]])
    assert said.startswith("DistributedError") and calls["undo"] == 1, (said, calls)
    # The other rank is a step behind: its outcome (of another call) comes back as its confirmation.
    calls, said = run([lambda mine: [mine, other_ok], lambda mine: [mine, dict(other_ok, ok=False)]])
    assert said.startswith("DistributedError") and calls["undo"] == 1, (said, calls)


# torch.distributed as the ranks of run_ranks see it through the package's public calls: an
# initialised group of WORLD ranks on the backend $BACKEND, whose all_gather_object is the
# file-based gather (counted, so a test can tell whether a rank reached the agreement).
RANKS_OVER_FAKE_DIST = """
import types
gathers = [0]
def all_gather_object(out, obj, group=None):
    gathers[0] += 1
    out[:] = gather(obj)
dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: RANK,
                             get_world_size=lambda group=None: WORLD, all_gather_object=all_gather_object,
                             get_backend=lambda group=None: os.environ["BACKEND"])
sys.modules["torch"] = types.SimpleNamespace(distributed=dist, cuda=types.SimpleNamespace(is_available=lambda: False))
sys.modules["torch.distributed"] = dist
sys.modules["numpy"] = types.ModuleType("numpy")  # all the stand-in gather needs of it

def public(call, *a):
    try:
        out = call(*a)
        return {"raised": None, "line": str(out)}
    except BaseException as e:  # noqa: BLE001 - which error, on which rank, is what is tested
        return {"raised": type(e).__name__, "msg": str(e), "failed": sorted(getattr(e, "failed", {}))}
"""


def test_one_ranks_nccl_in_all_tags_refuses_every_tag_on_every_rank_over_nccl(tmp_path, libtms):
    # Only rank 0 includes NCCL's communicators in every tag (its own TMS_NCCL_IN_ALL=1), and the
    # group is NCCL's. Rank 0 must not act (its pause would suspend the communicator the ranks
    # agree over), and it must not refuse alone either: rank 1 would pause and then wait in the
    # agreement for it until the group's timeout. Both raise the same DistributedError naming
    # rank 0, rank 1 having undone its pause; a resume does the same; over gloo both succeed.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        RANKS_OVER_FAKE_DIST
        + textwrap.dedent("""
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        def active_and_intact():  # reading paused memory would fault
            return tag_stats("w")["active_allocations"] == 1 and intact(p, data)
        for step, call in (("pause", tmsd.pause), ("resume", tmsd.resume)):
            t0 = time.time()
            a = public(call)
            report(tag="w", step=step, intact=active_and_intact(), gathers=gathers[0], s=time.time() - t0, **a)
        os.environ["BACKEND"] = "gloo"
        a = public(tmsd.pause)
        b = public(tmsd.resume)
        report(tag="w", step="gloo", intact=active_and_intact(), pause=a, resume=b)
        """),
        per_rank_env={0: {"TMS_NCCL_IN_ALL": "1", "BACKEND": "nccl"}, 1: {"BACKEND": "nccl"}},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        pause, resume, gloo = r["results"]
        for x in (pause, resume):
            assert x["raised"] == "DistributedError" and x["failed"] == [0], (rank, x)
            assert "rank 0" in x["msg"] and "nccl_in_all_tags" in x["msg"], (rank, x)
            assert "every rank undid it" in x["msg"] and x["s"] < 10, (rank, x)
            assert x["intact"] and (x["active"], x["paused"]) == (1, 0), (rank, x)
        assert (pause["gathers"], resume["gathers"]) == (2, 4), (rank, pause, resume)
        assert gloo["pause"]["raised"] is None and gloo["resume"]["raised"] is None, (rank, gloo)
        assert gloo["intact"] and (gloo["active"], gloo["paused"]) == (1, 0), (rank, gloo)


def test_every_ranks_nccl_in_all_tags_refuses_every_tag_over_nccl_before_acting(tmp_path, libtms):
    # Every rank has the setting: each refuses without acting, through the agreement, and names
    # them all; the tag "nccl" itself (the same on every rank) is refused before any collective.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        RANKS_OVER_FAKE_DIST
        + textwrap.dedent("""
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        a = public(tmsd.pause)
        report(tag="w", step="pause", gathers=gathers[0], **a)
        b = public(tmsd.pause, "nccl")
        report(tag="w", step="nccl", gathers=gathers[0], **b)
        """),
        per_rank_env={r: {"TMS_NCCL_IN_ALL": "1", "BACKEND": "nccl", "GATHER_TIMEOUT": "5"} for r in range(2)},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        pause, nccl = r["results"]
        assert pause["raised"] == "DistributedError" and pause["failed"] == [0, 1], (rank, pause)
        assert (pause["active"], pause["paused"], pause["gathers"]) == (1, 0, 2), (rank, pause)
        assert nccl["raised"] == "InvalidArgumentError" and "group=" in nccl["msg"], (rank, nccl)
        assert nccl["gathers"] == 2, (rank, nccl)


def test_chunk_calls_by_tensor_agree_where_the_ranks_tensors_lie_at_different_addresses(tmp_path, libtms):
    # Each rank's tensor is its own, at an address of its own (rank 1 allocates another first).
    # The ranks agree on the call, not on where each one's tensor lies: each call succeeds on
    # both, with the same outcome (the step the ranks compared named rank 0's address on rank 0
    # and rank 1's on rank 1, so every call failed as "not at the same step" and was undone).
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        RANKS_OVER_FAKE_DIST
        + textwrap.dedent(BUF)
        + textwrap.dedent("""
        if RANK == 1:
            alloc("pad", 6 * MIB, 9)
        p, data = alloc("kv", 8 * MIB, RANK, chunk=2 * MIB, enable_cpu_backup=True)
        t = Buf(p, 8 * MIB)
        report(tag="kv", step="addr", addr=p)
        for call, args in [(tmsd.pause_range, (t, 2 * MIB, 6 * MIB)), (tmsd.resume_range, (t, 0, 8 * MIB)),
                           (tmsd.pause_chunks, (t, [0, 3])), (tmsd.resume_chunks, (t, [0]))]:
            a = public(call, *args)
            report(tag="kv", step=call.__name__, states=tms.get_chunk_states("kv"), **a)
        """),
    )
    for r in res:
        assert r["rc"] == 0, r["err"]
    assert res[0]["results"][0]["addr"] != res[1]["results"][0]["addr"], res
    want = {
        "pause_range": [True, False, False, True],
        "resume_range": [True] * 4,
        "pause_chunks": [False, True, True, False],
        "resume_chunks": [True, True, True, False],
    }
    lines = [[], []]
    for rank, r in enumerate(res):
        for c in r["results"][1:]:
            assert c["raised"] is None, (rank, c)
            assert c["states"] == want[c["step"]], (rank, c)
            lines[rank].append(c["line"])
    assert lines[0] == lines[1], lines
    assert "pause_range of bytes [2097152, 6291456) of each rank's tensor on 2 ranks" in lines[0][0], lines


# A gather that lets another thread of a rank's program act while the ranks agree on the
# outcome: what the rank put in `meanwhile` runs then (its failure, if any, in `meanwhile_failed`).
MEANWHILE = """
import threading
meanwhile, meanwhile_failed = [], []
gather_between = gather
def gather(mine):
    if mine["step"][2] == "outcome" and meanwhile:
        def run(f=meanwhile.pop()):
            try:
                f()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                meanwhile_failed.append(repr(e))
        t = threading.Thread(target=run)
        t.start()
        t.join()
    return gather_between(mine)
"""


# Buf, and MEANWHILE.
CHUNK_HELPERS = BUF + MEANWHILE


def test_a_chunk_undo_leaves_the_chunks_the_program_moved_meanwhile(tmp_path, libtms):
    # Rank 1's allocation has 2 chunks only: its calls fail, changing nothing. While the ranks
    # agree, another thread of rank 0's program pauses (then resumes) chunk 0, which the call
    # was not asked for. Rank 0's undo reverses the chunks the call moved only: chunk 0 stays as
    # the program made it (the undo reversed it too, while saying every rank was as before).
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        RANKS_OVER_FAKE_DIST
        + textwrap.dedent(CHUNK_HELPERS)
        + textwrap.dedent("""
        n = (4 if RANK == 1 else 8) * MIB
        p, data = alloc("kv", n, RANK, chunk=2 * MIB, enable_cpu_backup=True)
        t = Buf(p, n)
        if RANK == 0:
            tms.pause_chunks("kv", [3])
            meanwhile.append(lambda: tms.pause_chunks("kv", [0]))
        a = public(tmsd.pause_chunks, "kv", [1, 2])
        report(tag="kv", step="pause_chunks", states=tms.get_chunk_states("kv"), **a)
        tms.pause("kv")
        if RANK == 0:
            meanwhile.append(lambda: tms.resume_chunks(t, [0]))
        b = public(tmsd.resume_range, t, 2 * MIB, 6 * MIB)
        report(tag="kv", step="resume_range", states=tms.get_chunk_states("kv"), **b)
        assert not meanwhile_failed, meanwhile_failed
        """),
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        paused, resumed = r["results"]
        for c in (paused, resumed):
            assert c["raised"] == "DistributedError" and c["failed"] == [1], (rank, c)
            assert "every rank undid it" in c["msg"], (rank, c)
        if rank == 0:
            assert paused["states"] == [False, True, True, False], (rank, paused)
            assert resumed["states"] == [True, False, False, False], (rank, resumed)
        else:
            assert (paused["states"], resumed["states"]) == ([True, True], [False, False]), (rank, r)


def test_a_failed_range_is_undone_on_the_chunks_it_was_to_act_on(tmp_path, libtms):
    # Rank 1's device fails to release the second chunk its pause_range of chunks 1-2 unmapped:
    # the call fails with both chunks paused. Each rank's undo resumes what the range moved,
    # which the library said before acting (the error carries it), with the contents intact.
    # A range call whose error does not say (an implementation of its own) is not guessed at:
    # the undo skips, naming the chunks it left.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        RANKS_OVER_FAKE_DIST
        + textwrap.dedent(CHUNK_HELPERS)
        + textwrap.dedent("""
        p, data = alloc("kv", 8 * MIB, RANK, chunk=2 * MIB, enable_cpu_backup=True)
        t = Buf(p, 8 * MIB)
        a = public(tmsd.pause_range, t, 2 * MIB, 6 * MIB)
        report(tag="kv", step="failed", states=tms.get_chunk_states("kv"), intact=intact(p, data), **a)
        if RANK == 1:
            def pause_range_saying_nothing(tensor, start, end):
                tms_pkg.torch_memory_saver.pause_chunks(t, [1])
                raise tms_pkg.InternalError("injected: failed, not saying what it was to act on")
            tms.pause_range = pause_range_saying_nothing
        b = public(tmsd.pause_range, t, 2 * MIB, 4 * MIB)
        report(tag="kv", step="unsaid", states=tms.get_chunk_states("kv"), **b)
        """),
        per_rank_env={1: {"TMS_SIM_FAULTS": "release:2"}},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        failed, unsaid = r["results"]
        assert failed["raised"] == "DistributedError" and failed["failed"] == [1], (rank, failed)
        assert "cuMemRelease" in failed["msg"] and "every rank undid it" in failed["msg"], (rank, failed)
        assert failed["states"] == [True] * 4 and failed["intact"], (rank, failed)
        assert unsaid["raised"] == "DistributedError" and unsaid["failed"] == [1], (rank, unsaid)
        assert "rank 1: skipped: the pause_range failed without saying which chunks" in unsaid["msg"], (rank, unsaid)
        assert unsaid["states"] == [True, rank == 0, True, True], (rank, unsaid)


def test_a_pause_that_failed_changing_nothing_is_not_undone_when_the_program_changed_the_tag(tmp_path, libtms):
    # Rank 1's pause fails at its first copy, having changed nothing (its record of the chunk
    # states written all the same). While the ranks agree, another thread of rank 1's program
    # pauses chunk 0, so the tag's active bytes are not what they were: that tells nothing of
    # what the failed pause did, which the library says. Rank 1 must not undo it: the undo
    # resumed the program's chunk 0 from the record.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        MEANWHILE
        + textwrap.dedent("""
        p, data = alloc("w", 8 * MIB, RANK, chunk=2 * MIB, enable_cpu_backup=True)
        if RANK == 1:
            meanwhile.append(lambda: tms.pause_chunks("w", [0]))
        a = attempt(tmsd._pause_tag, "w")
        report(tag="w", step="pause", states=tms.get_chunk_states("w"), meanwhile=meanwhile_failed, **a)
        """),
        per_rank_env={1: {"TMS_SIM_FAULTS": "copy_d2h:1"}},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and p["failed"] == [1] and "every rank undid it" in p["msg"], (rank, p)
        assert "injected fault" in p["msg"] and not p["meanwhile"], (rank, p)
        assert p["states"] == ([True] * 4 if rank == 0 else [False, True, True, True]), (rank, p)


def test_a_pause_that_failed_part_way_is_undone_when_the_program_allocated_as_much(tmp_path, libtms):
    # Rank 1's pause fails releasing its third allocation, the first it paused left paused (the
    # library says it changed that). While the ranks agree, another thread of rank 1's program
    # allocates in the tag as many bytes as the pause took, so the tag's active bytes are as
    # before. Rank 1 must still undo its pause: the undo was skipped, that allocation left
    # paused while every rank was said to be as before.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        MEANWHILE
        + textwrap.dedent("""
        bufs = [alloc("w", 8 * MIB, RANK * 4 + i, enable_cpu_backup=True) for i in range(3)]
        before = tag_stats("w")["bytes_active"]
        def allocate_as_much():
            taken = before - tag_stats("w")["bytes_active"]
            assert taken == 8 * MIB, taken
            bufs.append(alloc("w", taken, 9, enable_cpu_backup=True))
        if RANK == 1:
            meanwhile.append(allocate_as_much)
        a = attempt(tmsd._pause_tag, "w")
        s = tag_stats("w")
        report(tag="w", step="pause", intact=not s["paused_allocations"] and all(intact(*b) for b in bufs),
               meanwhile=meanwhile_failed, **a)
        """),
        per_rank_env={1: {"TMS_SIM_FAULTS": "release:1"}},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and p["failed"] == [1] and "every rank undid it" in p["msg"], (rank, p)
        assert "cuMemRelease" in p["msg"] and not p["meanwhile"], (rank, p)
        assert p["intact"] and (p["active"], p["paused"]) == (3 + rank, 0), (rank, p)


def _resume_while_a_thread_allocates(tmp_path, libtms, rank, backup, rank_1_fails, settled, in_place=False):
    """Every rank pauses its own "w" (8 MiB, backed up), then resumes it job-wide; rank 1 is
    made to fail by ``rank_1_fails`` (code run first), and while the ranks agree another thread
    of rank ``rank`` allocates 2 MiB in "w" (backed up or not). With ``in_place``, "w" also has
    a 2 MiB allocation (backed up), which that thread frees first: the new one is made in its
    place, of its size. Each rank's report: the resume's, and ``new_intact``, whether the new
    allocation is there, intact, with ``settled`` (a condition on the tag's numbers ``s``) true."""
    return run_ranks(
        tmp_path,
        libtms,
        2,
        MEANWHILE
        + textwrap.dedent(f"""
        p, data = alloc("w", 8 * MIB, RANK, enable_cpu_backup=True)
        old = alloc("w", 2 * MIB, RANK + 2, enable_cpu_backup=True)[0] if {in_place} else None
        tms.pause("w")
        new = []
        if RANK == 1:
            {rank_1_fails}
        def make():
            if old is not None:
                assert cuda_free(old) == 0
            new.append(alloc("w", 2 * MIB, 5, enable_cpu_backup={backup}))
        if RANK == {rank}:
            meanwhile.append(make)
        a = attempt(tmsd._resume_tag, "w")
        s = tag_stats("w")
        report(tag="w", step="resume", new_intact=bool(new) and {settled} and intact(*new[0]),
               meanwhile=meanwhile_failed, **a)
        """),
    )


def test_a_resume_that_failed_changing_nothing_leaves_the_programs_new_allocation_alone(tmp_path, libtms):
    # Rank 1's device is full: its resume of the paused tag runs out of memory, changing
    # nothing. While the ranks agree, another thread of rank 1's program allocates in the tag.
    # Rank 1 must not undo its resume (the library says it changed nothing): pausing the tag
    # again paused the program's new allocation.
    res = _resume_while_a_thread_allocates(
        tmp_path, libtms, 1, True, 'alloc("hog", 250 * MIB, 9)', 's["active_allocations"] == 1'
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and p["failed"] == [1] and "OutOfMemoryError" in p["msg"], (rank, p)
        assert "every rank undid it" in p["msg"] and not p["meanwhile"], (rank, p)
        if rank == 0:
            assert (p["active"], p["paused"]) == (0, 1), (rank, p)
        else:
            assert p["new_intact"] and (p["active"], p["paused"]) == (1, 1), (rank, p)


def test_a_chunk_pause_that_failed_changing_nothing_leaves_the_chunk_the_program_paused(tmp_path, libtms):
    # Rank 1's pause of chunks 1-2 fails at its first copy, changing nothing. While the ranks
    # agree, another thread of rank 1's program pauses chunk 1, one the call was asked for.
    # Rank 1 must not undo its call (the library says it changed nothing): the undo resumed
    # chunk 1, taken for one the call had paused.
    res = run_ranks(
        tmp_path,
        libtms,
        2,
        RANKS_OVER_FAKE_DIST
        + textwrap.dedent(MEANWHILE)
        + textwrap.dedent("""
        p, data = alloc("kv", 8 * MIB, RANK, chunk=2 * MIB, enable_cpu_backup=True)
        if RANK == 1:
            meanwhile.append(lambda: tms.pause_chunks("kv", [1]))
        a = public(tmsd.pause_chunks, "kv", [1, 2])
        report(tag="kv", step="pause_chunks", states=tms.get_chunk_states("kv"), meanwhile=meanwhile_failed, **a)
        """),
        per_rank_env={1: {"TMS_SIM_FAULTS": "copy_d2h:1"}},
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (c,) = r["results"]
        assert c["raised"] == "DistributedError" and c["failed"] == [1], (rank, c)
        assert "every rank undid it" in c["msg"] and not c["meanwhile"], (rank, c)
        assert c["states"] == ([True] * 4 if rank == 0 else [True, False, True, True]), (rank, c)


@pytest.mark.parametrize("in_place", [False, True], ids=["allocated", "made_in_place_of_a_freed_one"])
def test_a_resume_undo_leaves_alone_a_tag_the_program_allocated_in_meanwhile(tmp_path, libtms, in_place):
    # Rank 0's resume of the paused "w" succeeds, rank 1's fails. While the ranks agree, another
    # thread of rank 0's program allocates in "w" (no backup) and fills it. A pause of "w" would
    # take that allocation too (its contents lost, unmapped under the thread using it): rank 0's
    # undo skips "w" and says so. It paused "w" whole, while saying every rank was as before.
    # `in_place`: the thread first frees another allocation of "w" of that size, so the tag's
    # count and requested bytes are as before; the undo, comparing only those, paused the new one.
    res = _resume_while_a_thread_allocates(
        tmp_path, libtms, 0, False, 'fail_here("resume", "the device is full")', 's["paused_allocations"] == 0',
        in_place,
    )
    for rank, r in enumerate(res):
        assert r["rc"] == 0, r["err"]
        (p,) = r["results"]
        assert not p["ok"] and p["failed"] == [1] and not p["meanwhile"], (rank, p)
        assert "not every rank could undo it: rank 0: skipped" in p["msg"], (rank, p)
        assert "the program allocated or freed memory in 'w' during the call" in p["msg"], (rank, p)
    zero, one = res[0]["results"][0], res[1]["results"][0]
    # Rank 0: the old allocation (8 MiB) and the new one (2 MiB), both active; with `in_place`,
    # the 2 MiB one of before is gone. Rank 1: what it paused, still paused.
    assert zero["new_intact"] and (zero["active"], zero["paused"]) == (2, 0), zero
    assert (one["active"], one["paused"]) == (0, 2 if in_place else 1), one
