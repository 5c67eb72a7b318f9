"""Skipping unchanged memory and verified resumes on a real GPU (issue 40), both hook modes: the
digest kernel the library carries, through the installed package. Frozen weights with a
retained backup: the second pause copies nothing, a pause after one element changed copies one
piece, contents come back bit for bit at the same addresses; a backup changed while paused is
refused by a verified resume, which stays paused, and resumes once the backup is right."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

from test_gpu import MODES, run  # noqa: E402


@pytest.mark.parametrize("mode", MODES)
def test_frozen_weights_are_not_copied_again_and_a_bad_backup_is_refused(mode):
    r = run(
        """
        import ctypes
        n = 1 * GIB + 4096
        tms.retain_cpu_backup = True
        tms.set_checks("frozen", skip_unchanged=True, verify=True)
        with tms.region(tag="frozen", enable_cpu_backup=True):
            w = rand_bytes(n, seed=40)
        want = w.clone().cpu()
        addr = w.data_ptr()
        def last(op):
            return next(t for t in tms.stats()["tags"] if t["tag"] == "frozen")["last_" + op]
        tms.pause("frozen"); tms.resume("frozen")
        assert last("pause")["copied_bytes"] >= n, last("pause")
        assert last("resume")["verified_bytes"] >= n, last("resume")
        tms.pause("frozen")
        p = last("pause")
        print("unchanged pause", p["seconds"], p["copied_bytes"], p["unchanged_bytes"])
        assert p["copied_bytes"] == 0 and p["unchanged_bytes"] >= n, p
        tms.resume("frozen")
        assert w.data_ptr() == addr and torch.equal(w.cpu(), want)
        w[12345] += 1
        want[12345] += 1
        tms.pause("frozen")
        p = last("pause")
        assert 0 < p["copied_bytes"] <= 2 << 20, p
        # A stray write into the backup while paused: the verified resume refuses it.
        lib = tms._impl._binary_wrapper
        ptr = ctypes.c_void_p()
        assert lib.tms_get_cpu_backup(addr, n, ctypes.byref(ptr)) == 0 and ptr.value
        old = ctypes.string_at(ptr.value + 7, 1)
        ctypes.memmove(ptr.value + 7, bytes([old[0] ^ 1]), 1)
        try:
            tms.resume("frozen")
            raise SystemExit("a changed backup was not refused")
        except tms_pkg.DriverError as e:
            assert "differ from its backup after the restore" in str(e), e
        t = next(t for t in tms.stats()["tags"] if t["tag"] == "frozen")
        assert t["paused_allocations"] >= 1, t
        ctypes.memmove(ptr.value + 7, old, 1)
        tms.resume("frozen", verify=True)
        assert w.data_ptr() == addr and torch.equal(w.cpu(), want)
        print("ok")
        """,
        mode,
    )
    assert r.stdout.strip().endswith("ok"), r.stdout
