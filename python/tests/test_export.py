"""Exporting pauseable memory to another process (issue 38, item 2) through the package, on the
simulated device (preloaded, no torch): with ``TMS_SHAREABLE=1`` each segment comes as a file
descriptor holding the allocation's bytes (the simulated device's memory is a memfd), again
after a pause and resume; without it, and for a paused allocation, a clear error. On a GPU a
second process imports the descriptors (``test_gpu_export.py``)."""

from __future__ import annotations

from conftest import SIM_ALLOC


EXPORT = SIM_ALLOC + """
n = 6 << 20
p, data = alloc("x", n, 5, enable_cpu_backup=True)
def exported():
    segs = tms.export_memory(p)
    assert sum(s[1] for s in segs) == n and segs[0][0] == 0, segs
    got = b"".join(os.pread(fd, length, 0) for _, length, fd in segs)
    for _, _, fd in segs:
        os.close(fd)
    return got
"""


def test_shareable_memory_is_exported_segment_by_segment(preloaded):
    r = preloaded(
        EXPORT
        + """
assert exported() == data
tms.pause("x")
try:
    tms.export_memory(p)
    raise SystemExit("a paused allocation must be refused")
except tms_pkg.InvalidStateError as e:
    assert "resume it first" in str(e), e
tms.resume("x")
assert exported() == data, "the new memory, restored"
try:
    tms.export_memory(1)
    raise SystemExit("an address outside every allocation must be refused")
except tms_pkg.NotFoundError:
    pass
print("ok")
""",
        TMS_SHAREABLE="1",
    )
    assert r.stdout.strip() == "ok", r.stderr


def test_memory_not_made_shareable_is_refused_naming_the_setting(preloaded):
    r = preloaded(
        EXPORT
        + """
try:
    exported()
    raise SystemExit("should raise")
except tms_pkg.DriverError as e:
    assert "TMS_SHAREABLE=1" in str(e), e
print("ok")
"""
    )
    assert r.stdout.strip() == "ok", r.stderr


def test_a_malformed_setting_is_named(preloaded):
    r = preloaded("tms.stats()", expect_ok=False, TMS_SHAREABLE="sometimes")
    assert r.returncode != 0 and "TMS_SHAREABLE" in r.stderr, r.stderr


# Between export_memory's calls into the library, another thread frees the allocation holding
# the address and makes one with more segments there: the wrapper hands the library `old`'s
# address on the first call and `new`'s after it, as the address itself would then resolve.
REPLACED_BETWEEN_CALLS = SIM_ALLOC + """
MIB = 1 << 20
old, _ = alloc("old", 40 * MIB, 1, chunk=2 * MIB)   # 20 segments
new, data = alloc("new", 48 * MIB, 2, chunk=2 * MIB)  # 24 segments
lib = tms._impl._library()
real = lib.tms_export
calls = []
def replaced_after_the_first_call(addr, *rest):
    calls.append(rest[3])  # the room the call offers
    return real(old if len(calls) == 1 else new, *rest)
def open_fds():
    return len(os.listdir("/proc/self/fd"))
"""


def test_an_allocation_replaced_between_the_calls_is_exported_as_it_is_now(preloaded):
    # The count read by one call may be too small for the next: the export is asked again with
    # the room the library says it needs, never failing with a too-small buffer nor mixing the
    # two allocations.
    r = preloaded(
        REPLACED_BETWEEN_CALLS
        + """
fds_before = open_fds()
lib.tms_export = replaced_after_the_first_call
segs = tms.export_memory(new)
lib.tms_export = real
assert [(o, n) for o, n, _ in segs] == [(i * 2 * MIB, 2 * MIB) for i in range(24)], segs
got = b"".join(os.pread(fd, n, 0) for _, n, fd in segs)
for _, _, fd in segs:
    os.close(fd)
assert got == data, "the new allocation's bytes"
assert open_fds() == fds_before, "a descriptor of an attempt left open"
assert len(calls) >= 2 and calls[-1] == 24, calls
print("ok", calls)
""",
        TMS_SHAREABLE="1",
    )
    assert r.stdout.startswith("ok"), r.stderr


def test_an_allocation_that_keeps_growing_between_the_calls_is_refused_after_a_few_tries(preloaded):
    # Each call finds a larger allocation than the call before made room for: export_memory
    # gives up after its tries, saying why, with nothing exported (no descriptor left open).
    r = preloaded(
        SIM_ALLOC
        + """
MIB = 1 << 20
def chunked(n):
    with tms.region(tag=f"t{n}", chunk_size=2 * MIB):
        rc, p = cuda_malloc(n * 2 * MIB)
    assert rc == 0, rc
    return p
growing = [chunked(n) for n in range(17, 25)]  # 17 to 24 segments
lib = tms._impl._library()
real = lib.tms_export
calls = []
def larger_at_each_call(addr, *rest):
    calls.append(rest[3])
    return real(growing[min(len(calls), len(growing)) - 1], *rest)
fds_before = len(os.listdir("/proc/self/fd"))
lib.tms_export = larger_at_each_call
try:
    tms.export_memory(growing[-1])
    raise SystemExit("should give up")
except tms_pkg.InvalidStateError as e:
    print("REFUSED", e)
lib.tms_export = real
assert len(os.listdir("/proc/self/fd")) == fds_before
assert calls == list(range(16, 24)), calls
segs = tms.export_memory(growing[-1])  # the allocation as it is, once it holds still
assert len(segs) == 24, segs
for _, _, fd in segs:
    os.close(fd)
print("ok")
""",
        TMS_SHAREABLE="1",
        TMS_SIM_CAPACITY="1GiB",
    )
    assert "at each of 8 tries" in r.stdout and "room for 23 exported segments, 24 needed" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("ok"), r.stdout


def test_a_ctrl_c_as_the_library_exports_leaves_no_descriptor_open(preloaded):
    # tms_export waits for any pause or resume under way (seconds); a Ctrl-C then is raised as
    # it returns, the descriptors made: each left open keeps its segment's memory alive after
    # every later pause. The stand-in calls the library, then interrupts the main thread as a
    # Ctrl-C would.
    r = preloaded(
        EXPORT
        + """
import _thread, signal
# Python raises no KeyboardInterrupt where SIGINT came ignored (a job started in the background).
signal.signal(signal.SIGINT, signal.default_int_handler)
lib = tms._impl._library()
real = lib.tms_export
made = []
def interrupted(addr, fds, offsets, lens, room, need):
    status = real(addr, fds, offsets, lens, room, need)
    made.append(need._obj.value if status == 0 else 0)
    _thread.interrupt_main()
    return status
fds_before = len(os.listdir("/proc/self/fd"))
lib.tms_export = interrupted
try:
    tms.export_memory(p)
    raise SystemExit("no KeyboardInterrupt")
except KeyboardInterrupt:
    pass
lib.tms_export = real
assert made and made[0] >= 1, made  # exported, then interrupted
assert len(os.listdir("/proc/self/fd")) == fds_before, "descriptors of the interrupted export left open"
assert exported() == data
print("ok")
""",
        TMS_SHAREABLE="1",
    )
    assert r.stdout.strip() == "ok", r.stderr
