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
