"""Disk backups on a real GPU, in both hook modes: a training-offload loop whose optimizer
state goes to disk and comes back bit-identical, with disk use constant and files gone at exit;
and a pause into a directory that fills part-way (the library's own fault injection at the
write), which fails with the error and leaves the data intact."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

from test_gpu import MODES, run  # noqa: E402


@pytest.mark.parametrize("mode", MODES)
def test_training_offload_to_disk(mode, tmp_path):
    d = tmp_path / "offload"
    d.mkdir()
    r = run(
        f"""
        D = {str(d)!r}
        tms.set_disk_backup_dir(D)
        torch.cuda.empty_cache()
        with tms.region(tag="optimizer", enable_disk_backup=True):
            states = [rand_bytes((256 << 20) + 1000 * i, seed=i) for i in range(6)]
        with tms.region(tag="kv"):
            kv = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        refs = [s.cpu() for s in states]
        sizes = None
        for cycle in range(3):
            before = free()
            tms.pause("optimizer")
            gained = free() - before
            assert gained >= sum(s.numel() for s in states) - (16 << 20), gained
            names = sorted(os.listdir(D))
            now = sum(os.path.getsize(os.path.join(D, n)) for n in names)
            assert sizes is None or now == sizes, (sizes, now)  # disk use stays constant
            sizes = now
            st = next(t for t in tms.stats()["tags"] if t["tag"] == "optimizer")
            assert st["disk_backup_bytes"] == now and st["host_backup_bytes"] == 0, st
            kv.fill_(cycle)  # the other tag keeps working meanwhile
            tms.resume("optimizer")
            for s, ref in zip(states, refs):
                assert torch.equal(s.cpu(), ref), "bit-identical after the cycle"
            for s in states:
                s.add_(1)
            refs = [s.cpu() for s in states]
        print("files", len(os.listdir(D)), "bytes", sizes)
        print("OK")
        """,
        mode,
        timeout=600,
    )
    assert "OK" in r.stdout, r.stdout
    assert list(d.iterdir()) == [], "the process removed its files at exit"


@pytest.mark.parametrize("mode", MODES)
def test_a_disk_that_fills_part_way_loses_nothing(mode, tmp_path):
    d = tmp_path / "full"
    d.mkdir()
    r = run(
        f"""
        tms.set_disk_backup_dir({str(d)!r})
        with tms.region(tag="opt", enable_disk_backup=True):
            a = rand_bytes(300 << 20, seed=1)
            b = rand_bytes(200 << 20, seed=2)
        ra, rb = a.cpu(), b.cpu()
        try:
            tms.pause("opt")
            raise SystemExit("should raise")
        except tms_pkg.OutOfMemoryError as e:
            msg = str(e)
            assert "full" in msg and {str(d)!r} in msg, msg
            print("error:", msg[:300])
        # A tensor whose file was complete may be paused already (its memory released): the
        # one whose write failed is active with its contents; resume brings back the others.
        st = next(t for t in tms.stats()["tags"] if t["tag"] == "opt")
        assert st["active_allocations"] >= 1, st
        tms.resume("opt")
        assert torch.equal(a.cpu(), ra) and torch.equal(b.cpu(), rb), "nothing lost"
        tms.pause("opt")  # the injected fault fired once; the retry works
        tms.resume("opt")
        assert torch.equal(a.cpu(), ra) and torch.equal(b.cpu(), rb)
        print("OK")
        """,
        mode,
        TMS_DISK_FAULTS="write:40:ENOSPC",
    )
    assert "OK" in r.stdout, r.stdout
