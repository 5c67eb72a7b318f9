"""Helpers: run Python snippets in a fresh interpreter, preloaded with libtms.so on the
simulated device, and return what they print."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import torch_memory_saver as tms_pkg

PRELUDE = """
import ctypes, json, os, sys
import torch_memory_saver as tms_pkg
from torch_memory_saver import torch_memory_saver as tms
libc = ctypes.CDLL(None)
def cuda_malloc(n):
    p = ctypes.c_void_p(0)
    rc = libc.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n))
    return rc, p.value
def cuda_free(p):
    return libc.cudaFree(ctypes.c_void_p(p))
def tag_stats(name):
    return next(t for t in tms.stats()["tags"] if t["tag"] == name)
"""


# Snippet helpers for the sim (after PRELUDE): a pauseable allocation filled with a pattern of
# its seed, and whether it still holds it.
# A "tensor" for the calls that take one: the few methods of a torch.Tensor the package reads, of a
# contiguous uint8 tensor at a device address (code for the scripts the tests run).
BUF = """
class Buf:
    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = ptr, nbytes
    def data_ptr(self):
        return self.ptr
    def numel(self):
        return self.nbytes
    def element_size(self):
        return 1
    def is_contiguous(self):
        return True
"""

SIM_ALLOC = """
def alloc(tag, n, seed, chunk=0, **kw):
    with tms.region(tag=tag, chunk_size=chunk, **kw):
        rc, p = cuda_malloc(n)
    assert rc == 0, rc
    data = bytes((seed * 7 + i * 13) & 0xFF for i in range(256)) * (n // 256)
    ctypes.memmove(p, data, n)
    return p, data

def intact(p, data):
    return ctypes.string_at(p, len(data)) == data
"""


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "PYTORCH_")) and k != "LD_PRELOAD"}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def libtms() -> str:
    return tms_pkg.get_binary_path()


def run_py(code: str, env: dict, expect_ok: bool = True) -> subprocess.CompletedProcess:
    src = PRELUDE + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", src], env=env, capture_output=True, text=True, timeout=60)
    if expect_ok:
        assert r.returncode == 0, f"snippet failed ({r.returncode})\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


@pytest.fixture
def preloaded(libtms, tmp_path):
    """Run a snippet under LD_PRELOAD=libtms.so on a 256 MiB simulated device (its control
    socket in a temporary folder)."""

    def go(code: str, expect_ok: bool = True, **env: str) -> subprocess.CompletedProcess:
        base = clean_env(
            LD_PRELOAD=libtms, TMS_BACKEND="sim", TMS_SIM_CAPACITY="256MiB", TMS_SOCKET_DIR=str(tmp_path / "sock")
        )
        base.update(env)
        return run_py(code, base, expect_ok)

    return go


def pytest_runtest_logreport(report):
    """Where TMS_TEST_TIMES names a file, append each test's outcome and seconds to it as the
    test ends (the GPU suite's record of where its time goes, kept when a run is cut short)."""
    path = os.environ.get("TMS_TEST_TIMES")
    # Under pytest-xdist the controller sees every report; its workers write nothing.
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or report.when != "call":
        return
    with open(path, "a") as f:
        f.write(f"{report.duration:8.2f} s  {report.outcome:<7} {report.nodeid}\n")
