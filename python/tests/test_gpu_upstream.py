"""GPU tests of the newer surface the existing library's callers use, in both hook modes:
keep_resident across pause/resume (same physical buffer, readable while the tag is paused),
a pause that waits for work queued on another stream, _affected_devices, _mem_pools and
_with_region_config releasing a retained page-locked backup, and CUDA runtime names through
the library handle. Each scenario runs in a fresh interpreter with the installed package."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

from test_gpu_compat import run_script  # noqa: E402

SCENARIO = """
import gc, sys
mode = sys.argv[1] if len(sys.argv) > 1 else "{mode}"
tms.hook_mode = mode
if mode == "preload":
    assert tms.available
def buffer_id(t):
    drv = ctypes.CDLL("libcuda.so.1")
    out = ctypes.c_uint64()
    assert drv.cuPointerGetAttribute(ctypes.byref(out), 7, ctypes.c_uint64(t.data_ptr())) == 0
    return out.value
size = 64 * MIB
with tms.region(tag="mixed", enable_cpu_backup=True):
    kept = torch.full((size,), 17, dtype=torch.uint8, device="cuda")
    moved = torch.full((size,), 29, dtype=torch.uint8, device="cuda")
assert tms.keep_resident(kept[4096:8192]) == tms.keep_resident(kept) >= size
assert tms.keep_resident(kept[:0]) == 0 and tms.keep_resident(torch.empty(1, device="cuda")) == 0
kid = buffer_id(kept)
assert tms._impl._affected_devices("mixed") == [0] and tms._impl._affected_devices("nothing") == []
for i, tag in enumerate(("mixed", None)):
    mid = buffer_id(moved)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    tms.pause(tag)
    assert torch.cuda.mem_get_info()[0] - free0 >= size
    assert buffer_id(kept) == kid and bool((kept == 17 + i).all())
    kept.add_(1)
    tms.resume(tag)
    assert buffer_id(kept) == kid and buffer_id(moved) != mid
    assert bool((moved == 29 + i).all())
    moved.add_(1)
# A pause waits for work queued on another stream, and keeps the current device.
tms.retain_cpu_backup = True
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    torch.cuda._sleep(500_000_000)
    moved.fill_(77)
assert not side.query()
tms.pause("mixed")
assert side.query() and torch.cuda.current_device() == 0
assert bool((tms.get_cpu_backup(moved) == 77).all())
view = tms.get_cpu_backup(moved, zero_copy=True)
host = view.data_ptr()
cdll = tms._impl._binary_wrapper.cdll
flags = ctypes.c_uint()
get_flags = cdll.cudaHostGetFlags
get_flags.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
assert get_flags(ctypes.byref(flags), ctypes.c_void_p(host)) == 0, "a retained pinned backup is page-locked"
tms.resume("mixed")
assert bool((moved == 77).all())
# Dropping the pool and the tensor frees the allocation, and its retained backup with it.
pool = tms._impl._mem_pools.pop(("mixed", True, False, "pinned", 0))
del view
torch.cuda.synchronize()
with tms._impl._with_region_config(tag="mixed", enable_cpu_backup=True, cpu_backup_backend="pinned"):
    del moved, pool
    gc.collect()
    torch.cuda.empty_cache()
torch.cuda.synchronize()
assert get_flags(ctypes.byref(flags), ctypes.c_void_p(host)) != 0, "released with the allocation"
cdll.cudaGetLastError()
tms.retain_cpu_backup = False
print("upstream patterns OK", mode)
"""


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_newer_upstream_patterns(tmp_path, mode):
    code = SCENARIO.replace("{mode}", mode)
    if mode == "preload":
        code = "from torch_memory_saver.hooks.mode_preload import preload_library_path\n" + code
        launcher = f"""
import subprocess
from torch_memory_saver.hooks.mode_preload import configure_subprocess
with configure_subprocess():
    r = subprocess.run([sys.executable, "-c", {("import ctypes, os, sys, torch" + chr(10) + "import torch_memory_saver" + chr(10) + "from torch_memory_saver import torch_memory_saver as tms" + chr(10) + "MIB = 1 << 20" + chr(10) + code)!r}, "preload"],
                       capture_output=True, text=True, timeout=240)
print(r.stdout)
print(r.stderr[-4000:], file=sys.stderr)
sys.exit(r.returncode)
"""
        out = run_script(tmp_path, launcher)
    else:
        out = run_script(tmp_path, code)
    assert f"upstream patterns OK {mode}" in out, out
