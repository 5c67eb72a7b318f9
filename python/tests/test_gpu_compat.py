"""GPU tests modelled on the projects that use torch_memory_saver: how they start the library
(LD_PRELOAD by the upstream file name from a launcher, TMS_INIT_ENABLE=1 training offload),
what they do with disable() (weight sync through CUDA IPC while the trainer is paused), the
DeepEP patch that keeps one allocation ordinary, and an integration that installs its own
``_impl``. Each scenario is a script run in a fresh interpreter with the installed package.
Skipped where torch or CUDA is absent (CI); the GPU suite runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

import torch_memory_saver  # noqa: E402

from conftest import clean_env  # noqa: E402

MIB = 1 << 20
UPSTREAM_PRELOAD = os.path.join(
    os.path.dirname(os.path.dirname(torch_memory_saver.__file__)), "torch_memory_saver_hook_mode_preload.abi3.so"
)

PRELUDE = """
import ctypes, os, sys, torch
import torch_memory_saver
from torch_memory_saver import torch_memory_saver as tms
from torch_memory_saver.testing_utils import gpu_used_bytes
MIB = 1 << 20
def warm_kernels():
    # Lazily loaded kernels take device memory at first use: load those the checks use.
    a = torch.full((MIB,), 1, dtype=torch.uint8, device="cuda")
    b = torch.randn(MIB, device="cuda")
    int(a.sum()); float(b.sum()); a.clone(); torch.equal(a, a); b.square().mean()
    torch.cuda.synchronize()
"""


def run_script(tmp_path, code: str, timeout: int = 300, **env: str) -> str:
    """Run ``code`` as a script file (torch.multiprocessing's spawn needs one) and return what
    it printed; fail with its output when it fails."""
    script = tmp_path / "scenario.py"
    script.write_text(PRELUDE + textwrap.dedent(code))
    r = subprocess.run(
        [sys.executable, str(script)],
        env=clean_env(PYTHONUNBUFFERED="1", **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-6000:]}\nstderr:\n{r.stderr[-6000:]}"
    return r.stdout


def test_upstream_file_names_are_installed():
    from torch_memory_saver.utils import get_binary_path_from_package

    assert os.path.isfile(UPSTREAM_PRELOAD), UPSTREAM_PRELOAD
    # Chosen by the CUDA major version of the torch in use, as the existing library does.
    major = torch.version.cuda.split(".")[0]
    chosen = UPSTREAM_PRELOAD.replace(".abi3.so", f"_cu{major}.abi3.so")
    assert str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload")) == chosen
    with open(chosen, "rb") as a, open(UPSTREAM_PRELOAD, "rb") as b:
        assert a.read() == b.read(), "one build under every name"


TRAINING = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(512, 2048, device="cuda")
for _ in range(3):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
# A large block freed into the allocator's cache: after the pause it is a cached block of
# paused memory, which disable() must never hand out.
scratch = torch.empty(768 * MIB, dtype=torch.uint8, device="cuda")
del scratch
"""

CHECK_OFFLOAD = """
warm_kernels()
ref = [p.detach().clone() for p in model.parameters()]
ref_opt = [s["exp_avg"].clone() for s in opt.state.values()]
ref_cpu = [t.cpu() for t in ref + ref_opt]
del ref, ref_opt
torch.cuda.synchronize()
for cycle in range(3):
    tms.pause()
    u0 = gpu_used_bytes()
    with tms.disable():
        w = torch.full((512 * MIB,), 7, dtype=torch.uint8, device="cuda")
        assert int(w.sum()) == 7 * 512 * MIB
        v = torch.randn(64 * MIB, device="cuda")
        assert bool(torch.isfinite(v).all())
        del w, v
    u1 = gpu_used_bytes()
    assert abs(u1 - u0) <= 10 * MIB, f"cycle {cycle}: {(u1 - u0) / MIB:.1f} MiB left after disable()"
    with tms.disable():
        kept = torch.full((32 * MIB,), cycle + 1, dtype=torch.uint8, device="cuda")
    tms.resume()
    got = [p.detach().cpu() for p in model.parameters()] + [s["exp_avg"].cpu() for s in opt.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(got, ref_cpu)), f"cycle {cycle}: contents changed"
    tms.pause()
    # While paused, work goes under disable(): under TMS_INIT_ENABLE=1 any other allocation
    # (the sum's output here) is pauseable and may be served a cached block of paused memory.
    with tms.disable():
        assert int(kept.sum()) == (cycle + 1) * 32 * MIB, "a disable() tensor stays valid across pauses"
    tms.resume()
    del kept
    model(x).square().mean().backward()  # the model still trains after resume
    opt.zero_grad(set_to_none=True)
print("offload OK", tms.hook_mode)
"""


def test_training_offload_preloaded_by_the_upstream_name_with_init_enable(tmp_path):
    """AReaL/slime/miles: a launcher builds LD_PRELOAD from the upstream file name and sets
    TMS_INIT_ENABLE=1 with CPU backup; the trainer pauses everything and syncs weights under
    disable() while paused."""
    launcher = f"""
    import subprocess
    from torch_memory_saver.utils import get_binary_path_from_package
    areal = os.path.join(os.path.dirname(os.path.dirname(torch_memory_saver.__file__)),
                         "torch_memory_saver_hook_mode_preload.abi3.so")
    miles = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    # AReaL names the unsuffixed file; miles asks for the one of its CUDA major: one build.
    assert miles.endswith(f"_cu{torch.version.cuda.split('.')[0]}.abi3.so"), miles
    assert open(areal, "rb").read() == open(miles, "rb").read(), (areal, miles)
    env = dict(os.environ, LD_PRELOAD=areal, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    child = {PRELUDE + TRAINING + CHECK_OFFLOAD!r} + "\\nassert tms.stats()['tags'][0]['tag'] == 'default'\\n"
    r = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=280)
    print(r.stdout)
    print(r.stderr[-4000:], file=sys.stderr)
    sys.exit(r.returncode)
    """
    out = run_script(tmp_path, launcher)
    assert "offload OK preload" in out, out


def test_training_offload_in_torch_mode_with_disable_after_pause(tmp_path):
    code = (
        'tms.hook_mode = "torch"\n'
        + 'with tms.region(tag="train", enable_cpu_backup=True):\n'
        + textwrap.indent(TRAINING, "    ")
        + CHECK_OFFLOAD
    )
    out = run_script(tmp_path, code)
    assert "offload OK torch" in out, out


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_impl_disable_keeping_its_pool(tmp_path, mode):
    """``_impl.disable(dispose_mem_pool_after_use=False)`` (the existing library's keyword):
    inside a region, what it allocates is not pauseable, its pool is kept on exit and reused by
    the next such block, and the region's own tensors pause and resume as ever."""
    code = f"""
    tms.hook_mode = {mode!r}
    warm_kernels()
    with tms.region(tag="w", enable_cpu_backup=True):
        w = torch.full((8 * MIB,), 3, dtype=torch.uint8, device="cuda")
        tms._ensure_initialized()
        with tms._impl.disable(dispose_mem_pool_after_use=False):
            a = torch.full((8 * MIB,), 5, dtype=torch.uint8, device="cuda")
        pools = dict(tms._impl._kept_disable_pools)
        with tms._impl.disable(dispose_mem_pool_after_use=False):
            b = torch.full((8 * MIB,), 7, dtype=torch.uint8, device="cuda")
    assert len(pools) == 1 and dict(tms._impl._kept_disable_pools) == pools, (pools, tms._impl._kept_disable_pools)
    torch.cuda.synchronize()
    tms.pause("w")
    # Not paused: still readable while "w" is.
    assert int(a.sum()) == 5 * 8 * MIB and int(b.sum()) == 7 * 8 * MIB
    tms.resume("w")
    assert int(w.sum()) == 3 * 8 * MIB
    print("kept pool OK", {mode!r})
    """
    env = {"LD_PRELOAD": UPSTREAM_PRELOAD} if mode == "preload" else {}
    out = run_script(tmp_path, code, **env)
    assert f"kept pool OK {mode}" in out, out


IPC = """
import torch.multiprocessing as mp

def reader(q_in, q_out):
    t = q_in.get()
    q_out.put((int(t.sum()), t.data_ptr() != 0))
    q_in.get()  # hold the tensor until the sender has its answer

if __name__ == "__main__":
    tms.hook_mode = os.environ["MODE"]
    warm_kernels()
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.randn(256 * MIB, device="cuda")
        u0 = gpu_used_bytes()
        with tms.disable():
            buf = torch.full((128 * MIB,), 5, dtype=torch.uint8, device="cuda")
            scratch = torch.empty(300 * MIB, dtype=torch.uint8, device="cuda")
            del scratch
        u1 = gpu_used_bytes()
    grew = (u1 - u0) / MIB
    assert 128 - 10 <= grew <= 128 + 10, f"disable() left {grew:.1f} MiB (128 MiB alive)"
    ref = w.cpu()
    tms.pause("weights")
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=reader, args=(q_in, q_out))
    p.start()
    q_in.put(buf)
    total, ok = q_out.get(timeout=240)
    q_in.put(None)
    p.join(timeout=60)
    assert p.exitcode == 0, p.exitcode
    assert total == 5 * 128 * MIB and ok, total
    tms.resume("weights")
    assert torch.equal(w.cpu(), ref)
    print("ipc OK", tms.hook_mode)
"""


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_disable_tensor_shared_through_cuda_ipc_while_region_paused(tmp_path, mode):
    env = {"MODE": mode}
    if mode == "preload":
        env["LD_PRELOAD"] = torch_memory_saver.get_binary_path()
    out = run_script(tmp_path, IPC, **env)
    assert f"ipc OK {mode}" in out, out


DEEPEP = """
tms.hook_mode = "preload"
assert tms.available
torch.cuda.init()
warm_kernels()
cudart_path = next(line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line)
cudart = ctypes.CDLL(cudart_path)
process = ctypes.CDLL(None)  # the global scope: the interposed cudaMalloc, as DeepEP's C++ calls it
def count():
    return sum(t["allocations"] for t in tms.stats()["tags"])
n0 = count()
cdll = tms._impl._binary_wrapper.cdll
original = cdll.tms_get_interesting_region()
assert original, "TMS_INIT_ENABLE=1: everything is pauseable"
cdll.tms_set_interesting_region(False)
try:
    ptr = ctypes.c_void_p(0)
    assert process.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(64 * MIB)) == 0
    handle = (ctypes.c_ubyte * 64)()
    rc = cudart.cudaIpcGetMemHandle(handle, ptr)
    assert rc == 0, f"cudaIpcGetMemHandle on the buffer: {rc} (it fails on pauseable memory)"
finally:
    cdll.tms_set_interesting_region(original)
assert count() == n0, "the buffer is not pauseable"
x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
assert count() == n0 + 1, "after the patch, allocations are pauseable again"
assert cudart.cudaMemset(ptr, 0x42, ctypes.c_size_t(64 * MIB)) == 0
tms.pause()
host = (ctypes.c_ubyte * 16)()
assert cudart.cudaMemcpy(host, ctypes.c_void_p(ptr.value + 64 * MIB - 16), ctypes.c_size_t(16), 2) == 0
assert bytes(host) == b"\\x42" * 16, bytes(host)
tms.resume()
assert process.cudaFree(ptr) == 0
print("deepep OK")
"""


def test_deepep_patch_keeps_one_allocation_ordinary(tmp_path):
    out = run_script(
        tmp_path, DEEPEP, LD_PRELOAD=UPSTREAM_PRELOAD, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1"
    )
    assert "deepep OK" in out, out


OWN_IMPL = """
import contextlib
import torch_memory_saver.entrypoint as entrypoint
from torch_memory_saver.entrypoint import _TorchMemorySaverImpl
calls = []

class HybridImpl:
    # As dynamo's GPU-memory-service adapter: wraps the real implementation in torch mode and
    # offers only the methods it needs, with the keywords it expects.
    def __init__(self):
        self.inner = _TorchMemorySaverImpl(hook_mode="torch")
    def region(self, tag, enable_cpu_backup):
        calls.append("region")
        return self.inner.region(tag=tag, enable_cpu_backup=enable_cpu_backup)
    def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup):
        calls.append("cuda_graph")
        return self.inner.cuda_graph(cuda_graph=cuda_graph, pool=pool, stream=stream,
                                     capture_error_mode=capture_error_mode, tag=tag,
                                     enable_cpu_backup=enable_cpu_backup)
    def disable(self):
        calls.append("disable")
        return self.inner.disable()
    def pause(self, tag):
        calls.append("pause")
        self.inner.pause(tag)
    def resume(self, tag):
        calls.append("resume")
        self.inner.resume(tag)

original = entrypoint.TorchMemorySaver._ensure_initialized
def patched(self):
    if self._impl is not None:
        return
    if self._impl_ctor_kwargs.get("hook_mode") in (None, "gpu_memory_service"):
        self._impl = HybridImpl()
        del self._impl_ctor_kwargs
    else:
        original(self)
entrypoint.TorchMemorySaver._ensure_initialized = patched

warm_kernels()
with tms.region(tag="kv", enable_cpu_backup=False):
    kv = torch.empty(2048 * MIB, dtype=torch.uint8, device="cuda")
with tms.region(tag="w", enable_cpu_backup=True):
    w = torch.randn(64 * MIB, device="cuda")
ref = w.cpu()
g = torch.cuda.CUDAGraph()
static_in = torch.ones(MIB, device="cuda")
with tms.cuda_graph(g, pool=None, stream=None, tag="graph"):
    static_out = static_in * 3
free0 = torch.cuda.mem_get_info()[0]
tms.pause("kv"); tms.pause("w"); tms.pause("graph")
rose = torch.cuda.mem_get_info()[0] - free0
assert rose >= 2048 * MIB, rose / MIB
tms.resume("kv"); tms.resume("w"); tms.resume("graph")
static_in.fill_(2); g.replay()
assert float(static_out.sum()) == 6.0 * MIB and torch.equal(w.cpu(), ref)
assert isinstance(tms._impl, HybridImpl) and tms.enabled
print("own impl OK", sorted(set(calls)))
"""


def test_an_integration_that_installs_its_own_impl(tmp_path):
    out = run_script(tmp_path, OWN_IMPL)
    assert "own impl OK ['cuda_graph', 'pause', 'region', 'resume']" in out, out
