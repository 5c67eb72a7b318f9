"""Exported memory on a real GPU (issue 38, item 2), both hook modes: with TMS_SHAREABLE=1 a
pauseable tensor's memory is exported as POSIX file descriptors; a second process that has
neither this library nor torch imports them with the CUDA driver (cuMemImportFromShareableHandle),
maps them and reads the same bytes, before and after a pause and resume (exported again)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

from test_gpu import MODES, run  # noqa: E402

# The importer: plain ctypes over libcuda, given (offset, length, fd) triples and the size.
IMPORTER = r'''
import ctypes, hashlib, json, sys
cu = ctypes.CDLL("libcuda.so.1")
def ok(r, what):
    if r != 0:
        raise SystemExit(f"{what}: CUresult {r}")
segs, n = json.loads(sys.argv[1]), int(sys.argv[2])
ok(cu.cuInit(0), "cuInit")
dev = ctypes.c_int(0)
ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
total = sum(s[1] for s in segs)
base = ctypes.c_uint64(0)
ok(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(total), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
for off, length, fd in segs:
    h = ctypes.c_uint64(0)
    # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1: the handle is the descriptor's value.
    ok(cu.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), 1), "cuMemImportFromShareableHandle")
    ok(cu.cuMemMap(ctypes.c_uint64(base.value + off), ctypes.c_size_t(length), ctypes.c_size_t(0), h, ctypes.c_uint64(0)), "cuMemMap")
class Desc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int), ("flags", ctypes.c_int)]
desc = Desc(1, 0, 3)  # a device location, device 0, read and write
ok(cu.cuMemSetAccess(base, ctypes.c_size_t(total), ctypes.byref(desc), ctypes.c_size_t(1)), "cuMemSetAccess")
buf = (ctypes.c_uint8 * n)()
ok(cu.cuMemcpyDtoH_v2(buf, base, ctypes.c_size_t(n)), "cuMemcpyDtoH")
print(hashlib.sha256(bytes(buf)).hexdigest())
'''


@pytest.mark.parametrize("mode", MODES)
def test_an_exported_tensor_is_imported_by_another_process(mode, tmp_path):
    importer = tmp_path / "importer.py"
    importer.write_text(IMPORTER)
    r = run(
        f"""
        import hashlib, json, subprocess
        n = (64 << 20) + 4096
        with tms.region(tag="shared", enable_cpu_backup=True):
            t = rand_bytes(n, seed=38)
        want = hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()
        def imported():
            segs = tms.export_memory(t)
            try:
                out = subprocess.run(
                    [sys.executable, {str(importer)!r}, json.dumps(segs), str(n)],
                    pass_fds=[fd for _, _, fd in segs], capture_output=True, text=True, timeout=120,
                )
            finally:
                for _, _, fd in segs:
                    os.close(fd)
            assert out.returncode == 0, out.stderr
            return out.stdout.strip()
        assert imported() == want
        tms.pause("shared")
        tms.resume("shared")
        assert imported() == want, "the new memory, restored, exported again"
        print("ok")
        """,
        mode,
        TMS_SHAREABLE="1",
    )
    assert r.stdout.strip().endswith("ok"), r.stdout
