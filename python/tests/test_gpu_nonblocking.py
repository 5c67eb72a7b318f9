"""The non-blocking resume on a real GPU, both hook modes: work queued on the current stream right
after ``resume(non_blocking=True)`` sees the restored contents (the stream waits on the GPU for
the restore), one tensor can be waited for on another stream, the host can wait, and an error
before the return is raised there and loses nothing. Each scenario runs in a fresh interpreter
(test_gpu.py's harness)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

from test_gpu import MODES, run  # noqa: E402


@pytest.mark.parametrize("mode", MODES)
def test_the_current_stream_waits_for_the_restore(mode):
    r = run(
        """
        n, count = 256 << 20, 16            # 4 GiB in 16 tensors
        with tms.region(tag="kv", enable_cpu_backup=True):
            ts = [rand_bytes(n, i) for i in range(count)]
        def sums():
            return [int(t.view(torch.int32).sum(dtype=torch.int64)) for t in ts]
        ref = sums()
        addrs = [t.data_ptr() for t in ts]
        for cycle in range(3):
            tms.pause("kv")
            t0 = time.perf_counter()
            tms.resume("kv", non_blocking=True)
            returned = time.perf_counter() - t0
            # Queued at once on the current stream, with no host wait: ordered after the restore.
            got = [t.view(torch.int32).sum(dtype=torch.int64) for t in ts]
            torch.cuda.synchronize()
            landed = time.perf_counter() - t0
            assert [int(x) for x in got] == ref, f"cycle {cycle}: a kernel overtook the restore"
            assert [t.data_ptr() for t in ts] == addrs
            print(f"cycle {cycle}: returned after {returned:.4f} s, data used after {landed:.4f} s")
        # One tensor first, waited for on a stream of its own; the host waits for another.
        tms.pause("kv")
        side = torch.cuda.Stream()
        tms.resume("kv", non_blocking=True, order=[ts[9], ts[3]])
        tms.wait(ts[9], stream=side)
        with torch.cuda.stream(side):
            first = ts[9].view(torch.int32).sum(dtype=torch.int64)
        side.synchronize()
        assert int(first) == ref[9]
        assert tms.wait(ts[3], timeout=60) is True
        assert int(ts[3].view(torch.int32).sum(dtype=torch.int64)) == ref[3]
        assert tms.wait(timeout=60) is True
        assert sums() == ref
        # Blocking and non-blocking resumes mix; nothing is left in flight.
        tms.pause("kv"); tms.resume("kv"); assert sums() == ref
        assert tms.wait(timeout=0) is True
        print("OK")
        """,
        mode,
    )
    assert "OK" in r.stdout, r.stdout


@pytest.mark.parametrize("mode", MODES)
def test_out_of_memory_before_the_return_is_raised_and_loses_nothing(mode):
    run(
        """
        with tms.region(tag="kv", enable_cpu_backup=True):
            kv = rand_bytes(2 * GIB, 7)
        ref = int(kv.view(torch.int32).sum(dtype=torch.int64))
        tms.pause("kv")
        torch.cuda.empty_cache()
        hog_bytes = max(free() - (1 * GIB), 0)
        hog = torch.empty(hog_bytes, dtype=torch.uint8, device="cuda")
        try:
            tms.resume("kv", non_blocking=True)
            raise SystemExit("the resume should have run out of memory")
        except tms_pkg.OutOfMemoryError as e:
            print("MSG", e)
        assert {t["tag"]: t for t in tms.stats()["tags"]}["kv"]["bytes_paused"] >= 2 * GIB
        del hog
        torch.cuda.empty_cache()
        tms.resume("kv", non_blocking=True)
        assert int(kv.view(torch.int32).sum(dtype=torch.int64)) == ref
        assert tms.wait() is True
        """,
        mode,
    )
