"""The surface the existing library's own tests and its integrations reach (issue: upstream's
test suite passes unmodified), on the simulated device and without torch: helper modules,
``configure_subprocess`` in ``hooks.mode_preload``, library file selection by CUDA major,
validation in the existing library's words, ``keep_resident``, ``_affected_devices``,
``_mem_pools``/``_with_region_config``, and CUDA runtime names through the library handle."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from unittest.mock import patch

import pytest

import torch_memory_saver as tms_pkg
from torch_memory_saver import entrypoint, utils
from torch_memory_saver.hooks import mode_preload

from conftest import clean_env, run_py

FAKE = "/fake/torch_memory_saver_hook_mode_preload.so"


def test_helper_module_names():
    from torch_memory_saver.testing_utils import empty_cache, get_and_print_gpu_memory, get_device, is_xpu

    assert callable(empty_cache) and callable(get_and_print_gpu_memory)
    assert is_xpu is utils.is_xpu and get_device() in ("cuda", "xpu")
    from torch_memory_saver.entrypoint import (  # noqa: F401
        _TAG_DEFAULT, BinaryWrapper, CpuBackupBackend, HookMode, HookUtilBase, is_xpu as ep_is_xpu,
    )
    from torch_memory_saver.hooks.base import HookMode as base_mode

    assert _TAG_DEFAULT == "default" and HookMode is base_mode
    # The package's configure_subprocess is hooks.mode_preload's, looked up at call time (a patch
    # of it applies), under every mode that uses the preload.
    calls = []
    with patch.object(mode_preload, "configure_subprocess", lambda: calls.append(1) or patch.dict(os.environ)):
        with tms_pkg.configure_subprocess():
            pass
    assert calls == [1]


def test_configure_subprocess_uses_its_module_globals_and_keeps_one_copy(monkeypatch):
    monkeypatch.setattr(mode_preload, "_mapped_cudart_dir", lambda: None)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    with patch("torch_memory_saver.hooks.mode_preload.get_binary_path_from_package", return_value=FAKE):
        monkeypatch.delenv("LD_PRELOAD", raising=False)
        with mode_preload.configure_subprocess():
            assert os.environ["LD_PRELOAD"] == FAKE and "LD_LIBRARY_PATH" not in os.environ
        assert "LD_PRELOAD" not in os.environ
        # Other entries stay (after ours); other copies of this library go.
        old = "/a/libx.so /site/torch_memory_saver_hook_mode_preload_cu12.abi3.so:/b/libtms.so:/c/liby.so"
        monkeypatch.setenv("LD_PRELOAD", old)
        with mode_preload.configure_subprocess():
            assert os.environ["LD_PRELOAD"] == f"{FAKE}:/a/libx.so:/c/liby.so"
        assert os.environ["LD_PRELOAD"] == old
    # The CUDA runtime's folder goes first in LD_LIBRARY_PATH, and is restored.
    monkeypatch.setattr(mode_preload, "_mapped_cudart_dir", lambda: "/rt/lib")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/x:/rt/lib")
    with patch("torch_memory_saver.hooks.mode_preload.get_binary_path_from_package", return_value=FAKE):
        with mode_preload.configure_subprocess():
            assert os.environ["LD_LIBRARY_PATH"] == "/rt/lib:/x"
    assert os.environ["LD_LIBRARY_PATH"] == "/x:/rt/lib"


def test_configure_subprocess_from_two_threads_restores_the_environment(monkeypatch):
    # Threads that each start workers inside configure_subprocess() overlap without nesting:
    # the one that leaves last must not put back the preload it found set by the other, which
    # would preload every child the process starts from then on.
    monkeypatch.setattr(mode_preload, "_mapped_cudart_dir", lambda: "/rt/lib")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/x")
    with patch("torch_memory_saver.hooks.mode_preload.get_binary_path_from_package", return_value=FAKE):
        first, second = tms_pkg.configure_subprocess(), tms_pkg.configure_subprocess()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        # The second thread is still starting children: they keep the preload.
        assert os.environ["LD_PRELOAD"] == FAKE and os.environ["LD_LIBRARY_PATH"] == "/rt/lib:/x"
        second.__exit__(None, None, None)
    assert "LD_PRELOAD" not in os.environ and os.environ["LD_LIBRARY_PATH"] == "/x"


def test_mapped_cudart_dir_reads_a_maps_file(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 rw-p 00000000 00:00 0\n"
        "7f04-7f05 r-xp 00000000 08:01 2 /sp/nvidia/cu13/lib/libcudart.so.13\n"
    )
    assert mode_preload._mapped_cudart_dir(str(maps)) == "/sp/nvidia/cu13/lib"
    assert mode_preload._mapped_cudart_dir(str(tmp_path / "absent")) is None


def test_a_preloaded_process_hands_its_own_file_to_children(libtms, tmp_path):
    r = run_py(
        "from torch_memory_saver.hooks.mode_preload import configure_subprocess\n"
        "with configure_subprocess():\n    print(os.environ['LD_PRELOAD'])\n",
        clean_env(LD_PRELOAD=f"{libtms}:/nowhere/other.so", TMS_BACKEND="sim", TMS_SOCKET_DIR=str(tmp_path)),
    )
    assert r.stdout.strip() == f"{libtms}:/nowhere/other.so", r.stdout


@pytest.mark.parametrize("version, name", [(dict(cuda="12.9"), "_cu12"), (dict(cuda="13.0"), "_cu13"),
                                           (dict(hip="7.2.0"), "")])
def test_library_file_by_cuda_major(monkeypatch, tmp_path, version, name):
    stem = "torch_memory_saver_hook_mode_preload"
    (tmp_path / "torch_memory_saver").mkdir()
    for suffix in ("", "_cu12", "_cu13"):
        (tmp_path / f"{stem}{suffix}.abi3.so").touch()
    monkeypatch.setattr(utils, "__file__", str(tmp_path / "torch_memory_saver" / "utils.py"))
    fake = types.SimpleNamespace(version=types.SimpleNamespace(**{"cuda": None, "hip": None, **version}))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert utils.get_binary_path_from_package(stem) == tmp_path / f"{stem}{name}.abi3.so"
    # Only the unsuffixed file there: that one.
    for suffix in ("_cu12", "_cu13"):
        (tmp_path / f"{stem}{suffix}.abi3.so").unlink()
    assert utils.get_binary_path_from_package(stem) == tmp_path / f"{stem}.abi3.so"


def test_configure_subprocess_of_an_install_preloads_the_tms_library_path(monkeypatch, tmp_path, libtms):
    # TMS_LIBRARY_PATH names the library this process loads (torch mode, get_binary_path()):
    # children must preload that one too, not the install's copy beside the package.
    stem = "torch_memory_saver_hook_mode_preload"
    (tmp_path / "torch_memory_saver").mkdir()
    (tmp_path / f"{stem}_cu12.abi3.so").touch()
    monkeypatch.setattr(utils, "__file__", str(tmp_path / "torch_memory_saver" / "utils.py"))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(version=types.SimpleNamespace(cuda="12.9", hip=None)))
    monkeypatch.setattr(mode_preload, "_mapped_cudart_dir", lambda: None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with mode_preload.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == str(tmp_path / f"{stem}_cu12.abi3.so")
    monkeypatch.setenv("TMS_LIBRARY_PATH", libtms)
    with mode_preload.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == libtms == tms_pkg.get_binary_path()


def test_backup_arguments_are_refused_in_the_existing_librarys_words(monkeypatch):
    t = entrypoint.TorchMemorySaver()
    with pytest.raises(ValueError, match="requires enable_cpu_backup") as e:
        with t.region(enable_cpu_backup=False, cpu_backup_backend="mmap"):
            pass
    assert isinstance(e.value, tms_pkg.InvalidArgumentError)
    with pytest.raises(ValueError, match='must be "mmap" or "pinned"'):
        t._cpu_backup_backend(True, "disk")
    monkeypatch.delenv("TMS_INIT_CPU_BACKUP_BACKEND", raising=False)
    assert t._cpu_backup_backend(True, None) == "pinned" and t._cpu_backup_backend(False, None) is None
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "mmap")
    assert t._cpu_backup_backend(True, None) == "mmap" and t._cpu_backup_backend(True, "pinned") == "pinned"
    monkeypatch.setattr(entrypoint, "is_xpu", lambda: True)  # looked up at call time
    for backend in ("pinned", "mmap"):
        with pytest.raises(ValueError, match="not supported on XPU"):
            with t.region(enable_cpu_backup=True, cpu_backup_backend=backend):
                pass
    monkeypatch.setattr(entrypoint, "is_xpu", lambda: False)
    # ROCm takes pageable backups, which the existing library refuses there: they go through
    # page-locked staging buffers, which HIP registers as CUDA does.
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(version=types.SimpleNamespace(hip="6.2", cuda=None)))
    assert t._cpu_backup_backend(True, "mmap") == "mmap"


def test_enabled_initialises_nothing():
    t = entrypoint.TorchMemorySaver()
    assert t.enabled is True and t._impl is None


def test_affected_devices_calls_the_library_once_and_checks_the_count():
    calls = []

    def query(tag, out, capacity):
        calls.append(tag)
        for i in range(min(n, capacity)):
            out[i] = i * 2
        return n

    impl = types.SimpleNamespace(_binary_wrapper=types.SimpleNamespace(cdll=types.SimpleNamespace(tms_affected_devices=query)))
    for n in (0, 3, 64):
        assert entrypoint._TorchMemorySaverImpl._affected_devices(impl, "w") == [i * 2 for i in range(n)]
    n = 65
    with pytest.raises(AssertionError, match="Too many affected devices"):
        entrypoint._TorchMemorySaverImpl._affected_devices(impl, "w")
    assert calls == [b"w"] * 4


def test_keep_resident_affected_devices_and_the_backend_getter_on_the_sim(preloaded):
    r = preloaded(
        """
        class T:  # what keep_resident reads of a tensor
            def __init__(self, p, n): self.p, self.n = p, n
            def data_ptr(self): return self.p
            def numel(self): return self.n
        tms._ensure_initialized()
        lib = tms._impl._binary_wrapper
        cdll = lib.cdll
        assert cdll.tms_get_cpu_backup_backend() == b"mmap"  # TMS_INIT_CPU_BACKUP_BACKEND
        with tms.region("kv", True, False, "pinned"):  # the existing library's positional order
            assert cdll.tms_get_cpu_backup_backend() == b"pinned"
            rc, kept = cuda_malloc(3 << 20)
            rc2, other = cuda_malloc(2 << 20)
        assert rc == rc2 == 0 and cdll.tms_get_cpu_backup_backend() == b"mmap"
        with tms._impl._with_region_config(tag="raw", enable_cpu_backup=False):
            assert cdll.tms_get_current_tag() == b"raw" and cdll.tms_get_interesting_region()
            rc, raw = cuda_malloc(2 << 20)
        assert tms.keep_resident(T(kept + 4096, 8)) == 3 << 20 == tms.keep_resident(T(kept, 1))
        assert tms.keep_resident(T(kept, 0)) == 0, "an empty tensor"
        assert cdll.tms_keep_resident(ctypes.c_void_p(raw)) == 2 << 20
        assert cdll.tms_keep_resident(ctypes.c_void_p(12345)) == 0
        assert tms._impl._affected_devices("kv") == [0] and tms._impl._affected_devices("raw") == []
        assert tms._impl._affected_devices("nothing") == []
        ctypes.memmove(kept, b"k" * 16, 16)
        ctypes.memmove(other, b"o" * 16, 16)
        tms.pause("kv")
        tms.pause()
        assert ctypes.string_at(kept, 16) == b"k" * 16, "still mapped"
        assert tag_stats("kv")["paused_allocations"] == 1
        try:
            tms.keep_resident(T(other, 4))
        except tms_pkg.InvalidStateError as e:
            print("REFUSED", e)
        tms.resume()
        assert ctypes.string_at(other, 16) == b"o" * 16
        assert cuda_free(raw) == 0 and cdll.tms_keep_resident(ctypes.c_void_p(raw)) == 0
        print("OK")
        """,
        TMS_INIT_CPU_BACKUP_BACKEND="mmap",
    )
    assert "keep_resident requires an active allocation" in r.stdout and "OK" in r.stdout, r.stdout


def test_region_pools_are_keyed_as_callers_expect(preloaded):
    r = preloaded(
        """
        import contextlib, types
        class MemPool:
            def __init__(self, alloc=None): self.id = id(self)
        @contextlib.contextmanager
        def use_mem_pool(pool):
            yield
        cuda = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 0, MemPool=MemPool,
                                     use_mem_pool=use_mem_pool, is_current_stream_capturing=lambda: False)
        sys.modules["torch"] = types.SimpleNamespace(cuda=cuda, version=types.SimpleNamespace(cuda="13.0", hip=None))
        with tms.region(tag="w", enable_cpu_backup=True):
            pass
        with tms.region(tag="w", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            pass
        with tms.region(tag="d", enable_disk_backup=True):
            pass
        with tms.region(tag="c", chunk_size=4 << 20):
            pass
        keys = set(tms._impl._mem_pools)
        assert keys == {("w", True, False, "pinned", 0), ("w", True, False, "mmap", 0),
                        ("d", False, True, "", 0), ("c", False, False, "", 0, 4 << 20)}, keys
        assert tms._impl._mem_pools.pop(("w", True, False, "pinned", 0)) is not None
        tms._impl._mem_pools.clear()
        assert not tms._impl._mem_pools
        print("OK")
        """
    )
    assert "OK" in r.stdout


FAKE_TORCH = """
import contextlib, types
routed = []
class MemPool:
    def __init__(self, alloc=None): self.id = id(self)
@contextlib.contextmanager
def use_mem_pool(pool):
    routed.append(pool)
    yield
device = [0]
cuda = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: device[0], MemPool=MemPool,
                             use_mem_pool=use_mem_pool, is_current_stream_capturing=lambda: False)
sys.modules["torch"] = types.SimpleNamespace(cuda=cuda, version=types.SimpleNamespace(cuda="13.0", hip=None))
"""


def test_region_pools_answer_the_keys_of_earlier_versions(preloaded):
    # A Megatron fork drops a rebuilt context's pools by the 0.0.9 key, (tag, enable_cpu_backup),
    # after pausing the tag: the next region of the tag must get a new pool, never the old one
    # with its cached (paused) blocks.
    r = preloaded(
        FAKE_TORCH
        + """
def enter(tag, **kw):
    with tms.region(tag=tag, **kw):
        pass
    return routed[-1]

old = enter("ctx")
pools = tms._impl._mem_pools
assert enter("ctx") is old and ("ctx", False) in pools and ("ctx", True) not in pools
assert pools.get(("ctx", False)) is old and pools[("ctx", False)] is old
tms.pause("ctx")
for cpu_backup in (True, False):
    pools.pop(("ctx", cpu_backup), None)
assert ("ctx", False) not in pools and not any(k[0] == "ctx" for k in pools)
new = enter("ctx")
assert new is not old, "the rebuilt context's region got the dropped pool"

# A weight arena replaces the tag's pool by the 0.0.9 key once its tensors moved: the tag's next
# region allocates from the new pool, and nothing holds the old one any more.
arena = MemPool()
pools[("ctx", False)] = arena
assert pools[("ctx", False)] is arena and enter("ctx") is arena
assert [k for k in pools if k[0] == "ctx"] == [("ctx", False, False, "", 0)], list(pools)
assert all(v is not new for v in dict.values(pools)), "the replaced pool is still held"
# A key that covers no pool is kept as given; a full key is set as it is.
pools[("fresh", True)] = "P"
assert dict.__contains__(pools, ("fresh", True)) and pools[("fresh", True)] == "P"
del pools[("fresh", True)]

# An earlier key names every pool it covers: both backends of a backed-up tag, two devices.
a = enter("w", enable_cpu_backup=True)
b = enter("w", enable_cpu_backup=True, cpu_backup_backend="mmap")
device[0] = 1
c = enter("w", enable_cpu_backup=True)
device[0] = 0
assert pools[("w", True, False, 1)] is c and pools.get(("w", True, 1)) is c
assert pools[("w", True, 0)] == [a, b] and pools.get(("w", True)) == [a, b, c]
assert pools.pop(("w", True, False, 0)) == [a, b] and ("w", True, 0) not in pools
assert pools.pop(("w", True)) is c
assert not any(k[0] == "w" for k in pools), list(pools)
del pools[("ctx", False)]
assert not pools
for missing in (("ctx", False), ("nope", True, 0), ("nope", True, False, 0)):
    assert missing not in pools and pools.get(missing, "dflt") == "dflt" and pools.pop(missing, 7) == 7
    for f in (pools.pop, pools.__getitem__, pools.__delitem__):
        try:
            f(missing)
            raise SystemExit(f"{f.__name__}{missing} did not raise")
        except KeyError:
            pass
print("OK")
"""
    )
    assert r.stdout.strip() == "OK", r.stdout


def test_binary_wrapper_takes_the_path_by_keyword(libtms):
    r = run_py(
        f"""
        from torch_memory_saver.binary_wrapper import BinaryWrapper
        w = BinaryWrapper(path_binary={libtms!r})
        assert w.path == {libtms!r} and w.tms_version() and w.cdll.tms_version()
        from torch_memory_saver.hooks.mode_preload import HookUtilModePreload
        try:
            # The existing library's own construction, in a process without the preload.
            BinaryWrapper(path_binary=HookUtilModePreload().get_path_binary())
        except tms_pkg.LibraryNotFoundError as e:
            print("ERR", e)
        """,
        clean_env(),
    )
    assert r.stdout.startswith("ERR BinaryWrapper(path_binary=None): no library to load"), r.stdout
    assert "torch_memory_saver.get_binary_path()" in r.stdout, r.stdout


def test_cuda_runtime_names_resolve_through_the_library_handle(libtms, tmp_path):
    src = tmp_path / "rt.c"
    src.write_text("int cudaHostGetFlags(unsigned *f, void *p) { (void)p; *f = 7; return 0; }\n")
    rt = tmp_path / "libcudart.so.99"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(rt), str(src)], check=True)
    r = run_py(
        f"""
        ctypes.CDLL({str(rt)!r}, mode=os.RTLD_LOCAL)  # loaded privately, as a runtime may be
        from torch_memory_saver.binary_wrapper import BinaryWrapper
        w = BinaryWrapper({libtms!r})
        f = ctypes.c_uint(0)
        print(w.cdll.cudaHostGetFlags(ctypes.byref(f), None), f.value)
        try:
            w.cdll.cudaNoSuchFunction
        except AttributeError as e:
            print("ERR", e)
        """,
        clean_env(),
    )
    lines = r.stdout.splitlines()
    assert lines[0] == "0 7" and lines[1].startswith("ERR cudaNoSuchFunction"), r.stdout


def test_values_that_c_would_change_are_refused(preloaded):
    r = preloaded(
        """
        for bad in (2**64 + 5, -1):
            try:
                tms.memory_margin_bytes = bad
            except tms_pkg.InvalidArgumentError as e:
                print("MARGIN", e)
        assert tms.memory_margin_bytes == 0
        try:
            tms.set_disk_backup_dir("/tmp\\0/elsewhere")
        except tms_pkg.InvalidArgumentError as e:
            print("PATH", e)
        """
    )
    assert r.stdout.count("MARGIN") == 2 and "NUL byte" in r.stdout, r.stdout


def test_set_config_that_is_refused_changes_nothing(preloaded):
    # BinaryWrapper.set_config raises on a refused value; it must not leave the settings it
    # applied before that value: the thread's allocations would become pauseable under a tag.
    r = preloaded(
        """
        from torch_memory_saver import binary_wrapper
        w = binary_wrapper.load()
        def now():
            return (w.tms_get_current_tag(), w.tms_get_interesting_region(), w.tms_get_enable_cpu_backup())
        before = now()
        for bad in (dict(cpu_backup_backend="disk"), dict(cpu_backup_backend="bogus"), dict(tag=7)):
            try:
                w.set_config(**dict(dict(tag="x", interesting_region=True, enable_cpu_backup=True), **bad))
            except (tms_pkg.InvalidArgumentError, TypeError) as e:
                print("refused", type(e).__name__, e)
            else:
                raise AssertionError(f"{bad} accepted")
            assert now() == before, (bad, before, now())
        print("ok")
        """
    )
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_set_config_refuses_a_cpu_and_a_disk_backup_together(preloaded):
    # CPU and disk backups are mutually exclusive (region() refuses both, and so does the C
    # setter enabling one while the other is on). set_config turned the CPU backup off first,
    # so asked for both it silently dropped the CPU backup the caller asked for.
    r = preloaded(
        """
        from torch_memory_saver import binary_wrapper
        w = binary_wrapper.load()
        def now():
            return (w.tms_get_current_tag(), w.tms_get_interesting_region(), w.tms_get_enable_cpu_backup(),
                    w.tms_get_enable_disk_backup())
        before = now()
        try:
            w.set_config(tag="x", interesting_region=True, enable_cpu_backup=True, enable_disk_backup=True)
        except tms_pkg.InvalidArgumentError as e:
            assert "mutually exclusive" in str(e), e
        else:
            raise AssertionError(f"accepted: now {now()}")
        assert now() == before, (before, now())
        w.set_config(tag="x", enable_disk_backup=True)
        assert now()[2:] == (False, True), now()
        print("ok")
        """
    )
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr
