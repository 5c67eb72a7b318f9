"""NCCL's communicators as the tag ``"nccl"`` on real GPUs (the GPU suite; the simulated
device's version is test_nccl.py and tests/tests/nccl.rs). A one-rank NCCL process group in
both hook modes: all-reduce right before, memory given back at the pause (``cudaMemGetInfo``
and NCCL's own numbers), all-reduce right after the resume, through the API and through tmsctl;
a buffer NCCL registered inside a pauseable region kept mapped or the pause refused (preload
mode, where the library sees registrations). Two ranks on two GPUs: pausing over a gloo group
with ``torch_memory_saver.distributed``. Needs torch with NCCL; the tag itself needs NCCL
2.29.7 or newer, and with an older one the tests check that the tag says so."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)
import torch.distributed  # noqa: E402

if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):  # pragma: no cover
    pytest.skip("torch.distributed without NCCL", allow_module_level=True)

import torch_memory_saver as tms_pkg  # noqa: E402

from conftest import clean_env  # noqa: E402

MODES = ["preload", "torch"]
SUSPEND_SINCE = (2, 29, 7)


def nccl_version() -> tuple:
    v = torch.cuda.nccl.version()
    return tuple(v) if isinstance(v, tuple) else (v // 10000, v // 100 % 100, v % 100)


HAS_SUSPEND = nccl_version() >= SUSPEND_SINCE

RANK = """
import ctypes, datetime, json, os, subprocess, sys, time
import torch, torch.distributed as dist
import torch_memory_saver as tms_pkg
from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = os.environ["TEST_HOOK_MODE"]
RANK = int(os.environ["RANK"]); WORLD = int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(RANK)
DEV = torch.device("cuda", RANK)
MIB = 1 << 20
dist.init_process_group("nccl", init_method="file://" + os.environ["INIT_FILE"], rank=RANK, world_size=WORLD,
                        device_id=DEV, timeout=datetime.timedelta(seconds=120))

def free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]

def all_reduce_ok(group=None):
    x = torch.arange(1 << 20, dtype=torch.float32, device=DEV)
    dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    return bool(torch.equal(x, torch.arange(1 << 20, dtype=torch.float32, device=DEV) * WORLD))

def nccl():
    t = next(t for t in tms.stats()["tags"] if t["tag"] == "nccl")
    return t["nccl"]

def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

def tmsctl(*args):
    exe = os.path.join(os.path.dirname(sys.executable), "tmsctl")
    r = subprocess.run([exe, *args, "--pid", str(os.getpid())], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout
"""


def start(tmp_path, world: int, mode: str, body: str, **extra: str) -> list:
    procs = []
    for r in range(world):
        env = clean_env(
            RANK=str(r),
            WORLD_SIZE=str(world),
            INIT_FILE=str(tmp_path / "init"),
            TEST_HOOK_MODE=mode,
            TMS_SOCKET_DIR=str(tmp_path / "sock"),
            PYTHONUNBUFFERED="1",
            # NCCL's own memory comes from CUDA's virtual memory management (what it suspends).
            NCCL_CUMEM_ENABLE="1",
        )
        if mode == "preload":
            env["LD_PRELOAD"] = tms_pkg.get_binary_path()
        env.update(extra)
        src = RANK + textwrap.dedent(body)
        procs.append(subprocess.Popen([sys.executable, "-c", src], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def results(procs, timeout=600) -> list:
    out = []
    for p in procs:
        o, e = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{o[-4000:]}\nstderr:\n{e[-6000:]}"
        out.append([json.loads(x[7:]) for x in o.splitlines() if x.startswith("RESULT ")])
    return out


@pytest.mark.skipif(not HAS_SUSPEND, reason=f"NCCL {nccl_version()} lacks ncclCommSuspend")
@pytest.mark.parametrize("mode", MODES)
def test_one_rank_pause_gives_nccls_memory_back_and_resume_restores_it(tmp_path, mode):
    (r,) = results(start(tmp_path, 1, mode, """
        assert all_reduce_ok()
        s = nccl()
        assert s["communicators"] >= 1 and s["suspendable_bytes"] > 0, s
        f0 = free()
        tms.pause("nccl")
        f1 = free()
        paused = nccl()
        tms.resume("nccl")
        f2 = free()
        ok_after = all_reduce_ok()
        # The same through tmsctl (in torch mode it acts on those stats() handed over).
        tms.stats()
        out = tmsctl("pause", "--tag", "nccl")
        f3 = free()
        via_ctl = nccl()
        tmsctl("resume", "--tag", "nccl")
        report(suspendable=s["suspendable_bytes"], given=f1 - f0, retaken=f1 - f2, after=ok_after,
               suspended=paused["suspended"], ctl_given=f3 - f2, ctl_out=out, ctl_suspended=via_ctl["suspended"],
               ok_end=all_reduce_ok())
        dist.destroy_process_group()
        """))
    (x,) = r
    # NCCL's count is of its own allocations; the driver's granularity can only add to it.
    assert x["given"] >= 0.9 * x["suspendable"], x
    assert x["retaken"] >= 0.9 * x["suspendable"], x
    assert x["after"] and x["ok_end"] and x["suspended"] >= 1 and x["ctl_suspended"] >= 1, x
    assert x["ctl_given"] >= 0.9 * x["suspendable"], x
    assert 'paused tag "nccl":' in x["ctl_out"] and "NCCL communicator" in x["ctl_out"], x


@pytest.mark.skipif(HAS_SUSPEND, reason="this NCCL has ncclCommSuspend")
@pytest.mark.parametrize("mode", MODES)
def test_an_nccl_without_suspend_is_named(tmp_path, mode):
    (r,) = results(start(tmp_path, 1, mode, """
        assert all_reduce_ok()
        try:
            tms.pause("nccl")
            msg = None
        except tms_pkg.UnsupportedError as e:
            msg = str(e)
        report(msg=msg, stats=nccl()["unsupported"], ok=all_reduce_ok())
        dist.destroy_process_group()
        """))
    (x,) = r
    assert x["msg"] and "has no ncclCommSuspend (needs \u2265 2.29.7)" in x["msg"], x
    assert x["stats"] and x["ok"], x


@pytest.mark.skipif(not HAS_SUSPEND, reason=f"NCCL {nccl_version()} lacks ncclCommSuspend")
def test_a_registered_buffer_of_a_pauseable_region_is_kept_or_refused(tmp_path):
    # Preload mode: the library sees ncclCommRegister through its interposer.
    (r,) = results(start(tmp_path, 1, "preload", """
        assert all_reduce_ok()
        comm = dist.group.WORLD._get_backend(DEV)._comm_ptr()
        with tms.region(tag="kv"):
            buf = torch.zeros(64 * MIB, dtype=torch.uint8, device=DEV)
            other = torch.zeros(64 * MIB, dtype=torch.uint8, device=DEV)
        process = ctypes.CDLL(None)  # the interposed names come first
        h = ctypes.c_void_p()
        rc = process.ncclCommRegister(ctypes.c_void_p(comm), ctypes.c_void_p(buf.data_ptr()),
                                      ctypes.c_size_t(buf.numel()), ctypes.byref(h))
        assert rc == 0, rc
        registered = nccl()["registered_buffers"]
        tms.pause("kv")
        kv = next(t for t in tms.stats()["tags"] if t["tag"] == "kv")
        buf.fill_(7)  # still mapped: touching it is fine
        torch.cuda.synchronize()
        tms.resume("kv")
        tms.nccl_registered_buffers = "refuse"
        try:
            tms.pause("kv")
            refused = None
        except tms_pkg.InvalidStateError as e:
            refused = str(e)
        assert process.ncclCommDeregister(ctypes.c_void_p(comm), h) == 0
        tms.pause("kv")
        after = next(t for t in tms.stats()["tags"] if t["tag"] == "kv")
        tms.resume("kv")
        report(handle=bool(h.value), registered=registered, kept_active=kv["active_allocations"],
               refused=refused, paused_after=after["paused_allocations"], ok=all_reduce_ok())
        dist.destroy_process_group()
        """))
    (x,) = r
    if not x["handle"]:
        pytest.skip("NCCL registered nothing for a one-rank communicator (no handle)")
    assert x["registered"] == 1 and x["kept_active"] == 1, x
    assert x["refused"] and "holds a buffer NCCL registered" in x["refused"], x
    assert x["paused_after"] == 2 and x["ok"], x


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.skipif(not HAS_SUSPEND, reason=f"NCCL {nccl_version()} lacks ncclCommSuspend")
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_suspend_and_resume_every_rank_or_none(tmp_path, mode):
    procs = start(tmp_path, 2, mode, """
        from torch_memory_saver import distributed as tmsd
        gloo = dist.new_group(backend="gloo")
        assert all_reduce_ok()
        try:
            tmsd.pause("nccl")  # over the NCCL group: refused before acting
            over_nccl = None
        except ValueError as e:
            over_nccl = str(e)
        f0 = free()
        out = tmsd.pause("nccl", group=gloo)
        f1 = free()
        s = nccl()
        tmsd.resume("nccl", group=gloo)
        report(over_nccl=over_nccl, total=out.total_bytes, given=f1 - f0, suspendable=s["suspendable_bytes"],
               suspended=s["suspended"], ok=all_reduce_ok())
        dist.destroy_process_group()
        """)
    for r in results(procs):
        (x,) = r
        assert x["over_nccl"] and "gloo" in x["over_nccl"], x
        assert x["suspended"] >= 1 and x["given"] >= 0.9 * x["suspendable"] and x["ok"], x
