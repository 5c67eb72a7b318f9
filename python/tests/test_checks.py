"""Skipping unchanged memory and verified resumes through the Python API (set_checks,
get_checks, resume(verify=True)), on the simulated device in a preloaded subprocess, and
tmsctl resume --verify."""

from __future__ import annotations

MIB = 1 << 20


def test_checks_are_set_per_tag_and_refuse_bad_values(preloaded):
    r = preloaded(
        """
        assert tms.get_checks() == {"skip_unchanged": False, "verify": False}
        tms.set_checks(skip_unchanged=True)
        tms.set_checks("kv", verify=True)
        assert tms.get_checks() == {"skip_unchanged": True, "verify": False}
        # A tag of its own starts from the default it had then, and keeps what is not given.
        assert tms.get_checks("kv") == {"skip_unchanged": True, "verify": True}
        tms.set_checks(skip_unchanged=False)
        assert tms.get_checks("kv") == {"skip_unchanged": True, "verify": True}
        assert tms.get_checks("other") == {"skip_unchanged": False, "verify": False}
        for bad in (dict(verify=1), dict(skip_unchanged="yes")):
            try:
                tms.set_checks("kv", **bad)
            except tms_pkg.InvalidArgumentError as e:
                print("refused", e)
        try:
            tms.resume("kv", verify=True, non_blocking=True)
        except tms_pkg.InvalidArgumentError as e:
            print("refused", e)
        for bad in ("yes", 1, 0):
            try:
                tms.resume("kv", verify=bad)
            except tms_pkg.InvalidArgumentError as e:
                print("refused", e)
        for bad in ("x", True):
            try:
                tms.wait(timeout=bad)
            except tms_pkg.InvalidArgumentError as e:
                print("refused", e)
        print("ok")
        """
    )
    out = r.stdout.splitlines()
    assert out[-1] == "ok", r.stdout
    assert sum(line.startswith("refused") for line in out) == 8, r.stdout
    assert "verify must be True or False, not 'yes'" in r.stdout
    assert "verify must be True or False, not 0" in r.stdout
    assert "timeout must be a number of seconds >= 0, not 'x'" in r.stdout
    assert "timeout must be a number of seconds >= 0, not True" in r.stdout
    assert "verify must be True, False or None, not 1" in r.stdout
    assert "not with non_blocking" in r.stdout


def test_two_threads_setting_one_check_each_keep_both(preloaded):
    # set_checks() keeps what is not given by reading it first: two threads setting one check
    # each on the same tag must not each write back the other's old value. The read is held
    # until both have read (or a second has passed, where a lock keeps the second out).
    r = preloaded(
        """
        import threading
        tms._ensure_initialized()
        impl = tms._impl
        real = impl.get_checks
        both_read = threading.Barrier(2)

        def get_checks(tag=None):
            now = real(tag)
            try:
                both_read.wait(timeout=1)
            except threading.BrokenBarrierError:
                pass
            return now

        impl.get_checks = get_checks
        threads = [threading.Thread(target=tms.set_checks, args=("kv",), kwargs=kw)
                   for kw in (dict(skip_unchanged=True), dict(verify=True))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(real("kv"))
        """
    )
    assert r.stdout.strip() == "{'skip_unchanged': True, 'verify': True}", r.stdout


def test_unchanged_memory_is_not_copied_and_a_bad_backup_is_caught(preloaded):
    r = preloaded(
        """
        n = 8 * (1 << 20)
        tms.retain_cpu_backup = True
        tms.set_checks("frozen", skip_unchanged=True, verify=True)
        with tms.region(tag="frozen", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0
        data = bytearray(os.urandom(n))
        ctypes.memmove(p, bytes(data), n)
        tms.pause("frozen")
        assert tag_stats("frozen")["last_pause"]["copied_bytes"] == n
        tms.resume("frozen")
        assert tag_stats("frozen")["last_resume"]["verified_bytes"] == n
        tms.pause("frozen")
        last = tag_stats("frozen")["last_pause"]
        assert (last["copied_bytes"], last["unchanged_bytes"]) == (0, n), last
        tms.resume("frozen")
        # One byte changed: its piece alone is copied, and comes back.
        # (Flipped, not set: random bytes may hold any given value already.)
        data[5 * (1 << 20) + 7] ^= 0xFF
        ctypes.memmove(p + 5 * (1 << 20) + 7, bytes(data[5 * (1 << 20) + 7 :][:1]), 1)
        tms.pause("frozen")
        last = tag_stats("frozen")["last_pause"]
        assert 0 < last["copied_bytes"] < n and last["copied_bytes"] + last["unchanged_bytes"] == n, last
        # The backup changes while paused (a stray write): the verified resume refuses it.
        lib = tms._impl._binary_wrapper
        ptr = ctypes.c_void_p()
        assert lib.tms_get_cpu_backup(p, n, ctypes.byref(ptr)) == 0 and ptr.value
        ctypes.memmove(ptr.value + 3, bytes([data[3] ^ 0xFF]), 1)
        try:
            tms.resume("frozen")
            print("not refused")
        except tms_pkg.DriverError as e:
            print("refused", e)
        assert tag_stats("frozen")["paused_allocations"] == 1
        ctypes.memmove(ptr.value + 3, bytes(data[3:4]), 1)
        tms.resume("frozen", verify=True)
        assert ctypes.string_at(p, n) == bytes(data)
        assert cuda_free(p) == 0
        print("ok")
        """
    )
    assert r.stdout.strip().endswith("ok"), r.stdout
    assert "refused" in r.stdout and "differ from its backup after the restore" in r.stdout, r.stdout


def test_the_environment_sets_the_default_and_a_bad_value_is_named(preloaded):
    r = preloaded(
        """
        assert tms.get_checks() == {"skip_unchanged": True, "verify": True}
        assert tms.get_checks("any") == {"skip_unchanged": True, "verify": True}
        print("ok")
        """,
        TMS_SKIP_UNCHANGED="1",
        TMS_VERIFY_RESUME="1",
    )
    assert r.stdout.strip() == "ok"
    r = preloaded(
        """
        try:
            tms.get_checks()
            raise SystemExit("should fail")
        except tms_pkg.InvalidArgumentError as e:
            print("MSG", e)
        """,
        TMS_VERIFY_RESUME="sometimes",
    )
    assert "TMS_VERIFY_RESUME" in r.stdout and "sometimes" in r.stdout, r.stdout
