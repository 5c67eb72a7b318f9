"""Disk backups through the Python package on the simulated device (no torch): the contents
round-trip through files in the chosen directory, the files go at exit, the two kinds of backup
exclude each other, a full disk loses nothing, and a folder made late or wiped is found again."""

from __future__ import annotations

import os

import pytest

from conftest import clean_env, run_py


def files(d) -> list:
    return sorted(p.name for p in d.iterdir())


def test_region_with_disk_backup_round_trips_and_files_go_at_exit(preloaded, tmp_path):
    d = tmp_path / "backups"
    d.mkdir()
    r = preloaded(
        f"""
        tms.set_disk_backup_dir({str(d)!r})
        n = 5 * (1 << 20) + 77
        with tms.region(tag="opt", enable_disk_backup=True):
            assert tms._impl._binary_wrapper.tms_get_enable_disk_backup() is True
            rc, p = cuda_malloc(n)
        assert rc == 0
        data = os.urandom(n)
        ctypes.memmove(p, data, n)
        tms.pause("opt")
        s = tag_stats("opt")
        assert s["paused_allocations"] == 1 and s["disk_backup_bytes"] == 6 << 20 and s["host_backup_bytes"] == 0, s
        names = sorted(os.listdir({str(d)!r}))
        assert len(names) == 1 and names[0].startswith("tms-backup-"), names
        assert "disk GiB" in tms.summary()
        for _ in range(3):
            tms.resume("opt")
            assert ctypes.string_at(p, n) == data
            tms.pause("opt")
            assert sorted(os.listdir({str(d)!r})) == names, "the file is reused"
        tms.resume("opt")
        print("ok")
        """
    )
    assert r.stdout.strip() == "ok"
    assert files(d) == [], "the process removed its files at exit"


def test_cpu_and_disk_backup_exclude_each_other(preloaded, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    r = preloaded(
        f"""
        try:
            with tms.region(tag="x", enable_cpu_backup=True, enable_disk_backup=True):
                pass
            raise SystemExit("should raise")
        except tms_pkg.InvalidArgumentError as e:
            assert "enable_cpu_backup" in str(e) and "enable_disk_backup" in str(e), e
        lib = tms._impl._binary_wrapper
        with tms.region(tag="y", enable_cpu_backup=True):
            assert lib.tms_set_enable_disk_backup(1) == 3, "invalid argument"
            assert "mutually exclusive" in lib.last_error(), lib.last_error()
            assert lib.tms_get_enable_disk_backup() is False and lib.tms_get_enable_cpu_backup() is True
        with tms.region(tag="z", enable_disk_backup=True):
            assert lib.tms_set_enable_cpu_backup(1) == 3
        # A folder that cannot be made (a part of its path is a file) is refused at once.
        try:
            tms.set_disk_backup_dir({str(blocked / "backups")!r})
            raise SystemExit("should raise")
        except tms_pkg.InvalidArgumentError as e:
            assert "not-a-folder/backups" in str(e) and "not a directory" in str(e), e
        print("ok")
        """
    )
    assert r.stdout.strip() == "ok"


def test_initial_region_with_disk_backup_from_the_environment(preloaded, tmp_path):
    d = tmp_path / "env-backups"
    d.mkdir()
    r = preloaded(
        """
        n = 3 << 20
        rc, p = cuda_malloc(n)
        data = os.urandom(n)
        ctypes.memmove(p, data, n)
        tms.pause()
        assert len(os.listdir(os.environ["TMS_DISK_BACKUP_DIR"])) == 1
        tms.resume()
        assert ctypes.string_at(p, n) == data
        print("ok")
        """,
        TMS_INIT_ENABLE="1",
        TMS_INIT_ENABLE_DISK_BACKUP="1",
        TMS_DISK_BACKUP_DIR=str(d),
        TMS_DISK_BACKUP_CHUNK_MB="1",
    )
    assert r.stdout.strip() == "ok"
    both = preloaded(
        "rc, p = cuda_malloc(1 << 20); print(tms.stats()['tags'])",
        expect_ok=False,
        TMS_INIT_ENABLE="1",
        TMS_INIT_ENABLE_DISK_BACKUP="1",
        TMS_INIT_ENABLE_CPU_BACKUP="1",
        TMS_LOG="warn",
    )
    # Refused with both names (allocations pass through; the API raises with the reason).
    assert both.returncode != 0 and "InvalidArgumentError" in both.stderr, both.stderr
    assert "TMS_INIT_ENABLE_CPU_BACKUP" in both.stderr and "TMS_INIT_ENABLE_DISK_BACKUP" in both.stderr, both.stderr


def test_a_full_disk_fails_the_pause_and_loses_nothing(preloaded, tmp_path):
    d = tmp_path / "full"
    d.mkdir()
    r = preloaded(
        f"""
        tms.set_disk_backup_dir({str(d)!r})
        n = 6 << 20
        with tms.region(tag="opt", enable_disk_backup=True):
            rc, p = cuda_malloc(n)
        data = os.urandom(n)
        ctypes.memmove(p, data, n)
        try:
            tms.pause("opt")
            raise SystemExit("should raise")
        except tms_pkg.OutOfMemoryError as e:
            assert "full" in str(e) and {str(d)!r} in str(e), e
        assert tag_stats("opt")["active_allocations"] == 1
        assert ctypes.string_at(p, n) == data, "the contents are intact on the device"
        tms.pause("opt")  # the fault fired once: the retry works
        tms.resume("opt")
        assert ctypes.string_at(p, n) == data
        print("ok")
        """,
        TMS_DISK_FAULTS="write:2:ENOSPC",
        TMS_COPY_THREADS="2",
    )
    assert r.stdout.strip() == "ok"


def test_a_pause_failing_part_way_over_several_allocations_loses_nothing(preloaded, tmp_path):
    d = tmp_path / "part"
    d.mkdir()
    r = preloaded(
        f"""
        tms.set_disk_backup_dir({str(d)!r})
        sizes = [12 << 20, 8 << 20, 4 << 20]
        with tms.region(tag="opt", enable_disk_backup=True):
            ps = [cuda_malloc(n)[1] for n in sizes]
        datas = [os.urandom(n) for n in sizes]
        for p, n, data in zip(ps, sizes, datas):
            ctypes.memmove(p, data, n)
        try:
            tms.pause("opt")
            raise SystemExit("should raise")
        except tms_pkg.OutOfMemoryError as e:
            assert "full" in str(e), e
        st = tag_stats("opt")
        assert st["active_allocations"] >= 1 and st["paused_allocations"] + st["active_allocations"] == 3, st
        tms.resume("opt")
        for p, n, data in zip(ps, sizes, datas):
            assert ctypes.string_at(p, n) == data
        tms.pause("opt")
        tms.resume("opt")
        for p, n, data in zip(ps, sizes, datas):
            assert ctypes.string_at(p, n) == data
        print("ok", st["paused_allocations"])
        """,
        TMS_DISK_FAULTS="write:12:ENOSPC",
        TMS_COPY_THREADS="4",
        TMS_STAGING_SLOT="1MiB",
        TMS_DISK_BACKUP_CHUNK_MB="2",
    )
    assert r.stdout.startswith("ok"), r.stdout


def test_files_of_a_killed_process_are_removed_by_the_next_one(preloaded, tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    snippet = f"""
        tms.set_disk_backup_dir({str(d)!r})
        with tms.region(tag="opt", enable_disk_backup=True):
            rc, p = cuda_malloc(4 << 20)
        tms.pause("opt")
        print(sorted(os.listdir({str(d)!r})))
        """
    killed = preloaded(snippet + "os.kill(os.getpid(), 9)\n", expect_ok=False)
    assert killed.returncode == -9, killed
    left = files(d)
    assert len(left) == 1 and left[0].startswith("tms-backup-"), left
    r = preloaded(snippet + "tms.resume('opt')\n")
    mine = eval(r.stdout.strip().splitlines()[-1])
    assert left[0] not in mine and len(mine) == 1, (left, mine)
    assert files(d) == [], "and its own went at exit"


# Issue 35, item 1: a disk-backed allocation made as each hook mode makes it (torch mode without
# torch: the region's flags and the pluggable allocator's malloc, as PyTorch's MemPool calls it).
MODE_ALLOC = """
def disk_alloc(n):
    if tms.hook_mode == "preload":
        with tms.region(tag="opt", enable_disk_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0, rc
        return p
    tms.stats()  # the library loaded
    lib = tms._impl._binary_wrapper.cdll
    lib.tms_torch_malloc.restype = ctypes.c_void_p
    lib.tms_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.tms_set_current_tag(b"opt")
    lib.tms_set_enable_disk_backup(1)
    lib.tms_set_interesting_region(1)
    try:
        p = lib.tms_torch_malloc(n, 0, None)
    finally:
        lib.tms_set_interesting_region(0)
    assert p, tms._impl._binary_wrapper.last_error()
    return p
"""


def _mode_env(libtms: str, tmp_path, mode: str, **extra: str) -> dict:
    env = clean_env(TMS_BACKEND="sim", TMS_SIM_CAPACITY="256MiB", TMS_SOCKET_DIR=str(tmp_path / "sock"), **extra)
    if mode == "preload":
        env["LD_PRELOAD"] = libtms
    else:
        env["TMS_LIBRARY_PATH"] = libtms
    return env


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_a_disk_folder_missing_at_start_wiped_and_made_again_loses_nothing(libtms, tmp_path, mode):
    """miles points TMS_DISK_BACKUP_DIR at a per-rank folder it makes (and wipes) after the
    library started: the folder is made when first needed, found again by its path when
    replaced, and a folder wiped while paused loses nothing (the files are held open)."""
    d = tmp_path / "job" / "rank0"
    code = MODE_ALLOC + f"""
tms.hook_mode = {mode!r}
import shutil, stat
d = {str(d)!r}
n = 3 << 20
p = disk_alloc(n)
assert not os.path.exists(d), "made only when needed"
data = os.urandom(n)
ctypes.memmove(p, data, n)
tms.pause("opt")
assert len(os.listdir(d)) == 1 and stat.S_IMODE(os.stat(d).st_mode) == 0o700
tms.resume("opt")
shutil.rmtree(d); os.makedirs(d)          # wiped and made again between two pauses
tms.pause("opt")
assert len(os.listdir(d)) == 1, os.listdir(d)
shutil.rmtree(d)                           # wiped while paused, not made again
tms.resume("opt")
assert ctypes.string_at(p, n) == data, "restored from the file the process holds"
tms.pause("opt")
assert len(os.listdir(d)) == 1, "the folder made again"
tms.resume("opt")
assert ctypes.string_at(p, n) == data
made = {str(tmp_path / "set" / "here")!r}
tms.set_disk_backup_dir(made)
assert os.path.isdir(made), "set_disk_backup_dir makes its folder"
print("ok")
"""
    r = run_py(code, _mode_env(libtms, tmp_path, mode, TMS_DISK_BACKUP_DIR=str(d)))
    assert r.stdout.strip() == "ok"
    assert not os.listdir(d), "the files went at exit"
