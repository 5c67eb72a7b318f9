"""GPU suite of the Python package: both hook modes on a real CUDA device. Skipped where torch
or CUDA is absent (CI); run on the GPU machine by scripts/gpu-test. Every scenario runs in a
fresh interpreter, since the hook mode is fixed per process and preload mode needs LD_PRELOAD."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

import torch_memory_saver as tms_pkg  # noqa: E402

from conftest import clean_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODES = ["preload", "torch"]
GIB = 1 << 30

PRELUDE = """
import os, sys, time, torch
import torch_memory_saver as tms_pkg
from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = os.environ["TEST_HOOK_MODE"]
GIB = 1 << 30
def free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]
def rand_bytes(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
torch.cuda.init()
"""


def env_for(mode: str, **extra: str) -> dict:
    # The package as this interpreter has it (the GPU suite installs the wheel).
    env = clean_env(TEST_HOOK_MODE=mode, PYTHONUNBUFFERED="1")
    lib = tms_pkg.get_binary_path()
    if mode == "preload":
        env["LD_PRELOAD"] = lib
    env.update(extra)
    return env


def run(code: str, mode: str, timeout: int = 300, **extra: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=env_for(mode, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    return r


EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("example", EXAMPLES)
def test_example(example, mode):
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), "--hook-mode", mode],
        env=env_for(mode),
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = r.stdout
    assert r.returncode == 0 and "\nOK\n" in out, f"exit {r.returncode}\n{out[-6000:]}\n{r.stderr[-4000:]}"
    assert " 0 failed" in out


@pytest.mark.parametrize("mode", MODES)
def test_memory_released_and_retaken_addresses_and_contents(mode):
    run(
        """
        torch.cuda.empty_cache()
        with tms.region(tag="a"):
            a = torch.full((2 * GIB,), 3, dtype=torch.uint8, device="cuda")
        with tms.region(tag="b", enable_cpu_backup=True):
            b = rand_bytes(2 * GIB, 1)
        ref = b.cpu()
        pa, pb = a.data_ptr(), b.data_ptr()
        f0 = free()
        tms.pause()
        f1 = free()
        assert f1 - f0 >= 0.99 * 4 * GIB, (f1 - f0) / GIB
        tms.resume()
        f2 = free()
        assert f1 - f2 >= 0.99 * 4 * GIB, (f1 - f2) / GIB
        assert (a.data_ptr(), b.data_ptr()) == (pa, pb)
        assert torch.equal(b.cpu(), ref), "backed-up contents kept"
        a.fill_(5)
        assert bool((a == 5).all())
        s = {t["tag"]: t for t in tms.stats()["tags"]}
        assert s["a"]["bytes_active"] >= 2 * GIB and s["b"]["last_pause"]["copied_bytes"] >= 2 * GIB, s
        print(tms.summary())
        """,
        mode,
    )


# Warmed up on a side stream before capture, as PyTorch asks: y = relu(x @ w) @ w, graph g.
GRAPH_SETUP = """
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
w = torch.randn(4096, 4096, device="cuda")
x = torch.randn(4096, 4096, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):
        y = (x @ w).relu() @ w
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
"""


@pytest.mark.parametrize("mode", MODES)
def test_graph_replays_after_resume(mode):
    run(
        GRAPH_SETUP
        + textwrap.dedent(
            """
        f_before = free()
        with tms.cuda_graph(g, tag="graph"):
            y = (x @ w).relu() @ w
        graph_bytes = f_before - free()
        g.replay()
        ref = ((x @ w).relu() @ w).clone()
        assert torch.allclose(y, ref, atol=1e-3), "replay before pause"
        for i in range(3):
            f0 = free()
            tms.pause("graph")
            f1 = free()
            assert f1 - f0 >= 0.9 * max(graph_bytes, 64 << 20), (f1 - f0, graph_bytes)
            tms.resume("graph")
            x.copy_(torch.randn(4096, 4096, device="cuda"))
            g.replay()
            ref = (x @ w).relu() @ w
            assert torch.allclose(y, ref, atol=1e-3), f"replay after resume {i}"
        print("graph bytes", graph_bytes)
        """
        ),
        mode,
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_graph_captured_inside_a_region_is_its_own_tags(mode):
    """cuda_graph(tag="graph") inside region(tag="outer"): the graph's memory is "graph"'s, the
    region's tensors made before and after the capture stay intact through replays, pausing
    "outer" leaves the graph replaying, and pausing "graph" gives its memory back."""
    run(
        GRAPH_SETUP
        + textwrap.dedent(
            """
        with tms.region(tag="outer"):
            kept = torch.full((1 << 28,), 7, dtype=torch.uint8, device="cuda")
            with tms.cuda_graph(g, tag="graph"):
                y = (x @ w).relu() @ w
            after = torch.full((1 << 26,), 9, dtype=torch.uint8, device="cuda")
        tags = {t["tag"]: t for t in tms.stats()["tags"]}
        assert tags["graph"]["bytes_active"] >= y.numel() * 4, tags
        assert tags["outer"]["bytes_active"] >= (1 << 28) + (1 << 26), tags
        g.replay()
        torch.cuda.synchronize()
        assert bool((after == 9).all()), "a replay wrote into a tensor the region made after the capture"
        assert bool((kept == 7).all()), "a replay wrote into a tensor the region made before the capture"
        tms.pause("outer")
        g.replay()
        ref = ((x @ w).relu() @ w).clone()
        assert torch.allclose(y, ref, atol=1e-3), "replay with the region paused"
        tms.resume("outer")
        f0 = free()
        tms.pause("graph")
        assert free() - f0 >= 0.9 * y.numel() * 4, (free() - f0)
        tms.resume("graph")
        x.copy_(torch.randn(4096, 4096, device="cuda"))
        g.replay()
        assert torch.allclose(y, (x @ w).relu() @ w, atol=1e-3), "replay after the graph's resume"
        """
        ),
        mode,
    )


@pytest.mark.parametrize("mode", MODES)
def test_oom_on_resume_raises_then_resume_succeeds(mode):
    r = run(
        """
        torch.cuda.empty_cache()
        with tms.region(tag="victim", enable_cpu_backup=True):
            v = rand_bytes(4 * GIB, 2)
        ref = v.cpu()
        tms.pause("victim")
        hogs = []
        while True:
            try:
                hogs.append(torch.empty(GIB, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
        try:
            tms.resume("victim")
            raise SystemExit("resume should have run out of memory")
        except tms_pkg.OutOfMemoryError as e:
            assert isinstance(e, tms_pkg.TorchMemorySaverError)
            print("MSG", e)
        s = {t["tag"]: t for t in tms.stats()["tags"]}["victim"]
        assert s["active_allocations"] == 0 and s["host_backup_bytes"] >= 4 * GIB, s
        del hogs
        torch.cuda.empty_cache()
        tms.resume("victim")
        assert torch.equal(v.cpu(), ref)
        """,
        mode,
    )
    msg = r.stdout
    assert "CUDA_ERROR_OUT_OF_MEMORY" in msg and "device 0" in msg and "victim" in msg, msg


@pytest.mark.parametrize("mode", MODES)
def test_two_processes_share_the_gpu(mode):
    owner = PRELUDE + textwrap.dedent(
        """
        torch.cuda.empty_cache()
        bulk_bytes = free() - 12 * GIB
        with tms.region(tag="bulk"):
            bulk = torch.empty(bulk_bytes, dtype=torch.uint8, device="cuda")
        with tms.region(tag="kept", enable_cpu_backup=True):
            kept = rand_bytes(GIB, 3)
        ref = kept.cpu()
        tms.pause()
        print("PAUSED", bulk_bytes / GIB, flush=True)
        assert sys.stdin.readline().strip() == "GO"
        tms.resume()
        bulk.fill_(7)
        assert bool((bulk[:: 1 << 20] == 7).all())
        assert torch.equal(kept.cpu(), ref)
        print("RESUMED-OK", flush=True)
        """
    )
    p = subprocess.Popen(
        [sys.executable, "-c", owner],
        env=env_for(mode),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline()
        assert line.startswith("PAUSED"), line + p.stderr.read()
        bulk_gib = float(line.split()[-1])
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                "import torch\n"
                "free = torch.cuda.mem_get_info()[0]\n"
                "n = free - 4 * (1 << 30)\n"
                "x = torch.ones(n, dtype=torch.uint8, device='cuda')\n"
                "assert int(x[::1 << 24].sum()) == len(x[::1 << 24])\n"
                "print('OTHER', n / 2**30)\n",
            ],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert other.returncode == 0 and "OTHER" in other.stdout, other.stderr[-3000:]
        used = float(other.stdout.split()[-1])
        # What the owner's paused bulk held, and more: its memory went back (any card size).
        assert used > bulk_gib, f"the other process used only {used:.1f} GiB, the bulk was {bulk_gib:.1f}"
        out, err = p.communicate("GO\n", timeout=180)
        assert p.returncode == 0 and "RESUMED-OK" in out, out + err[-3000:]
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("mode", MODES)
def test_200_cycles_without_drift(mode):
    run(
        """
        torch.cuda.empty_cache()
        with tms.region(tag="c"):
            a = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        with tms.region(tag="c", enable_cpu_backup=True):
            b = rand_bytes(64 << 20, 4)
        ref = b.cpu()
        tms.pause(); tms.resume()
        base = free()
        worst = 0
        for i in range(200):
            tms.pause()
            tms.resume()
            drift = abs(free() - base)
            worst = max(worst, drift)
            assert drift <= 64 << 20, (i, drift)
        assert torch.equal(b.cpu(), ref)
        print("worst drift MiB", worst / 2**20)
        """,
        mode,
        timeout=400,
    )


def test_expandable_segments_refused_in_preload_mode():
    r = subprocess.run(
        [sys.executable, "-c", PRELUDE + "\ntry:\n    tms.region().__enter__()\nexcept tms_pkg.UnsupportedError as e:\n    print('MSG', e)\n"],
        env=env_for("preload", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "MSG" in r.stdout and "PYTORCH_CUDA_ALLOC_CONF" in r.stdout, r.stdout + r.stderr[-3000:]


def test_expandable_segments_work_in_torch_mode():
    run(
        """
        with tms.region(tag="kv", enable_cpu_backup=True):
            t = rand_bytes(2 * GIB, 5)
        plain = torch.empty(GIB, dtype=torch.uint8, device="cuda")  # default pool: expandable
        ref = t.cpu()
        f0 = free()
        tms.pause("kv")
        f1 = free()
        assert f1 - f0 >= 0.99 * 2 * GIB, (f1 - f0) / GIB
        tms.resume("kv")
        assert torch.equal(t.cpu(), ref)
        """,
        "torch",
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
    )


@pytest.mark.parametrize("mode", MODES)
def test_get_cpu_backup_disable_and_margin(mode):
    run(
        """
        torch.cuda.empty_cache()
        for backend in ("pinned", "mmap"):
            with tms.region(tag="bk-" + backend, enable_cpu_backup=True, cpu_backup_backend=backend):
                t = torch.randn(64 << 20, device="cuda")
            ref = t.cpu()
            assert tms.get_cpu_backup(t) is None, "active and never paused"
            tms.pause("bk-" + backend)
            c = tms.get_cpu_backup(t)
            z = tms.get_cpu_backup(t, zero_copy=True)
            assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, ref) and torch.equal(z, ref)
            part = tms.get_cpu_backup(t[1000:2000])
            assert torch.equal(part, ref[1000:2000])
            tms.resume("bk-" + backend)
            assert torch.equal(t.cpu(), ref) and tms.get_cpu_backup(t) is None
            # The zero-copy view outlives the release of the backup, and the next pause writes
            # a new buffer instead of changing it.
            assert torch.equal(z, ref), "zero-copy view after a resume without retention"
            t.add_(1)
            tms.pause("bk-" + backend)
            assert torch.equal(z, ref) and torch.equal(tms.get_cpu_backup(t), ref + 1)
            tms.resume("bk-" + backend)
        with tms.region(tag="nobackup"):
            nb = torch.empty(16 << 20, device="cuda")
        assert tms.get_cpu_backup(nb) is None
        del t, c, z, part
        torch.cuda.empty_cache()  # so the next tensor cannot reuse a freed pauseable block
        outside = torch.empty(16 << 20, device="cuda")
        # Nothing to back up, as the existing library answers (integrations fall back on None).
        assert tms.get_cpu_backup(outside) is None and tms.get_cpu_backup(outside, zero_copy=True) is None
        # disable(): inside a region, not pauseable
        with tms.region(tag="d"):
            r = torch.empty(GIB, dtype=torch.uint8, device="cuda")
            with tms.disable():
                keep = torch.full((GIB,), 9, dtype=torch.uint8, device="cuda")
        f0 = free()
        tms.pause("d")
        rose = free() - f0
        assert 0.99 * GIB <= rose < 1.5 * GIB, rose / GIB
        assert bool((keep == 9).all()), "the disabled tensor stays usable while its region is paused"
        tms.resume("d")
        # memory margin: a pauseable allocation that would leave too little free fails as OOM
        tms.memory_margin_bytes = free() - GIB
        try:
            with tms.region(tag="m"):
                torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
            raise SystemExit("margin not enforced")
        except torch.OutOfMemoryError:
            pass
        tms.memory_margin_bytes = 0
        """,
        mode,
    )


@pytest.mark.parametrize("mode", MODES)
def test_disable_blocks_under_another_threads_region_reuse_one_pool(mode):
    """While a serving thread keeps a region open, a retired ``disable()`` pool cannot be
    destroyed (PyTorch asserts no capture is under way there): the next block of the device
    takes it, so device memory stays bounded over many blocks, a block inside a graph capture
    gets its own pool, and once the region ends every retired pool goes."""
    run(
        """
        import gc, threading
        from torch_memory_saver import routing as routes
        MIB = 1 << 20
        inside, leave = threading.Event(), threading.Event()
        def serve():
            with tms.region(tag="serving"):
                x = torch.empty(MIB, device="cuda")
                inside.set()
                leave.wait()
        t = threading.Thread(target=serve)
        t.start()
        assert inside.wait(60)
        torch.cuda.synchronize()
        base = torch.cuda.memory_reserved()
        for i in range(60):
            with tms.disable():
                y = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
                y.fill_(1)
                del y
        grew = torch.cuda.memory_reserved() - base
        assert grew <= 3 * 64 * MIB, f"{grew / MIB:.0f} MiB reserved over 60 disable() blocks"
        assert len(routes._routing.retired) <= 2, len(routes._routing.retired)
        # A graph captured with a disable() block inside, then eager blocks: the graph's
        # memory is never handed to them, so replays and eager tensors leave each other alone.
        g = torch.cuda.CUDAGraph()
        src = torch.full((4 * MIB,), 2.0, device="cuda")
        with tms.cuda_graph(g):
            with tms.disable():
                out = src * 3
        with tms.disable():
            w = torch.zeros(4 * MIB, device="cuda")
        with tms.disable():
            w2 = torch.zeros(4 * MIB, device="cuda")
        g.replay()
        torch.cuda.synchronize()
        assert bool((out == 6).all()), "the graph's output"
        assert float(w.abs().sum()) == 0 and float(w2.abs().sum()) == 0, "eager tensors kept"
        leave.set()
        t.join()
        del w, w2
        gc.collect()
        assert not routes._routing.retired, len(routes._routing.retired)
        """,
        mode,
    )


@pytest.mark.parametrize("mode", MODES)
def test_pools_dropped_during_another_threads_raw_capture_wait_for_its_end(mode):
    """PyTorch's ``MemPool`` destructor asserts (``std::terminate``: the process dies) while any
    thread captures a graph. Thread A captures one with plain ``torch.cuda.graph``, not through
    the package (as sglang, vLLM and torch.compile's cudagraphs do), and holds the capture open
    while this thread enters and leaves ``disable()`` blocks and regions whose pools it drops:
    those pools must wait for A's capture to end, then go; the process lives and the graph
    replays right."""
    run(
        """
        import threading
        from torch_memory_saver import routing as routes
        MIB = 1 << 20
        with tms.region(tag="weights"):  # the package in use before the capture, as ever
            w = torch.full((MIB,), 3.0, device="cuda")
        x = torch.full((MIB,), 2.0, device="cuda")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        began, may_end, out, errors = threading.Event(), threading.Event(), [], []
        def capture():
            try:
                # thread_local: this thread's allocations meanwhile are not refused by CUDA
                with torch.cuda.graph(g, capture_error_mode="thread_local"):
                    out.append(x * w + 1)
                    began.set()
                    assert may_end.wait(60)
            except BaseException as e:
                errors.append(repr(e))
                began.set()
        a = threading.Thread(target=capture)
        a.start()
        assert began.wait(60) and not errors, errors
        for i in range(5):
            with tms.disable():
                y = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
                y.fill_(1)
                del y
            with tms.region(tag=f"kv{i}"):
                z = torch.empty(MIB, device="cuda")
                z.fill_(i)
                del z
            # The map held the region pool's last reference.
            tms._impl._mem_pools.pop((f"kv{i}", False))
        # No device-wide synchronize while A captures: it would wait on A's capturing stream.
        waiting = len(routes._routing.retired)
        assert waiting >= 5, f"{waiting} pools retired while A captured: some destroyed under it"
        may_end.set()
        a.join(60)
        assert not a.is_alive() and not errors, errors
        assert not routes._routing.retired, "pools kept past the capture"
        assert routes._routing.active == 0
        x.fill_(5.0)
        g.replay()
        torch.cuda.synchronize()
        assert bool((out[0] == 16).all()), "the graph's replay"
        print("ok")
        """,
        mode,
        timeout=120,
    )
