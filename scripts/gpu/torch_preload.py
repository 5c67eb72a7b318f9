"""PyTorch under LD_PRELOAD=libtms.so with TMS_INIT_ENABLE=1 and CPU backup: every CUDA
allocation is pauseable; pause gives the memory back to the driver, resume restores tensors in
place. Uses only the C ABI (ctypes), not the Python package."""

import ctypes
import sys

import torch

lib = ctypes.CDLL(None)  # the preloaded libtms.so's symbols are in the global scope
lib.tms_pause.argtypes = [ctypes.c_char_p]
lib.tms_resume.argtypes = [ctypes.c_char_p]

passed = failed = 0


def check(name, ok, detail):
    global passed, failed
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    passed += ok
    failed += not ok


n = 2 << 30
x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
ref = x.cpu()
ptr = x.data_ptr()
torch.cuda.synchronize()
f0 = torch.cuda.mem_get_info()[0]
rc = lib.tms_pause(None)
f1 = torch.cuda.mem_get_info()[0]
check("pause under torch", rc == 0 and f1 - f0 >= 0.99 * n, f"status {rc}, free rose {(f1 - f0) / 2**30:.3f} GiB")
rc = lib.tms_resume(None)
f2 = torch.cuda.mem_get_info()[0]
check("resume under torch", rc == 0 and f1 - f2 >= 0.99 * n, f"status {rc}, free fell {(f1 - f2) / 2**30:.3f} GiB")
y = (x.to(torch.int32) + 1).cpu()
check("tensor intact at the same address", x.data_ptr() == ptr and torch.equal(x.cpu(), ref), "compared on the CPU")
check("kernels on resumed tensor", torch.equal(y, ref.to(torch.int32) + 1), "x + 1")
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
