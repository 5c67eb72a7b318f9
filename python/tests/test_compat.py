"""What integrations of the existing torch_memory_saver reach for, on the simulated device and
without torch: module and attribute names, the facade's internal shape (``_impl_ctor_kwargs``,
``_impl``, ``_ensure_initialized``), the library's C names through ``_binary_wrapper.cdll``, the
library file names, and the lenient arguments they pass."""

from __future__ import annotations

import importlib
import os
import platform
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import torch_memory_saver as tms_pkg
from torch_memory_saver import utils

from conftest import SIM_ALLOC, clean_env, run_py

STEMS = [f"torch_memory_saver_hook_mode_{m}{c}" for m in ("preload", "torch") for c in ("", "_cu12", "_cu13")]


def test_every_module_and_name_integrations_import():
    for mod in ("entrypoint", "binary_wrapper", "hooks", "hooks.base", "hooks.mode_preload", "hooks.mode_torch",
                "utils", "testing_utils"):
        importlib.import_module(f"torch_memory_saver.{mod}")
    from torch_memory_saver.entrypoint import TorchMemorySaver, _TorchMemorySaverImpl
    from torch_memory_saver.hooks.base import HookUtilBase
    from torch_memory_saver.testing_utils import get_and_print_gpu_memory
    from torch_memory_saver.utils import change_env, get_binary_path_from_package, is_xpu

    assert type(tms_pkg.torch_memory_saver) is TorchMemorySaver is tms_pkg.TorchMemorySaver
    assert callable(get_and_print_gpu_memory) and callable(change_env) and callable(get_binary_path_from_package)
    assert is_xpu() in (True, False)
    impl = _TorchMemorySaverImpl(hook_mode="torch")
    assert impl.hook_mode == "torch" and isinstance(impl._hook_util, HookUtilBase)
    assert HookUtilBase.create("preload").get_allocator() is None
    with pytest.raises(ValueError, match="hook_mode must be one of"):
        _TorchMemorySaverImpl(hook_mode="gms")


def test_hook_classes_keep_the_existing_allocator_contract():
    """``HookUtilBase.get_allocator()`` is None unless a mode says otherwise (a subclass that
    only gives its library's path, as the existing preload hook does); torch mode's is what
    ``torch.cuda.MemPool(allocator=...)`` takes, the raw ``_cuda_CUDAAllocator``, as the
    existing library's own pool code and its NPU, MUSA and XPU forks pass it; and a pool is
    made from a hook of either contract (raw allocator, or the ``CUDAPluggableAllocator``)."""
    from torch_memory_saver.hooks.base import HookUtilBase

    class OnlyPath(HookUtilBase):
        def get_path_binary(self):
            return None

    assert OnlyPath().get_allocator() is None
    torch = pytest.importorskip("torch")
    from torch_memory_saver import get_binary_path
    from torch_memory_saver.entrypoint import _TorchMemorySaverImpl
    from torch_memory_saver.hooks.mode_torch import HookUtilModeTorch

    raw = HookUtilBase.create("torch").get_allocator()
    assert isinstance(raw, torch._C._cuda_CUDAAllocator), type(raw)
    wrapped = torch.cuda.memory.CUDAPluggableAllocator(get_binary_path(), "tms_torch_malloc", "tms_torch_free")
    for given in (raw, wrapped):
        class Hook(HookUtilModeTorch):
            def get_allocator(self, given=given):
                return given

        impl = _TorchMemorySaverImpl(hook_mode="torch")
        impl._hook_util = Hook()
        try:
            impl._new_pool(torch)
        except RuntimeError as e:
            # No NVIDIA driver here: MemPool took the allocator and stopped at the device.
            assert "driver" in str(e).lower() or "cuda" in str(e).lower(), e


def test_torch_mode_cuda_graph_warns_of_a_pool_not_its_own():
    """In torch mode a graph's memory is pauseable only from one of the package's pools (made
    for ``pool=None``): a pool of PyTorch's own allocator is used as given, with a warning
    that the graph's memory is not pauseable. (The capture itself needs CUDA: not here.)"""
    pytest.importorskip("torch")
    from torch_memory_saver.entrypoint import _TorchMemorySaverImpl

    impl = _TorchMemorySaverImpl(hook_mode="torch")
    assert not impl._own_pool((0, 12345))
    with pytest.warns(UserWarning, match="not pauseable"):
        try:
            with impl.cuda_graph(cuda_graph=None, pool=(0, 12345), tag="g"):
                pass
        except Exception:
            pass  # no CUDA here: the capture cannot start


def test_impl_disable_takes_the_existing_keyword(preloaded):
    """``_TorchMemorySaverImpl.disable(dispose_mem_pool_after_use=...)``, the existing
    library's keyword, is taken either way (here without CUDA: the block runs, unpauseable)."""
    r = preloaded(
        """
        from torch_memory_saver import torch_memory_saver as tms
        tms._ensure_initialized()
        for dispose in (True, False):
            with tms._impl.disable(dispose_mem_pool_after_use=dispose):
                print("inside", dispose)
        """
    )
    assert "inside True" in r.stdout and "inside False" in r.stdout, r.stdout


def test_facade_shape_before_and_after_first_use():
    r = run_py(
        """
        from torch_memory_saver.entrypoint import TorchMemorySaver, _TorchMemorySaverImpl
        assert tms._impl is None and tms._impl_ctor_kwargs == {}, (tms._impl, tms._impl_ctor_kwargs)
        assert tms.hook_mode == "preload"
        tms.hook_mode = "torch"
        assert tms._impl_ctor_kwargs == {"hook_mode": "torch"} and tms._impl is None
        tms._ensure_initialized()
        assert isinstance(tms._impl, _TorchMemorySaverImpl) and tms._impl.hook_mode == "torch"
        assert not hasattr(tms, "_impl_ctor_kwargs"), "the constructor state goes once _impl exists"
        first = tms._impl
        tms._ensure_initialized()
        assert tms._impl is first
        tms.hook_mode = "torch"  # the same mode: fine
        # dynamo's reset: _impl back to None, kwargs recreated; the next use builds a new one.
        tms._impl = None
        tms._impl_ctor_kwargs = {}
        tms.hook_mode = "torch"
        tms.pause("")
        assert tms._impl is not first and tms._impl.hook_mode == "torch"
        lib = tms._impl._binary_wrapper
        assert isinstance(lib.cdll, ctypes.CDLL)
        print("OK", tms.stats()["backend"], "torch" in sys.modules)
        """,
        clean_env(TMS_BACKEND="sim", TMS_LIBRARY_PATH=tms_pkg.get_binary_path()),
    )
    assert r.stdout.split() == ["OK", "sim", "False"], r.stdout


def test_hook_mode_property_can_be_patched_as_awex_does():
    r = run_py(
        """
        cls = type(tms)
        prop = cls.hook_mode
        assert isinstance(prop, property) and prop.fget and prop.fset
        seen = []
        def safe_setter(self, value):
            seen.append(value)
            if not hasattr(self, "_impl_ctor_kwargs"):
                return
            prop.fset(self, value)
        cls.hook_mode = property(prop.fget, safe_setter)
        tms.hook_mode = "torch"
        assert tms._impl_ctor_kwargs["hook_mode"] == "torch"
        tms._ensure_initialized()
        tms.hook_mode = "preload"  # after first use: their setter skips it, nothing raises
        print(seen, tms.hook_mode)
        """,
        clean_env(TMS_BACKEND="sim", TMS_LIBRARY_PATH=tms_pkg.get_binary_path()),
    )
    assert r.stdout.strip() == "['torch', 'preload'] torch", r.stdout


def test_a_mode_pinned_by_building_the_impl_survives_megatrons_import(preloaded):
    """axrl (XYZ-AI-Lab/axrl, axrl/worker/megatron_worker.py) runs its Megatron workers under
    LD_PRELOAD and pins preload mode before importing Megatron, whose import sets
    ``hook_mode = "torch"`` unconditionally: ``hook_mode = "preload"``,
    ``_ensure_initialized()``, then ``_impl_ctor_kwargs = {}`` so that Megatron's assignment
    goes there instead of raising. The built implementation keeps preload mode, as in the
    existing library: a switch to torch mode would give its tensors CUDA-IPC-incompatible
    storage."""
    r = preloaded(
        """
        tms.hook_mode = "preload"
        tms._ensure_initialized()
        tms._impl_ctor_kwargs = {}
        impl = tms._impl
        tms.hook_mode = "torch"  # megatron/core/inference/contexts/dynamic_context.py, at import
        with tms.region(tag="w"):
            rc, p = cuda_malloc(1 << 20)
        print(tms._impl is impl, impl.hook_mode, tms.hook_mode, tag_stats("w")["allocations"])
        """
    )
    assert r.stdout.split() == ["True", "preload", "preload", "1"], r.stdout


def test_an_installed_impl_takes_every_call_with_the_keywords_it_expects():
    r = run_py(
        """
        import contextlib
        import torch_memory_saver.entrypoint as ep
        calls = []
        class OwnImpl:
            # Like dynamo's: no cpu_backup_backend, no zero_copy, no enabled, no _binary_wrapper.
            @contextlib.contextmanager
            def region(self, tag, enable_cpu_backup):
                calls.append(("region", tag, enable_cpu_backup)); yield
            @contextlib.contextmanager
            def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup):
                calls.append(("cuda_graph", cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup)); yield
            @contextlib.contextmanager
            def disable(self):
                calls.append(("disable",)); yield
            def pause(self, tag=None): calls.append(("pause", tag))
            def resume(self, tag=None): calls.append(("resume", tag))
            def get_cpu_backup(self, x): calls.append(("get_cpu_backup", x)); return None
        original = ep.TorchMemorySaver._ensure_initialized
        def patched(self):
            if self._impl is not None:
                return
            if self._impl_ctor_kwargs.get("hook_mode") is None:
                self._impl = OwnImpl()
                del self._impl_ctor_kwargs
            else:
                original(self)
        ep.TorchMemorySaver._ensure_initialized = patched
        with tms.region(tag="weights", enable_cpu_backup=True):
            pass
        with tms.cuda_graph("G", pool="P", stream="S", tag="cuda_graph"):
            pass
        with tms.disable():
            pass
        tms.pause("kv"); tms.resume(); tms.get_cpu_backup("X")
        assert tms.enabled is True
        for c in calls: print(c)
        """,
        clean_env(),
    )
    assert r.stdout.splitlines() == [
        "('region', 'weights', True)",
        "('cuda_graph', 'G', 'P', 'S', 'global', 'cuda_graph', False)",
        "('disable',)",
        "('pause', 'kv')",
        "('resume', None)",
        "('get_cpu_backup', 'X')",
    ], r.stdout


def test_upstream_c_names_round_trip_through_the_region_stack(preloaded):
    r = preloaded(
        """
        def count(tag):
            return sum(t["allocations"] for t in tms.stats()["tags"] if t["tag"] == tag)
        with tms.region(tag="outer", enable_cpu_backup=True):
            cdll = tms._impl._binary_wrapper.cdll
            lib = tms._impl._binary_wrapper
            assert lib.tms_get_interesting_region() is True and lib.tms_get_current_tag() == b"outer"
            assert lib.tms_get_enable_cpu_backup() is True and lib.tms_get_cpu_backup_backend() == b"pinned"
            # DeepEP's patch, as slime and miles call it (no types declared on their side).
            original = cdll.tms_get_interesting_region()
            cdll.tms_set_interesting_region(False)
            rc, ordinary = cuda_malloc(1 << 20)   # passes through to the runtime below, if any
            cdll.tms_set_interesting_region(original)
            assert count("outer") == 0, rc
            if rc == 0:
                assert cuda_free(ordinary) == 0
            rc, kept = cuda_malloc(1 << 20)
            assert rc == 0 and count("outer") == 1
            # Setters change the innermost region; an inner region has its own.
            assert lib.tms_set_current_tag(b"renamed") == 0 and lib.tms_set_cpu_backup_backend(b"mmap") == 0
            with tms.region(tag="inner"):
                assert lib.tms_get_current_tag() == b"inner" and lib.tms_get_enable_cpu_backup() is False
                assert lib.tms_set_enable_cpu_backup(True) == 0 and lib.tms_get_enable_cpu_backup() is True
            assert lib.tms_get_current_tag() == b"renamed" and lib.tms_get_cpu_backup_backend() == b"mmap"
            rc, moved = cuda_malloc(1 << 20)
            assert rc == 0 and count("renamed") == 1
            # Bad values are refused with a status and a message, never an exit.
            assert lib.tms_set_current_tag(b"") == 3 and "empty" in lib.last_error()
            assert lib.tms_set_cpu_backup_backend(b"disk") == 3 and "disk" in lib.last_error()
            assert lib.tms_set_current_tag(None) == 3
        # The region closed: back to the thread's default settings.
        assert lib.tms_get_interesting_region() is False and lib.tms_get_current_tag() == b"default"
        # No region open: a setter opens one, tms_region_exit closes it.
        assert lib.tms_set_interesting_region(True) == 0 and lib.tms_get_interesting_region() is True
        rc, opened = cuda_malloc(1 << 20)
        assert rc == 0 and count("default") == 1
        assert lib.tms_region_exit() == 0 and lib.tms_get_interesting_region() is False
        assert lib.tms_region_exit() == 4
        # Process-wide names.
        assert cdll.set_memory_margin_bytes(4096) == 0 and tms.memory_margin_bytes == 4096
        assert lib.tms_set_retain_cpu_backup(True) == 0 and lib.tms_get_retain_cpu_backup() is True
        assert tms.retain_cpu_backup is True
        ctypes.memmove(kept, b"\\x5a" * (1 << 20), 1 << 20)
        assert cdll.tms_pause(b"") == 0, "empty tag: every tag"
        assert all(t["bytes_active"] == 0 for t in tms.stats()["tags"]), tms.stats()
        # Typed as the existing library's binding: uint8_t pointers in and out.
        u8 = lambda a: ctypes.cast(ctypes.c_void_p(a), ctypes.POINTER(ctypes.c_uint8))
        assert lib.tms_get_cpu_backup_pointer.restype is ctypes.POINTER(ctypes.c_uint8)
        p = lib.tms_get_cpu_backup_pointer(u8(kept), 1 << 20)
        assert p and ctypes.string_at(p, 16) == b"\\x5a" * 16 and p[0] == 0x5a
        assert lib.tms_get_cpu_backup_pointer(u8(moved), 1 << 20), "mmap backups too"
        assert not lib.tms_get_cpu_backup_pointer(u8(opened), 1 << 20), "no backup asked"
        assert not lib.tms_get_cpu_backup_pointer(u8(12345), 16)
        print("NOTFOUND", lib.last_error())
        assert cdll.tms_resume(b"") == 0
        assert ctypes.string_at(kept, 16) == b"\\x5a" * 16
        print("OK")
        """
    )
    assert r.stdout.strip().endswith("OK"), r.stdout
    assert "NOTFOUND" in r.stdout and "0x3039" in r.stdout, r.stdout


def test_last_error_is_read_whole():
    # A message naming many allocations (or a long value) runs past any fixed buffer: the
    # exception must carry all of it, up to its last character.
    r = run_py(
        """
        from torch_memory_saver.binary_wrapper import BinaryWrapper
        lib = BinaryWrapper(tms_pkg.get_binary_path())
        value = b"x" * 6000 + b"END"
        assert lib.tms_set_cpu_backup_backend(value) == 3
        msg = lib.last_error()
        assert "x" * 6000 + "END" in msg, len(msg)
        try:
            lib.check(3)
            raise SystemExit("not raised")
        except tms_pkg.InvalidArgumentError as e:
            assert "END" in str(e), len(str(e))
        print("OK")
        """,
        clean_env(TMS_BACKEND="sim"),
    )
    assert r.stdout.strip() == "OK", r.stdout + r.stderr


def test_get_cpu_backup_is_none_without_the_library_preloaded():
    # Integrations ask for every parameter's backup, also in processes that never enabled the
    # library (preload mode without LD_PRELOAD): there are no backups there, so None, as the
    # docstring says; the library is not loaded for it, and other calls still raise.
    pytest.importorskip("torch")
    r = run_py(
        """
        import torch
        assert tms.hook_mode == "preload" and not tms.available
        assert tms.get_cpu_backup(torch.arange(64)) is None
        assert tms.get_cpu_backup(torch.arange(64), zero_copy=True) is None
        assert tms._impl._lib is None, "loaded for nothing"
        try:
            tms.pause("kv")
            raise SystemExit("a pause without the library was taken")
        except tms_pkg.LibraryNotFoundError:
            pass
        print("OK")
        """,
        clean_env(),
    )
    assert r.stdout.strip() == "OK", r.stdout + r.stderr


def test_get_cpu_backup_is_none_where_there_is_nothing_to_back_up(preloaded):
    # slime asks for every parameter's backup (zero_copy=True) and falls back on None, as the
    # existing library answers for a tensor outside its allocations. With torch on the CPU, a
    # tensor over simulated device memory stands in for a CUDA one: only its address is used.
    pytest.importorskip("torch")
    r = preloaded(
        SIM_ALLOC
        + textwrap.dedent(
            """
        import torch
        n = 1 << 20
        p, data = alloc("w", n, 3, enable_cpu_backup=True)
        def over(addr, size):
            return torch.frombuffer((ctypes.c_uint8 * size).from_address(addr), dtype=torch.uint8)
        t = over(p, n)
        assert tms.get_cpu_backup(t) is None, "active, never paused"
        tms.pause("w")
        for zero_copy in (False, True):
            b = tms.get_cpu_backup(t, zero_copy=zero_copy)
            assert b.shape == t.shape and ctypes.string_at(b.data_ptr(), n) == data
            part = tms.get_cpu_backup(over(p + 4096, 256).view(torch.int32), zero_copy=zero_copy)
            assert part.dtype == torch.int32 and ctypes.string_at(part.data_ptr(), 256) == data[4096:4352]
            # Made outside every region, across the allocation's end, or empty: nothing to back up.
            for nothing in (torch.arange(64), over(p + n - 8, 16), t[10:10]):
                assert tms.get_cpu_backup(nothing, zero_copy=zero_copy) is None
        del b, part
        for bad, err in ((torch.arange(64).view(8, 8).t(), tms_pkg.InvalidArgumentError), ("x", TypeError)):
            try:
                tms.get_cpu_backup(bad)
                raise SystemExit(f"{bad!r} was taken")
            except err:
                pass
        tms.resume("w")
        assert intact(p, data)
        print("OK")
        """
        )
    )
    assert r.stdout.strip() == "OK", r.stdout + r.stderr


def test_empty_tag_means_every_tag_and_truthy_backup_flags(preloaded):
    preloaded(
        """
        with tms.region(tag="a", enable_cpu_backup=1):
            rc, a = cuda_malloc(1 << 20)
        with tms.region(tag="b", enable_cpu_backup="yes"):
            rc, b = cuda_malloc(1 << 20)
        ctypes.memmove(a, b"A" * (1 << 20), 1 << 20)
        ctypes.memmove(b, b"B" * (1 << 20), 1 << 20)
        tms.pause("")
        assert tag_stats("a")["bytes_paused"] and tag_stats("b")["bytes_paused"]
        assert tag_stats("a")["host_backup_bytes"] == 1 << 20
        tms.resume("")
        assert ctypes.string_at(a, 4) == b"AAAA" and ctypes.string_at(b, 4) == b"BBBB"
        tms.retain_cpu_backup = 1
        assert tms.retain_cpu_backup is True
        """
    )


def test_library_file_names_beside_the_package():
    here = Path(tms_pkg.__file__).resolve().parent
    root = here.parent
    main = Path(tms_pkg.get_binary_path())
    for stem in STEMS:
        p = utils.get_binary_path_from_package(stem)
        assert p.is_file(), p
        if (root / f"{stem}.abi3.so").exists():
            # Installed: the path AReaL and slime build by hand (with the CUDA major's suffix
            # where torch or the runtime tells it), a copy of the one build.
            major = utils._cuda_major()
            suffixed = stem.endswith(("_cu12", "_cu13")) or major is None
            assert p == root / (f"{stem}.abi3.so" if suffixed else f"{stem}_cu{major}.abi3.so")
            assert p.read_bytes() == main.read_bytes()
        else:  # a source checkout: the development build serves every name
            assert p == main
    with pytest.raises(tms_pkg.LibraryNotFoundError, match="no_such_library"):
        utils.get_binary_path_from_package("no_such_library")
    with pytest.raises(ValueError):
        utils.get_binary_path_from_package("../etc/passwd")


@pytest.mark.skipif(
    not (Path(tms_pkg.__file__).resolve().parent.parent / f"{STEMS[0]}.abi3.so").exists(),
    reason="needs the package installed from its wheel (scripts/test installs it)",
)
def test_preload_by_the_upstream_file_name_as_areal_and_slime_build_it(tmp_path):
    import torch_memory_saver

    path = os.path.join(os.path.dirname(os.path.dirname(torch_memory_saver.__file__)), f"{STEMS[0]}.abi3.so")
    env = clean_env(LD_PRELOAD=path, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", TMS_BACKEND="sim",
                    TMS_SIM_CAPACITY="64MiB", TMS_SOCKET_DIR=str(tmp_path))
    r = run_py(
        """
        from torch_memory_saver import binary_wrapper
        assert tms.available
        rc, p = cuda_malloc(3 << 20)
        assert rc == 0
        ctypes.memmove(p, b"q" * (3 << 20), 3 << 20)
        tms.pause()
        backed_up = tag_stats("default")["host_backup_bytes"]
        tms.resume()
        assert ctypes.string_at(p, 3) == b"qqq"
        print(os.path.basename(binary_wrapper.preloaded_path()), backed_up)
        """,
        env,
    )
    assert r.stdout.split() == [f"{STEMS[0]}.abi3.so", str(3 << 20)], r.stdout


def test_miles_launcher_finds_the_disk_backend_in_the_preload_file():
    # miles/ray/train/actor_factory.py refuses a library without disk backups by looking for
    # the variable's name in the file it is about to preload.
    path = utils.get_binary_path_from_package("torch_memory_saver_hook_mode_preload")
    data = Path(path).read_bytes()
    for var in ("TMS_INIT_ENABLE_DISK_BACKUP", "TMS_INIT_ENABLE_CPU_BACKUP",
                "TMS_DISK_BACKUP_CHUNK_MB"):
        assert var.encode() in data, (var, path)


def test_megatron_buffers_in_tags_of_their_own_under_init_enable(preloaded):
    """slime's and miles' Megatron patch: with TMS_INIT_ENABLE=1 and CPU backup every
    allocation is the "default" tag's, and the DDP buffers open regions of their own without
    backup (``partial(torch_memory_saver.region, tag=..., enable_cpu_backup=False)``). miles'
    actor then sets ``memory_margin_bytes``, pauses the tags one by one or all with
    ``tag=None``, resumes with ``tag=None``, and syncs weights under ``disable()``."""
    r = preloaded(
        """
        from functools import partial
        n = 1 << 20
        tms.memory_margin_bytes = 1 << 20
        rc, d = cuda_malloc(n)
        assert rc == 0
        ctypes.memmove(d, b"d" * n, n)
        for tag in ("param_buffer", "grad_buffer"):
            with partial(tms.region, tag=tag, enable_cpu_backup=False)():
                assert cuda_malloc(n)[0] == 0
        active = lambda: sorted((t["tag"], t["bytes_active"]) for t in tms.stats()["tags"])
        before = active()
        assert [tag for tag, b in before] == ["default", "grad_buffer", "param_buffer"], before
        assert all(b >= n for tag, b in before), before
        with tms.disable():
            cuda_malloc(n)  # passes through to the runtime below, if any: no tag's
        tms.pause(tag="grad_buffer")
        tms.pause(tag="default")
        tags = tms.stats()["tags"]
        print({t["tag"]: (t["allocations"], t["host_backup_bytes"] > 0) for t in tags})
        tms.resume(tag=None)
        assert ctypes.string_at(d, n) == b"d" * n
        tms.pause(tag="param_buffer")
        tms.pause(tag=None)
        assert all(b == 0 for tag, b in active()), active()
        tms.resume(tag=None)
        assert ctypes.string_at(d, n) == b"d" * n
        print(active() == before)
        """,
        TMS_INIT_ENABLE="1",
        TMS_INIT_ENABLE_CPU_BACKUP="1",
    )
    lines = r.stdout.splitlines()
    paused = "{'default': (1, True), 'grad_buffer': (1, False), 'param_buffer': (1, False)}"
    assert lines[0] == paused, r.stdout
    assert lines[1] == "True", r.stdout


def test_change_env_restores_absent_as_absent(monkeypatch):
    monkeypatch.delenv("TMS_TEST_X", raising=False)
    monkeypatch.setenv("TMS_TEST_Y", "old")
    with utils.change_env("TMS_TEST_X", "1"), utils.change_env("TMS_TEST_Y", "new"):
        assert os.environ["TMS_TEST_X"] == "1" and os.environ["TMS_TEST_Y"] == "new"
    assert "TMS_TEST_X" not in os.environ and os.environ["TMS_TEST_Y"] == "old"
    with pytest.raises(KeyError):
        with utils.change_env("TMS_TEST_Y", None):
            assert "TMS_TEST_Y" not in os.environ
            raise KeyError("boom")
    assert os.environ["TMS_TEST_Y"] == "old"


def test_is_xpu_is_false_without_torch():
    r = run_py("from torch_memory_saver.utils import is_xpu\nprint(is_xpu(), 'torch' in sys.modules)\n", clean_env())
    assert r.stdout.split()[0] == "False"


@pytest.mark.skipif(not os.environ.get("TMS_TEST_WHEEL"), reason="TMS_TEST_WHEEL names the wheel to check")
def test_wheel_file_list():
    wheel = Path(os.environ["TMS_TEST_WHEEL"])
    names = set(zipfile.ZipFile(wheel).namelist())
    expected_libs = {f"{s}.abi3.so" for s in STEMS} | {"torch_memory_saver/libtms.abi3.so"}
    assert expected_libs <= names, sorted(expected_libs - names)
    for mod in ("__init__", "__main__", "_install", "entrypoint", "binary_wrapper", "saver", "errors", "utils", "testing_utils",
                "hooks/__init__", "hooks/base", "hooks/mode_preload", "hooks/mode_torch"):
        assert f"torch_memory_saver/{mod}.py" in names, mod
    assert any(n.endswith(".data/scripts/tmsctl") for n in names), "tmsctl goes onto PATH"
    assert not any("/tests/" in n or n.endswith(".pyc") for n in names), sorted(names)
    wheel_tag = next(n for n in names if n.endswith(".dist-info/WHEEL"))
    tags = zipfile.ZipFile(wheel).read(wheel_tag).decode()
    arch = platform.machine()
    assert f"Tag: cp39-abi3-manylinux_2_28_{arch}" in tags, f"one wheel for every Python 3 on {arch} glibc >= 2.28"
    z = zipfile.ZipFile(wheel)
    assert len({z.getinfo(n).CRC for n in expected_libs}) == 1, "every name is the same build"
    for n in expected_libs:
        assert (z.getinfo(n).external_attr >> 16) & 0o170000 != 0o120000, f"{n} is a symlink"
        assert z.getinfo(n).file_size > 100_000, n


@pytest.mark.parametrize("bad", ["/etc/hostname", "/nonexistent/libtms.so", "/tmp"])
def test_a_tms_library_path_that_names_no_library_is_refused_saying_so(bad):
    # It used to go into the advice as it was: "run `LD_PRELOAD=/etc/hostname python ...`".
    r = run_py(
        """
        try:
            tms_pkg.get_binary_path()
            raise SystemExit("should have raised")
        except tms_pkg.LibraryNotFoundError as e:
            print("MSG", e)
        """,
        clean_env(TMS_BACKEND="sim", TMS_LIBRARY_PATH=bad),
    )
    assert "TMS_LIBRARY_PATH=" in r.stdout and "libtms.so" in r.stdout, r.stdout


def test_a_ctrl_c_as_a_zero_copy_backup_is_handed_out_releases_its_lease(preloaded):
    # get_cpu_backup(zero_copy=True) may wait up to a minute in the library for the page-locking
    # of a retained backup; a Ctrl-C then is raised as the call returns, the lease taken. Nothing
    # holds it but the caller: left, it kept the backup's host memory for the process's life.
    # The stand-in calls the library, then interrupts the main thread as a Ctrl-C would.
    pytest.importorskip("torch")
    r = preloaded(
        SIM_ALLOC
        + textwrap.dedent(
            """
        import _thread, signal, torch
        # No KeyboardInterrupt where SIGINT came ignored (a job started in the background).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        n = 1 << 20
        p, data = alloc("w", n, 3, enable_cpu_backup=True)
        t = torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)
        tms.pause("w")
        lib = tms._impl._binary_wrapper
        real = lib.tms_acquire_cpu_backup
        leases = []
        def interrupted(addr, nbytes, out, lease):
            status = real(addr, nbytes, out, lease)
            leases.append(lease._obj.value)
            _thread.interrupt_main()
            return status
        lib.tms_acquire_cpu_backup = interrupted
        try:
            tms.get_cpu_backup(t, zero_copy=True)
            raise SystemExit("no KeyboardInterrupt")
        except KeyboardInterrupt:
            pass
        lib.tms_acquire_cpu_backup = real
        assert leases and leases[0], leases
        rc = lib.tms_release_cpu_backup(leases[0])
        assert rc == 5, f"the lease of the interrupted call was still held (release: {rc})"
        view = tms.get_cpu_backup(t, zero_copy=True)  # the next call is handed its own
        assert ctypes.string_at(view.data_ptr(), n) == data
        tms.resume("w")
        assert intact(p, data)
        print("OK")
        """
        )
    )
    assert r.stdout.strip() == "OK", r.stdout + r.stderr
