"""The Python shim's paths that need no torch and no GPU, against the simulated device in a
preloaded subprocess. Allocations are made through the interposed cudaMalloc (ctypes), and the
simulated device's memory is host memory, so contents can be written and read directly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import torch_memory_saver as tms_pkg
from torch_memory_saver import torch_memory_saver as tms

from conftest import clean_env, run_py

MIB = 1 << 20


def test_import_needs_neither_torch_nor_a_gpu():
    r = run_py(
        "import sys\nassert 'torch' not in sys.modules\nprint(tms.hook_mode, tms.enabled, tms.available)\n"
        "assert 'torch' not in sys.modules\n",
        clean_env(),
    )
    # enabled is True as in the existing library; available tells that preload mode lacks the preload.
    assert r.stdout.split() == ["preload", "True", "False"]


def test_preload_mode_without_preload_names_the_fix():
    r = run_py(
        """
        try:
            tms.pause()
        except tms_pkg.LibraryNotFoundError as e:
            print("ERR", e)
        """,
        clean_env(),
    )
    assert "LD_PRELOAD" in r.stdout and "configure_subprocess" in r.stdout, r.stdout
    assert "hook_mode = 'torch'" in r.stdout


def test_region_pause_resume_keeps_backed_up_contents(preloaded):
    r = preloaded(
        """
        assert tms.available
        n = 3 * (1 << 20) + 12345
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, kv = cuda_malloc(n)
        with tms.region(tag="w"):
            rc2, w = cuda_malloc(n)
        assert rc == 0 and rc2 == 0, (rc, rc2)
        data = os.urandom(n)
        ctypes.memmove(kv, data, n)
        ctypes.memmove(w, data, n)
        tms.pause("kv")
        s = tag_stats("kv")
        assert s["paused_allocations"] == 1 and s["bytes_paused"] == 4 << 20 and s["host_backup_bytes"] == n, s
        # Without retention a pinned backup is never page-locked (it is released at resume).
        assert s["host_pinned_bytes"] == 0, s
        assert tag_stats("w")["active_allocations"] == 1
        tms.pause()
        tms.pause()  # pausing what is paused does nothing
        tms.resume("w")
        assert tag_stats("kv")["paused_allocations"] == 1
        tms.resume()
        assert ctypes.string_at(kv, n) == data, "backed-up contents kept"
        assert ctypes.string_at(w, n) != data, "no backup: fresh memory"
        assert tag_stats("kv")["host_backup_bytes"] == 0, "released after a non-retaining resume"
        last = tag_stats("kv")["last_resume"]
        assert 0 <= last["release_seconds"] <= last["seconds"], last
        assert cuda_free(kv) == 0 and cuda_free(w) == 0
        assert tms.stats()["tags"][0]["allocations"] == 0
        print("ok")
        """
    )
    assert r.stdout.strip() == "ok"


def test_a_leased_backup_outlives_the_resume_and_the_next_pause(preloaded):
    r = preloaded(
        """
        n = 2 * (1 << 20) + 777
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, kv = cuda_malloc(n)
        lib = tms._impl._binary_wrapper
        first, second = os.urandom(n), os.urandom(n)
        ctypes.memmove(kv, first, n)
        out, lease = ctypes.c_void_p(0), ctypes.c_uint64(0)
        assert lib.tms_acquire_cpu_backup(kv, n, ctypes.byref(out), ctypes.byref(lease)) == 0
        assert out.value is None and lease.value == 0, "active and never paused: no snapshot"
        tms.pause("kv")
        assert lib.tms_acquire_cpu_backup(kv, n, ctypes.byref(out), ctypes.byref(lease)) == 0
        assert out.value and lease.value
        tms.resume("kv")  # no retention: the library lets go of the backup, the lease keeps it
        assert ctypes.string_at(out.value, n) == first
        ctypes.memmove(kv, second, n)
        tms.pause("kv")
        assert ctypes.string_at(out.value, n) == first, "the next pause wrote a new buffer"
        found = ctypes.c_int(0)
        buf = ctypes.create_string_buffer(n)
        assert lib.tms_copy_cpu_backup(kv, n, buf, ctypes.byref(found)) == 0 and found.value == 1
        assert buf.raw == second
        assert lib.tms_release_cpu_backup(lease.value) == 0
        assert lib.tms_release_cpu_backup(lease.value) == 5, "not held any more: not found"
        tms.resume("kv")
        assert ctypes.string_at(kv, n) == second and cuda_free(kv) == 0
        print("ok")
        """
    )
    assert r.stdout.strip() == "ok"


def test_outside_a_region_and_inside_disable_nothing_is_pauseable(preloaded):
    preloaded(
        """
        def not_ours(rc, p):
            # Passed through to the CUDA runtime below the library, which answers as it can:
            # where there is none, the library fails it with 3 (cudaErrorInitializationError);
            # torch loads one, which fails it on a machine without a GPU (35, no driver) and
            # serves it on one with a GPU. The simulated device would have served it (0 and a
            # pointer of its own), so a failure, or a pointer the library does not know, shows
            # it passed through; and the library recorded no allocation.
            if not any(t["allocations"] for t in tms.stats()["tags"]):
                if rc != 0:
                    return not p
                out = ctypes.c_void_p(0)
                return tms._impl._binary_wrapper.tms_get_cpu_backup(p, 1, ctypes.byref(out)) == 5
            return False
        assert not_ours(*cuda_malloc(1 << 20))
        with tms.region(tag="kv"):
            with tms.disable():
                assert not_ours(*cuda_malloc(1 << 20))
            rc, p = cuda_malloc(1 << 20)
            assert rc == 0
        assert tag_stats("kv")["allocations"] == 1
        assert cuda_free(p) == 0
        """
    )


def test_out_of_memory_on_resume_raises_and_retry_works(preloaded):
    r = preloaded(
        """
        n = 64 << 20
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, kv = cuda_malloc(n)
        data = os.urandom(n)
        ctypes.memmove(kv, data, n)
        tms.pause("kv")
        with tms.region(tag="hog"):
            rc, hog = cuda_malloc(224 << 20)
        assert rc == 0
        try:
            tms.resume("kv")
            raise SystemExit("resume should have failed")
        except tms_pkg.OutOfMemoryError as e:
            assert isinstance(e, tms_pkg.TorchMemorySaverError) and e.status == 1
            print("MSG", e)
        s = tag_stats("kv")
        assert s["paused_allocations"] == 1 and s["host_backup_bytes"] == n, s
        assert cuda_free(hog) == 0
        tms.resume("kv")
        assert ctypes.string_at(kv, n) == data
        """
    )
    msg = r.stdout
    assert "device 0" in msg and "CUDA_ERROR_OUT_OF_MEMORY" in msg and '"kv"' in msg, msg


def test_cuda_malloc_out_of_memory_is_cuda_status_2(preloaded):
    preloaded(
        """
        with tms.region(tag="big"):
            rc, _ = cuda_malloc(512 << 20)
        assert rc == 2, rc
        """
    )


def test_driver_failure_raises_driver_error_and_state_stays_true(preloaded):
    r = preloaded(
        """
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, kv = cuda_malloc(4 << 20)
        ctypes.memmove(kv, b"x" * 100, 100)
        tms.pause("kv")
        try:
            tms.resume("kv")   # the 2nd cuMemMap call of the process fails
            raise SystemExit("resume should have failed")
        except tms_pkg.DriverError as e:
            print("MSG", e)
        assert tag_stats("kv")["paused_allocations"] == 1
        tms.resume("kv")
        assert ctypes.string_at(kv, 100) == b"x" * 100
        """,
        TMS_SIM_FAULTS="map:2",
    )
    assert "cuMemMap" in r.stdout and "injected" in r.stdout, r.stdout


@pytest.mark.parametrize(
    "call, exc, words",
    [
        ("tms.region(cpu_backup_backend='floppy')", ValueError, "floppy"),
        ("tms.region(enable_cpu_backup=True, cpu_backup_backend='floppy')", ValueError, "cpu_backup_backend"),
        ("tms.region(cpu_backup_backend='mmap')", ValueError, "enable_cpu_backup=True"),
        ("tms.region(tag=5)", TypeError, "tag must be a str"),
        ("tms.region(tag='')", ValueError, "empty"),
        ("tms.region(tag=None)", TypeError, "tag must be a str"),
        ("tms.pause(tag=3)", TypeError, "tag must be a str or None"),
        ("tms.resume(tag=b'kv')", TypeError, "tag must be a str or None"),
    ],
)
def test_bad_arguments_are_clear_errors(call, exc, words):
    with pytest.raises(exc, match=words):
        obj = eval(call)  # region() raises on entry
        obj.__enter__()


def test_bad_settings_are_clear_errors():
    t = tms_pkg.TorchMemorySaver()
    # An unknown hook mode is kept until first use (integrations store modes of their own for
    # their patched _ensure_initialized), then refused by name.
    t.hook_mode = "gpu"
    assert t._impl_ctor_kwargs == {"hook_mode": "gpu"}
    with pytest.raises(ValueError, match="hook_mode must be one of .*'gpu'"):
        t.pause()
    t = tms_pkg.TorchMemorySaver()
    with pytest.raises(TypeError):
        t.memory_margin_bytes = "1G"
    with pytest.raises(ValueError, match=r"from 0 to 2\*\*64 - 1"):
        t.memory_margin_bytes = -1


def test_hook_mode_is_fixed_after_first_use(preloaded):
    preloaded(
        """
        tms.pause()
        try:
            tms.hook_mode = "torch"
            raise SystemExit("should refuse")
        except tms_pkg.InvalidStateError as e:
            assert "before the first" in str(e)
        tms.hook_mode = "preload"  # unchanged: fine
        """
    )


def test_environment_sets_defaults(preloaded):
    preloaded(
        """
        assert tms.retain_cpu_backup is True
        assert tms.memory_margin_bytes == 3 << 20
        lib = tms._impl._binary_wrapper
        with tms.region(tag="kv", enable_cpu_backup=True):
            cur = json.loads(lib.call_string(lib.tms_region_current))
            assert cur["backend"] == "mmap" and cur["cpu_backup"] and cur["tag"] == "kv", cur
            with tms.region(tag="kv2", enable_cpu_backup=True, cpu_backup_backend="pinned"):
                cur = json.loads(lib.call_string(lib.tms_region_current))
                assert cur["backend"] == "pinned" and cur["depth"] == 2, cur
        """,
        TMS_INIT_CPU_BACKUP_BACKEND="mmap",
        TMS_RETAIN_CPU_BACKUP="1",
        TMS_MEMORY_MARGIN_BYTES="3MiB",
    )


def test_init_enable_makes_everything_pauseable(preloaded):
    preloaded(
        """
        rc, p = cuda_malloc(1 << 20)
        assert rc == 0
        s = tag_stats("default")
        assert s["allocations"] == 1
        tms.pause("default")
        tms.resume("default")
        """,
        TMS_INIT_ENABLE="1",
    )


@pytest.mark.parametrize(
    "var, value", [("TMS_INIT_CPU_BACKUP_BACKEND", "floppy"), ("TMS_INIT_ENABLE", "maybe"), ("TMS_BACKEND", "gpu")]
)
def test_malformed_environment_raises_naming_the_variable(preloaded, var, value):
    r = preloaded(
        """
        try:
            tms.pause()
            raise SystemExit("should fail")
        except tms_pkg.InvalidArgumentError as e:
            print("MSG", e)
        """,
        **{var: value},
    )
    assert var in r.stdout and value in r.stdout, r.stdout


def test_retention_keeps_host_backup_across_resume(preloaded):
    preloaded(
        """
        tms.retain_cpu_backup = True
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, kv = cuda_malloc(2 << 20)
        tms.pause("kv"); tms.resume("kv")
        assert tag_stats("kv")["host_backup_bytes"] == 2 << 20
        tms.retain_cpu_backup = False
        assert tag_stats("kv")["host_backup_bytes"] == 2 << 20, "setting False frees nothing eagerly"
        tms.pause("kv"); tms.resume("kv")
        assert tag_stats("kv")["host_backup_bytes"] == 0
        """
    )


def test_memory_margin_refuses_allocations(preloaded):
    preloaded(
        """
        tms.memory_margin_bytes = 200 << 20
        with tms.region(tag="kv"):
            rc, _ = cuda_malloc(32 << 20)
            assert rc == 0
            rc, _ = cuda_malloc(32 << 20)
            assert rc == 2, rc
        tms.memory_margin_bytes = 0
        """
    )


def test_expandable_segments_refused_in_preload_mode(preloaded):
    r = preloaded(
        """
        try:
            tms.pause()
            raise SystemExit("should refuse")
        except tms_pkg.UnsupportedError as e:
            print("MSG", e)
        """,
        PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64,expandable_segments:True",
    )
    assert "PYTORCH_CUDA_ALLOC_CONF" in r.stdout and "expandable_segments" in r.stdout


def test_torch_mode_pause_resume_stats_without_torch(libtms):
    r = run_py(
        """
        tms.hook_mode = "torch"
        tms.pause(); tms.resume()
        assert "torch" not in sys.modules
        print(tms.stats()["backend"])
        """,
        clean_env(TMS_BACKEND="sim", TMS_LIBRARY_PATH=libtms),
    )
    assert r.stdout.strip() == "sim"


def test_stats_and_summary(preloaded):
    r = preloaded(
        """
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, kv = cuda_malloc(5 << 20)
        tms.pause("kv")
        s = tms.stats()
        assert s["backend"] == "sim"
        t = tag_stats("kv")
        assert t["last_pause"]["bytes"] == 6 << 20 and t["last_pause"]["copied_bytes"] == 5 << 20, t
        assert t["last_resume"] is None
        print(tms.summary())
        """
    )
    assert "kv" in r.stdout and "tag" in r.stdout and "last pause" in r.stdout


def test_stats_that_keep_growing_between_the_calls_are_refused_after_a_few_tries(preloaded):
    # Before each call another tag appears, its name as long as the room the call has:
    # each answer outgrows the room the one before made for it (with its spare room). stats()
    # gives up after its tries, saying why, instead of asking again for as long as it grows.
    r = preloaded(
        """
        assert tms.stats()["tags"] == []
        lib = tms._impl._library()
        real = lib.tms_stats_json
        rooms = []
        def a_new_tag_at_each_call(buf, cap, need):
            rooms.append(cap)
            if len(rooms) > 12:
                raise SystemExit(f"still asking after {len(rooms)} calls: {rooms}")
            with tms.region(tag=f"t{len(rooms)}-" + "x" * cap):
                rc, p = cuda_malloc(1 << 20)
            assert rc == 0, rc
            return real(buf, cap, need)
        lib.tms_stats_json = a_new_tag_at_each_call
        try:
            tms.stats()
            raise SystemExit("should give up")
        except tms_pkg.InvalidStateError as e:
            print("REFUSED", e)
        lib.tms_stats_json = real
        assert len(rooms) == 8 and rooms == sorted(set(rooms)), rooms
        assert len(tms.stats()["tags"]) == 8, "the stats as they are, once they hold still"
        print("ok")
        """
    )
    assert "REFUSED a_new_tag_at_each_call: its answer was larger at each of 8 tries" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("ok"), r.stdout


def test_logging_reports_pause_and_resume(preloaded):
    r = preloaded(
        """
        import logging
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
        tms.pause("kv"); tms.resume("kv")
        """
    )
    assert "torch_memory_saver paused tag 'kv'" in r.stdout
    assert "torch_memory_saver resumed tag 'kv'" in r.stdout


def test_fork_child_raises_invalid_state(preloaded):
    preloaded(
        """
        with tms.region(tag="kv"):
            rc, p = cuda_malloc(1 << 20)
        pid = os.fork()
        if pid == 0:
            try:
                tms.pause()
                os._exit(3)
            except tms_pkg.InvalidStateError as e:
                os._exit(0 if "forked" in str(e) else 4)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0, status
        tms.pause(); tms.resume()
        """
    )


def test_configure_subprocess_puts_libtms_first_and_restores(monkeypatch, libtms):
    from torch_memory_saver.hooks.mode_preload import preload_library_path

    lib = preload_library_path()  # installed: the upstream name (for the CUDA major); a checkout: libtms.so
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with tms_pkg.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == lib
        out = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ['LD_PRELOAD'])"],
            capture_output=True,
            text=True,
            env=clean_env(LD_PRELOAD=os.environ["LD_PRELOAD"]),
        ).stdout.strip()
        assert out == lib
    assert "LD_PRELOAD" not in os.environ

    # Another copy of the library (libtms.so) is dropped: a child holds one.
    monkeypatch.setenv("LD_PRELOAD", f"/other/lib.so:{libtms}")
    with tms_pkg.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == f"{lib}:/other/lib.so"
    assert os.environ["LD_PRELOAD"] == f"/other/lib.so:{libtms}"

    with pytest.raises(RuntimeError):
        with tms_pkg.configure_subprocess():
            raise RuntimeError("boom")
    assert os.environ["LD_PRELOAD"] == f"/other/lib.so:{libtms}"


def test_a_child_started_inside_configure_subprocess_is_preloaded(libtms):
    code = (
        "import torch_memory_saver as t, ctypes\n"
        "with t.configure_subprocess():\n"
        "    import subprocess, sys\n"
        "    r = subprocess.run([sys.executable, '-c', 'from torch_memory_saver import torch_memory_saver as x; print(x.available)'], capture_output=True, text=True)\n"
        "print(r.stdout.strip())\n"
    )
    r = run_py(code, clean_env())
    assert r.stdout.strip().splitlines()[-1] == "True", r.stdout


def test_error_classes_map_status_codes():
    from torch_memory_saver.errors import error_for_status

    assert isinstance(error_for_status(1, "m"), tms_pkg.OutOfMemoryError)
    assert isinstance(error_for_status(2, "m"), tms_pkg.DriverError)
    assert isinstance(error_for_status(3, "m"), ValueError)
    assert isinstance(error_for_status(5, "m"), LookupError)
    e = error_for_status(77, "")
    assert type(e) is tms_pkg.TorchMemorySaverError and "77" in str(e)
    assert issubclass(tms_pkg.OutOfMemoryError, tms_pkg.TorchMemorySaverError)


EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


@pytest.mark.parametrize("example", ["simple.py", "multi_tags.py", "cuda_graph.py", "cpu_backup.py", "rl_example.py"])
def test_examples_without_torch_explain_themselves(tmp_path, example):
    # A torch that cannot be imported, whatever this machine has.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError(\"No module named 'torch'\")\n")
    env = clean_env(PYTHONPATH=str(tmp_path))
    script = os.path.join(EXAMPLES_DIR, example)
    h = subprocess.run([sys.executable, script, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert h.returncode == 0 and "usage: python examples/" in h.stdout and "--hook-mode" in h.stdout, h
    assert "Traceback" not in h.stderr, h.stderr
    r = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r
    assert r.stderr.strip().splitlines() == [
        f"{example} needs PyTorch with CUDA (torch.cuda.MemPool; tested with 2.11) and a CUDA GPU: No module named 'torch'"
    ], r.stderr


def test_nonblocking_resume_returns_mapped_and_wait_sees_the_data(preloaded):
    r = preloaded(
        """
        import time
        n = 8 << 20
        bufs = []
        with tms.region(tag="kv", enable_cpu_backup=True):
            for i in range(4):
                rc, p = cuda_malloc(n)
                assert rc == 0
                data = bytes([i + 1]) * n
                ctypes.memmove(p, data, n)
                bufs.append((p, data))
        tms.pause("kv")
        t0 = time.perf_counter()
        # No torch here: no stream is made to wait; the host waits with wait().
        tms.resume("kv", non_blocking=True, order=[bufs[2][0]])
        returned = time.perf_counter() - t0
        # A timeout beyond 64 bits of milliseconds is no limit (it used to wrap to none at all).
        assert tms.wait(bufs[2][0], timeout=1e300) is True
        assert ctypes.string_at(bufs[2][0], n) == bufs[2][1]
        assert tms.wait() is True
        waited = time.perf_counter() - t0
        for p, data in bufs:
            assert ctypes.string_at(p, n) == data
        assert tag_stats("kv")["active_allocations"] == 4
        print("TIMES", returned, waited)
        assert tms.wait(timeout=0) is True, "nothing in flight"
        assert tms.wait(timeout=float("inf")) is True
        """,
        # 32 MiB over a 64 MiB/s link: half a second of copies to overlap.
        TMS_SIM_BANDWIDTH="64MiB",
    )
    returned, waited = map(float, r.stdout.split("TIMES")[1].split())
    assert returned < waited, r.stdout


def test_nonblocking_resume_failure_after_return_is_raised_by_every_wait_and_loses_nothing(preloaded):
    r = preloaded(
        """
        n = 8 << 20
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
            rc2, q = cuda_malloc(n)
        data = os.urandom(n)
        ctypes.memmove(p, data, n)
        ctypes.memmove(q, data, n)
        tms.pause("kv")
        tms.resume("kv", non_blocking=True)
        try:
            tms.wait()
            raise SystemExit("wait should have raised")
        except tms_pkg.DriverError as e:
            print("MSG", e)
        s = tag_stats("kv")
        # The failed allocation is left unrestored (held, neither active nor paused); one whose
        # copies completed before the failure stopped the restore landed and stays restored.
        landed, failed = s["active_allocations"], s["paused_allocations"]
        assert failed >= 1 and landed + failed == 2, s
        assert s["bytes_active"] == landed * n and s["bytes_unrestored"] == failed * n, s
        assert s["bytes_paused"] == 0, s
        assert "failed after it returned" in s["failed_restore"], s
        for x in (p, q):
            try:
                assert tms.wait(x) is True and ctypes.string_at(x, n) == data
                landed -= 1
            except tms_pkg.DriverError:
                failed -= 1
        assert (landed, failed) == (0, 0), "each wait answers for its own allocation"
        try:
            tms.wait()  # every time, until the tag is paused or resumed
            raise SystemExit("wait should raise again")
        except tms_pkg.DriverError:
            pass
        tms.resume("kv")
        assert ctypes.string_at(p, n) == data and ctypes.string_at(q, n) == data
        assert tms.wait() is True and tag_stats("kv")["failed_restore"] is None
        """,
        # Both allocations are mapped while the first copy crosses the slow link; the second
        # copy to the device (the second allocation's) fails.
        TMS_SIM_FAULTS="copy_h2d:2",
        TMS_SIM_BANDWIDTH="64MiB",
    )
    assert "failed after it returned" in r.stdout and "cuMemcpyHtoDAsync" in r.stdout, r.stdout


@pytest.mark.parametrize(
    "call, exc, words",
    [
        ("tms.resume('kv', non_blocking=True, restore_chunk_state=True)", ValueError, "restore_chunk_state"),
        ("tms.resume('kv', non_blocking=True, progress=print)", ValueError, "wait"),
        ("tms.resume('kv', order=[])", ValueError, "non_blocking=True"),
        ("tms.resume('kv', non_blocking=True, order='kv')", TypeError, "iterable of tensors"),
        ("tms.resume('kv', non_blocking=True, order=[-1])", ValueError, "out of range"),
        ("tms.wait(timeout=-1)", ValueError, "timeout"),
        ("tms.wait(stream=True, timeout=1)", ValueError, "timeout"),
        ("tms.wait(stream=object())", TypeError, "torch.cuda.Stream"),
        ("tms.wait('kv')", TypeError, "expected a torch.Tensor or a device address (int), not str"),
        ("tms.pause('\\udcff')", ValueError, "UTF-8"),
        ("tms.region(tag='\\udcff').__enter__()", ValueError, "UTF-8"),
    ],
)
def test_nonblocking_bad_arguments_are_clear_errors(preloaded, call, exc, words):
    preloaded(
        f"""
        try:
            {call}
            raise SystemExit("should have raised")
        except {exc.__name__} as e:
            assert {words!r} in str(e), e
        """
    )


def test_a_child_forked_during_the_first_use_passes_through_and_never_hangs(preloaded):
    # A fork while another thread was inside the library's first use (its one-time read of the
    # settings, made long here by many variables of another tool) copied that read's lock
    # half-taken: the child's first cudaMalloc waited for it for ever. The child now leaves
    # everything to the runtime below, as every child of a used library does.
    many = {f"TMS_UNRELATED_VARIABLE_OF_SOME_OTHER_TOOL_{i}": "1" for i in range(20000)}
    r = preloaded(
        """
        import signal, threading, time
        t = threading.Thread(target=lambda: cuda_malloc(1 << 20))
        t.start()
        time.sleep(0.005)
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)
            cuda_malloc(1 << 20)
            os._exit(0)
        t.join()
        _, status = os.waitpid(pid, 0)
        print("STATUS", status, os.WIFSIGNALED(status))
        """,
        **many,
    )
    assert "STATUS 0 False" in r.stdout, r.stdout


def test_a_relative_socket_folder_and_a_later_chdir_still_lose_the_socket_at_exit(preloaded, tmp_path):
    # The socket was recorded for removal by its relative path: after a chdir, the removal at
    # exit went to another folder and the socket stayed.
    base = tmp_path / "work"
    base.mkdir()
    preloaded(
        f"""
        os.chdir({str(base)!r})
        with tms.region(tag="kv"):
            rc, p = cuda_malloc(1 << 20)
        assert rc == 0
        tms.pause("kv")
        assert [n for n in os.listdir("sockrel") if n.endswith(".sock")], os.listdir("sockrel")
        os.chdir("/")
        """,
        TMS_SOCKET_DIR="sockrel",
    )
    left = [n for n in os.listdir(base / "sockrel") if n.endswith(".sock")]
    assert left == [], left


def test_a_wait_for_an_empty_tensor_waits_for_nothing(preloaded):
    # An empty tensor (data_ptr() 0) lies in no allocation: its wait has nothing to wait for.
    # It was passed on as address 0, "every allocation", so it waited for every restore and
    # raised the failure another allocation's restore left.
    preloaded(
        """
        n = 8 << 20
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
            rc2, q = cuda_malloc(n)
        tms.pause("kv")
        tms.resume("kv", non_blocking=True)

        class Empty:
            def data_ptr(self):
                return 0

        assert tms.wait(Empty()) is True
        assert tms.wait(Empty(), timeout=0) is True
        try:
            tms.wait()
            raise SystemExit("wait should have raised")
        except tms_pkg.DriverError:
            pass
        assert tms.wait(Empty()) is True, "another allocation's failure is not the empty tensor's"
        tms.resume("kv")
        """,
        TMS_SIM_FAULTS="copy_h2d:2",
        TMS_SIM_BANDWIDTH="64MiB",
    )


def test_a_child_is_preloaded_where_the_librarys_path_holds_a_space(libtms, tmp_path):
    # The loader splits LD_PRELOAD at spaces and colons, with no way to escape them: a library
    # under "/home/me/my envs/..." was preloaded by no child (the loader said so on the child's
    # stderr and went on without it).
    folder = tmp_path / "my libs"
    folder.mkdir()
    shutil.copy(libtms, folder / "libtms.so")
    code = (
        "import torch_memory_saver as t, os, subprocess, sys\n"
        "with t.configure_subprocess():\n"
        "    r = subprocess.run([sys.executable, '-c', 'from torch_memory_saver import torch_memory_saver as x; "
        "from torch_memory_saver import binary_wrapper as b; print(x.available, b.preloaded_path())'], "
        "capture_output=True, text=True)\n"
        "print(r.stdout.strip())\n"
        "print(repr(r.stderr))\n"
        "print(os.environ.get('LD_PRELOAD'), os.environ.get('LD_LIBRARY_PATH'))\n"
    )
    r = run_py(code, clean_env(TMS_LIBRARY_PATH=str(folder / "libtms.so"), LD_LIBRARY_PATH="/keep/this"))
    child, err, restored = r.stdout.strip().splitlines()[-3:]
    assert child == f"True {folder / 'libtms.so'}", (child, err)
    assert "ld.so" not in err, err
    assert restored == "None /keep/this", restored
    # A folder LD_LIBRARY_PATH cannot hold either is refused, saying why.
    from torch_memory_saver.hooks import mode_preload

    with pytest.raises(tms_pkg.UnsupportedError, match="splits LD_PRELOAD at spaces and colons"):
        mode_preload._preload_entry("/opt/a:b/libtms.so")
