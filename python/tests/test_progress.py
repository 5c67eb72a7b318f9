"""Progress of long pauses and resumes through the Python package, on a slow simulated device
(preloaded, no torch): the callback sees the bytes move while the C call runs, in the phase of
what happens, then "done"; long operations are logged; the C query reports nothing when nothing
runs; the positional arguments of before still work."""

from __future__ import annotations

import textwrap

# 16 MiB over a 4 MiB/s link in pieces of 256 KiB: 4 s each way, progress many times a second.
SLOW = {"TMS_SIM_BANDWIDTH": "4MiB", "TMS_STAGING_SLOT": "256KiB"}

WATCH = """
import logging, threading
records = []
class Keep(logging.Handler):
    def emit(self, r):
        records.append(r.getMessage())
log = logging.getLogger("torch_memory_saver")
log.addHandler(Keep())
log.setLevel(logging.INFO)
calls = []
main = threading.get_ident()
def progress(done, total, phase):
    # From a helper thread while the C call runs; the last one ("done") from the caller.
    assert (threading.get_ident() == main) == (phase == "done"), phase
    calls.append((done, total, phase))
def moving(phase):
    return [c for c in calls if c[2] == phase and 0 < c[0] < c[1]]
"""


def test_a_long_pause_to_disk_and_its_resume_report_progress(preloaded, tmp_path):
    d = tmp_path / "backups"
    d.mkdir()
    r = preloaded(
        WATCH
        + textwrap.dedent(
            f"""
        tms.set_disk_backup_dir({str(d)!r})
        n = 16 << 20
        with tms.region(tag="opt", enable_disk_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0
        data = os.urandom(n)
        ctypes.memmove(p, data, n)
        lib = tms._impl._binary_wrapper
        assert lib.progress() is None, "nothing runs"
        tms.pause("opt", progress=progress)
        mid = moving("writing_to_disk")
        assert len(mid) >= 3, calls
        assert all(c[1] == n for c in mid), calls
        assert [c[0] for c in calls] == sorted(c[0] for c in calls), "the bytes only go up"
        assert calls[-1] == (n, n, "done"), calls
        assert any("pause of tag 'opt'" in m and "written to disk" in m for m in records), records
        assert lib.progress() is None
        calls.clear()
        tms.resume("opt", progress=progress)
        assert len(moving("reading_from_disk")) >= 3, calls
        assert calls[-1] == (n, n, "done"), calls
        assert ctypes.string_at(p, n) == data
        print("ok")
        """
        ),
        **SLOW,
    )
    assert r.stdout.strip() == "ok", r.stderr


def test_host_backups_and_a_callback_that_raises(preloaded):
    r = preloaded(
        WATCH
        + textwrap.dedent(
            """
        n = 16 << 20
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0
        ctypes.memset(p, 7, n)
        # Positional arguments as before, and the keyword on the facade.
        tms.pause("kv", False, progress=progress)
        assert len(moving("copying_to_host")) >= 3, calls
        calls.clear()
        def broken(done, total, phase):
            calls.append(phase)
            raise RuntimeError("boom")
        tms.resume("kv", progress=broken)
        assert calls == [calls[0]], "called once, then left alone: " + repr(calls)
        assert any("progress callback" in m for m in records), records
        assert ctypes.string_at(p, 16) == b"\\x07" * 16
        try:
            tms.pause("kv", progress=42)
            raise SystemExit("should raise")
        except TypeError as e:
            assert "callable" in str(e), e
        print("ok")
        """
        ),
        **SLOW,
    )
    assert r.stdout.strip() == "ok", r.stderr


def test_a_short_pause_reports_its_true_totals(preloaded):
    # Issue 36, item 5: a pause too short for the helper thread to see used to end with
    # (0, 0, "done"): the last call carries what it copied.
    r = preloaded(
        """
        n = 3 << 20
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0
        calls = []
        tms.pause("kv", progress=lambda *a: calls.append(a))
        assert calls == [(n, n, "done")], calls
        calls.clear()
        tms.resume("kv", progress=lambda *a: calls.append(a))
        assert calls == [(n, n, "done")], calls
        with tms.region(tag="plain"):
            rc, q = cuda_malloc(n)
        calls.clear()
        tms.pause("plain", progress=lambda *a: calls.append(a))
        assert calls == [(0, 0, "done")], "nothing to copy: " + repr(calls)
        print("ok")
        """
    )
    assert r.stdout.strip() == "ok", r.stderr


def test_what_a_callback_may_do(preloaded):
    # Issue 36, item 5: a callback that blocks does not hold the pause open (its "done" comes
    # after, from the helper thread); SystemExit or KeyboardInterrupt from a callback never
    # escapes a pause that succeeded.
    r = preloaded(
        textwrap.dedent(
            """
        import threading, time
        n = 16 << 20
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0
        ctypes.memset(p, 5, n)
        release = threading.Event()
        calls = []
        def blocking(done, total, phase):
            calls.append((phase, threading.get_ident()))
            if phase != "done":
                release.wait(30)
        t0 = time.monotonic()
        tms.pause("kv", progress=blocking)
        took = time.monotonic() - t0
        assert took < 8, f"the pause waited for the callback: {took:.1f} s"
        assert tag_stats("kv")["paused_allocations"] == 1
        assert [c[0] for c in calls] != [] and calls[-1][0] != "done", calls
        release.set()
        deadline = time.monotonic() + 10
        while not calls or calls[-1][0] != "done":
            assert time.monotonic() < deadline, calls
            time.sleep(0.01)
        assert calls[-1][1] != threading.get_ident(), "done came from the helper thread"
        for exc in (SystemExit, KeyboardInterrupt):
            def raising(done, total, phase, exc=exc):
                raise exc("from a callback")
            tms.resume("kv", progress=raising)
            tms.pause("kv", progress=raising)
        tms.resume("kv")
        assert ctypes.string_at(p, 16) == b"\\x05" * 16
        print("ok")
        """
        ),
        **SLOW,
    )
    assert r.stdout.strip() == "ok", r.stderr


def test_a_pause_that_skips_unchanged_memory_counts_only_what_it_copies(preloaded):
    # 8 MiB retained, skip-unchanged on, 2 pieces changed: the progress goes up to the bytes
    # the pause copies, never to the 8 MiB it digests.
    r = preloaded(
        WATCH
        + textwrap.dedent(
            """
        n = 8 << 20
        tms.retain_cpu_backup = True
        tms.set_checks("w", skip_unchanged=True)
        with tms.region(tag="w", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0
        ctypes.memmove(p, bytes(n), n)
        tms.pause("w")
        tms.resume("w")
        for k in range(2):
            ctypes.memmove(p + k * (4 << 20), b"x", 1)
        tms.pause("w", progress=progress)
        copied = tag_stats("w")["last_pause"]["copied_bytes"]
        assert 0 < copied < n, copied
        assert moving("copying_to_host"), calls
        assert all(c[1] == copied for c in calls), (copied, calls)
        assert calls[-1] == (copied, copied, "done"), calls
        tms.resume("w")
        print("OK")
        """
        ),
        # The 4 MiB it copies over one worker at 2 MiB/s: two seconds of copying for the
        # half-second polls to see under way, also on a loaded machine (with several workers
        # sharing a faster link, it was once seen only before and after).
        **{**SLOW, "TMS_SIM_BANDWIDTH": "2MiB", "TMS_COPY_THREADS": "1"},
    )
    assert r.stdout.strip().endswith("OK"), r.stdout


def test_an_interrupt_in_the_watchs_exit_stops_its_helper_thread(preloaded):
    # A KeyboardInterrupt that lands in _Watch.__exit__ (after the C call returned, while the
    # final totals are read) must not leave the helper thread polling: it would call this
    # pause's callback again during a later operation.
    r = preloaded(
        """
        import threading, time
        from torch_memory_saver.binary_wrapper import BinaryWrapper
        n = 16 << 20
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0
        real = BinaryWrapper.last_progress
        def interrupted(self):
            raise KeyboardInterrupt  # Ctrl-C right after the C call returned
        BinaryWrapper.last_progress = interrupted
        calls = []
        try:
            tms.pause("kv", progress=lambda *a: calls.append(a))
        except KeyboardInterrupt:
            pass
        BinaryWrapper.last_progress = real
        n_then = len(calls)
        tms.resume("kv")  # slow: about 4 s, no callback of its own
        time.sleep(1.0)
        left = [t.name for t in threading.enumerate() if t.name == "torch_memory_saver-progress"]
        late = calls[n_then:]
        print("LEFT", left, "LATE", late[:3])
        assert not left and not late, (left, late[:3])
        print("ok")
        """,
        **SLOW,
    )
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_the_last_progress_of_a_call_that_failed_early_is_none(preloaded):
    # tms_last_progress: "op 0 when that call failed". A call refused before it reached the
    # engine (a bad tag, a chunk index out of range) must not show the pause before it.
    r = preloaded(
        """
        from torch_memory_saver import binary_wrapper
        w = binary_wrapper.load()
        n = 3 << 20
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0
        tms.pause("kv")
        assert w.last_progress() is not None and w.last_progress().bytes_total == n
        tms.resume("kv")
        refused = {
            "a tag that is not UTF-8": lambda: w.tms_pause(b"\\xff"),
            "a chunk of an allocation that is not chunked": lambda: w.tms_chunks_at(p, 1, (ctypes.c_uint64 * 1)(0), 1),
        }
        for what, call in refused.items():
            tms.pause("kv")
            tms.resume("kv")
            assert w.last_progress() is not None
            rc = call()
            assert rc != 0, what
            assert w.last_progress() is None, (what, w.last_progress().op)
        print("ok")
        """
    )
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr


# Four chunks of 2 MiB (C) at p in tag "kv" with a CPU backup, the library's bindings w, and
# first and count for tms_range to write (7: not written yet).
CHUNKED_KV = """
from torch_memory_saver import binary_wrapper
w = binary_wrapper.load()
C = 2 << 20
with tms.region(tag="kv", enable_cpu_backup=True, chunk_size=C):
    rc, p = cuda_malloc(4 * C)
assert rc == 0
first, count = ctypes.c_uint64(7), ctypes.c_uint64(7)
"""


def test_the_last_progress_of_a_range_holding_no_whole_chunk_is_its_own(preloaded):
    # It succeeded, acting on nothing, as tms_chunks_at does for chunks already paused: op 1
    # with 0 bytes, not op 0 ("failed or none"), which the last call's caller cannot tell from
    # a failure.
    r = preloaded(
        CHUNKED_KV
        + textwrap.dedent(
            """
        assert w.tms_range(p + 1, C, 1, ctypes.byref(first), ctypes.byref(count)) == 0
        assert (first.value, count.value) == (0, 0)
        last = w.last_progress()
        assert last is not None and (last.op, last.bytes_total) == (1, 0), last and last.op
        assert w.tms_range(p + 1, 0, 0, None, None) == 0
        assert w.last_progress() is not None and w.last_progress().op == 2
        print("ok")
        """
        )
    )
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_a_range_that_fails_still_says_which_chunks_it_was_to_act_on(preloaded):
    # tms_range writes `first` and `count` before the operation runs (tms.h says so): a resume
    # whose first host-to-device copy fails is refused, and they name the chunks it was for.
    r = preloaded(
        CHUNKED_KV
        + textwrap.dedent(
            """
        assert w.tms_range(p + C, 2 * C, 1, ctypes.byref(first), ctypes.byref(count)) == 0
        assert (first.value, count.value) == (1, 2)
        first, count = ctypes.c_uint64(7), ctypes.c_uint64(7)
        assert w.tms_range(p + C - 1, 2 * C + 1, 0, ctypes.byref(first), ctypes.byref(count)) != 0
        assert "injected fault" in w.last_error(), w.last_error()
        assert (first.value, count.value) == (1, 2)
        print("ok")
        """
        ),
        TMS_SIM_FAULTS="copy_h2d:1",
    )
    assert r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_a_failed_pause_or_resume_carries_what_the_library_says_it_changed(preloaded):
    # tms_last_changed through the package. A pause whose release fails leaves its allocation
    # paused, and its error says so; a resume whose copy fails is undone, and its error says it
    # changed nothing; a call refused before the library acted says nothing, nor a success.
    r = preloaded(
        """
        from torch_memory_saver import binary_wrapper
        from torch_memory_saver.errors import CHANGED
        w = binary_wrapper.load()
        n = 2 << 20
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, p = cuda_malloc(n)
        assert rc == 0
        def said(call):
            try:
                call()
            except Exception as e:  # noqa: BLE001 - what it carries is what is tested
                return getattr(e, CHANGED, "none")
            return "ok"
        print("pause", said(lambda: tms.pause("kv")), tag_stats("kv")["paused_allocations"])
        print("resume", said(lambda: tms.resume("kv")), tag_stats("kv")["paused_allocations"])
        print("again", said(lambda: tms.resume("kv")), w.last_changed())
        print("unchunked", said(lambda: tms.pause_chunks("kv", [0])), w.last_changed())
        print("bad tag", said(lambda: tms.pause(7)))
        """,
        TMS_SIM_FAULTS="release:1,copy_h2d:1",
    )
    assert r.stdout.splitlines() == [
        "pause {'allocations': 1, 'bytes': 2097152, 'communicators': 0} 1",
        "resume {'allocations': 0, 'bytes': 0, 'communicators': 0} 1",
        "again ok None",
        "unchunked none None",
        "bad tag none",
    ], r.stdout + r.stderr
