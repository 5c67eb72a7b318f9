"""Elastic (chunked) allocations through the Python package on the simulated device (preloaded,
no torch): chunks pause and resume one by one with CPU, disk or no backup, compose with
whole-tag pause/resume, the chunk state is saved and restored, byte ranges round inward, bad
arguments are clear errors, and stats/summary show partial allocations.

Allocations come from the interposed cudaMalloc (ctypes); the simulated device's memory is host
memory, so active chunks are written and read directly (never a paused one: it is unmapped).
The tensor forms take ``Buf``, which has the few methods of a torch.Tensor the package uses."""

from __future__ import annotations

import textwrap

from conftest import BUF

HELPERS = """
MIB = 1 << 20
GRAN = 2 * MIB  # the simulated device's default granularity
tms._ensure_initialized()
lib = tms._impl._binary_wrapper
""" + BUF + """
def chunked(tag, n, chunk, **kw):
    with tms.region(tag=tag, chunk_size=chunk, **kw):
        rc, p = cuda_malloc(n)
    assert rc == 0, (rc, lib.last_error())
    return p

def fill(p, n, chunk):
    '''A distinct pattern in every chunk (random bytes, first byte the chunk number).'''
    data = b"".join(bytes([i]) + os.urandom(chunk - 1) for i in range(n // chunk))
    ctypes.memmove(p, data, n)
    return data

def chunk_at(p, chunk, i):
    return ctypes.string_at(p + i * chunk, chunk)

def enter(**kw):
    with tms.region(**kw):
        pass

def raises(exc, f, *args, **kw):
    try:
        f(*args, **kw)
    except exc as e:
        return e
    raise SystemExit(f"{getattr(f, '__name__', f)}{args} did not raise {exc.__name__}")
"""


def run(preloaded, code: str, **env: str) -> str:
    r = preloaded(HELPERS + textwrap.dedent(code) + "\nprint('ok')\n", **env)
    assert r.stdout.strip().splitlines()[-1] == "ok", r.stdout
    return r.stdout


def test_chunks_round_trip_with_a_cpu_backup(preloaded):
    run(
        preloaded,
        """
        C = 4 * MIB
        n = 8 * C
        p = chunked("kv", n, C, enable_cpu_backup=True)
        assert tms.get_num_chunks("kv") == 8 and tms.get_chunk_states("kv") == [True] * 8
        assert tms.get_chunk_layout("kv") == [(i * C, C) for i in range(8)]
        data = fill(p, n, C)
        tms.pause_chunks("kv", [3, 1, 3])  # any order, duplicates once
        states = [True, False, True, False, True, True, True, True]
        assert tms.get_chunk_states("kv") == states
        s = tag_stats("kv")
        assert s["partial_allocations"] == 1 and s["active_allocations"] == 0 and s["paused_allocations"] == 0, s
        assert s["bytes_paused"] == 2 * C and s["bytes_active"] == 6 * C, s
        # The active chunks stay mapped and usable while others are paused.
        for i in (0, 2, 4, 5, 6, 7):
            assert chunk_at(p, C, i) == data[i * C:(i + 1) * C]
        ctypes.memmove(p + 7 * C, b"\\xab" * C, C)
        data = data[:7 * C] + b"\\xab" * C
        tms.pause_chunks("kv", [1])  # already paused: skipped
        tms.resume_chunks("kv", (i for i in (1, 3)))  # any iterable
        assert tms.get_chunk_states("kv") == [True] * 8
        assert ctypes.string_at(p, n) == data, "every chunk back with its contents"
        s = tag_stats("kv")
        assert s["partial_allocations"] == 0 and s["active_allocations"] == 1 and s["bytes_active"] == n, s
        # Again, through the allocation's address (a view starting inside it names the same one).
        view = Buf(p + C + 12345, 2 * C)
        assert tms.get_num_chunks(view) == 8 and tms.get_chunk_layout(view) == [(i * C, C) for i in range(8)]
        tms.pause_chunks(view, range(6, 8))
        assert tms.get_chunk_states(view) == [True] * 6 + [False] * 2 == tms.get_chunk_states("kv")
        tms.resume_chunks(Buf(p, n), [6, 7])
        assert ctypes.string_at(p, n) == data and tms.get_chunk_states(view) == [True] * 8
        tms.pause_chunks("kv", [])  # nothing to do
        assert cuda_free(p) == 0
        """,
    )


def test_chunks_round_trip_with_a_disk_backup(preloaded, tmp_path):
    d = tmp_path / "chunks"
    d.mkdir()
    run(
        preloaded,
        f"""
        tms.set_disk_backup_dir({str(d)!r})
        C = GRAN
        n = 10 * C
        p = chunked("opt", n, C, enable_disk_backup=True)
        data = fill(p, n, C)
        tms.pause_chunks(Buf(p, n), [0, 4, 9])
        assert tms.get_chunk_states("opt") == [i not in (0, 4, 9) for i in range(10)]
        s = tag_stats("opt")
        assert s["disk_backup_bytes"] > 0 and s["host_backup_bytes"] == 0 and s["partial_allocations"] == 1, s
        assert len(os.listdir({str(d)!r})) == 1
        tms.pause_chunks("opt", [5])
        tms.resume_chunks("opt", [0, 9])
        assert tms.get_chunk_states("opt") == [i not in (4, 5) for i in range(10)]
        tms.resume_chunks("opt", [4, 5])
        assert ctypes.string_at(p, n) == data
        # Twice more: the file is reused.
        for _ in range(2):
            tms.pause_chunks("opt", range(10))
            assert tag_stats("opt")["paused_allocations"] == 1
            tms.resume_chunks("opt", range(10))
            assert ctypes.string_at(p, n) == data
        assert len(os.listdir({str(d)!r})) == 1
        """,
    )
    assert list(d.iterdir()) == [], "the file went at exit"


def test_chunks_without_a_backup_change_state_only(preloaded):
    run(
        preloaded,
        """
        C = GRAN
        n = 6 * C
        p = chunked("scratch", n, C)
        data = fill(p, n, C)
        tms.pause_chunks("scratch", [2, 3])
        assert tms.get_chunk_states("scratch") == [True, True, False, False, True, True]
        s = tag_stats("scratch")
        assert s["host_backup_bytes"] == 0 and s["disk_backup_bytes"] == 0 and s["bytes_paused"] == 2 * C, s
        tms.resume_chunks("scratch", [2, 3])
        assert tms.get_chunk_states("scratch") == [True] * 6
        # Chunks never paused kept their bytes; the resumed ones are fresh, usable memory.
        for i in (0, 1, 4, 5):
            assert chunk_at(p, C, i) == data[i * C:(i + 1) * C]
        ctypes.memmove(p + 2 * C, b"\\x5a" * (2 * C), 2 * C)
        assert ctypes.string_at(p + 2 * C, 2 * C) == b"\\x5a" * (2 * C)
        """,
    )


def test_whole_tag_pause_and_resume_compose_with_chunk_calls(preloaded):
    run(
        preloaded,
        """
        C = GRAN
        n = 4 * C
        p = chunked("kv", n, C, enable_cpu_backup=True)
        with tms.region(tag="kv", enable_cpu_backup=True):
            rc, plain = cuda_malloc(3 * MIB)  # a non-chunked allocation of the same tag
        assert rc == 0
        data, other = fill(p, n, C), os.urandom(3 * MIB)
        ctypes.memmove(plain, other, len(other))
        tms.pause_chunks("kv", [0, 1])
        tms.pause("kv")  # pauses the rest, and the other allocation
        assert tms.get_chunk_states("kv") == [False] * 4
        s = tag_stats("kv")
        assert s["paused_allocations"] == 2 and s["partial_allocations"] == 0 and s["bytes_active"] == 0, s
        tms.resume_chunks("kv", [2])
        assert tms.get_chunk_states("kv") == [False, False, True, False]
        assert chunk_at(p, C, 2) == data[2 * C:3 * C]
        s = tag_stats("kv")
        assert s["partial_allocations"] == 1 and s["paused_allocations"] == 1, s
        tms.resume("kv")  # every chunk, and the other allocation
        assert tms.get_chunk_states("kv") == [True] * 4
        assert ctypes.string_at(p, n) == data and ctypes.string_at(plain, len(other)) == other
        tms.pause()  # every tag
        tms.resume_chunks("kv", [3])
        tms.pause_chunks("kv", [3])
        tms.resume()
        assert ctypes.string_at(p, n) == data and ctypes.string_at(plain, len(other)) == other
        assert tag_stats("kv")["active_allocations"] == 2
        """,
    )


def test_pause_saves_and_resume_restores_the_chunk_state(preloaded):
    run(
        preloaded,
        """
        C = GRAN
        n = 6 * C
        p = chunked("kv", n, C, enable_cpu_backup=True)
        data = fill(p, n, C)
        tms.pause_chunks("kv", [1, 3])
        before = tms.get_chunk_states("kv")
        tms.pause("kv", save_chunk_state=True)
        assert tms.get_chunk_states("kv") == [False] * 6
        tms.resume("kv", restore_chunk_state=True)
        assert tms.get_chunk_states("kv") == before == [True, False, True, False, True, True]
        for i in (0, 2, 4, 5):
            assert chunk_at(p, C, i) == data[i * C:(i + 1) * C]
        tms.resume_chunks("kv", [1, 3])
        assert ctypes.string_at(p, n) == data
        # Without the flags every chunk comes back.
        tms.pause_chunks("kv", [0])
        tms.pause("kv", save_chunk_state=True)
        tms.resume("kv")
        assert tms.get_chunk_states("kv") == [True] * 6 and ctypes.string_at(p, n) == data
        # Every tag, the flags on the facade's keywords.
        tms.pause_chunks("kv", [5])
        tms.pause(save_chunk_state=True)
        tms.resume(restore_chunk_state=True)
        assert tms.get_chunk_states("kv") == [True] * 5 + [False]
        tms.resume("kv")
        assert ctypes.string_at(p, n) == data
        """,
    )


def test_byte_ranges_round_inward_to_whole_chunks(preloaded):
    run(
        preloaded,
        """
        C = GRAN
        n = 8 * C
        p = chunked("kv", n, C, enable_cpu_backup=True)
        data = fill(p, n, C)
        t = Buf(p, n)
        # [1 MiB, 7 MiB) holds chunks 1 and 2 ([2, 6) MiB) wholly, and 0 and 3 only in part.
        done = tms.pause_range(t, MIB, 7 * MIB)
        assert done == range(1, 3), done
        assert tms.get_chunk_states(t) == [True, False, False] + [True] * 5
        assert tms.pause_range(t, 0, MIB) == range(0, 0), "no whole chunk inside: nothing"
        assert tms.pause_range(t, 5, 5) == range(0, 0)
        assert tms.get_chunk_states(t) == [True, False, False] + [True] * 5
        # Exact chunk bounds take those chunks; the end of the tensor is allowed.
        assert tms.pause_range(t, 6 * C, n) == range(6, 8)
        # Offsets count from the view's data_ptr: the view starts 3 MiB into the allocation, so
        # its bytes [0, 4 MiB) are the allocation's [3, 7) MiB, which holds chunk 2 wholly.
        view = Buf(p + 3 * MIB, n - 3 * MIB)
        assert tms.resume_range(view, 0, 4 * MIB) == range(2, 3)
        assert tms.get_chunk_states(t) == [True, False, True, True, True, True, False, False]
        assert tms.resume_range(t, 0, n) == range(0, 8)
        assert tms.get_chunk_states(t) == [True] * 8 and ctypes.string_at(p, n) == data
        for args in ((-1, 10), (10, 5), (0, n + 1), (n + 1, n + 1)):
            e = raises(tms_pkg.InvalidArgumentError, tms.pause_range, t, *args)
            assert str(n) in str(e), e
        raises(TypeError, tms.pause_range, t, 0.5, 10)
        raises(TypeError, tms.pause_range, t, 0, "10")
        raises(TypeError, tms.pause_range, "kv", 0, 10)
        assert tms.get_chunk_states(t) == [True] * 8, "refused calls change nothing"
        """,
    )


def test_bad_chunk_sizes_are_refused_naming_the_number(preloaded):
    run(
        preloaded,
        """
        e = raises(tms_pkg.InvalidArgumentError, enter, tag="x", chunk_size=3 * MIB)
        assert "3145728" in str(e) and "granularity (2097152 bytes)" in str(e), e
        e = raises(tms_pkg.InvalidArgumentError, enter, tag="x", chunk_size=MIB)
        assert "1048576" in str(e), e
        for bad in (-GRAN, 1.5, "4MiB", True):
            e = raises(tms_pkg.InvalidArgumentError, enter, tag="x", chunk_size=bad)
            assert repr(bad) in str(e) or str(bad) in str(e), (bad, e)
        assert isinstance(e, ValueError)
        # A refused region left no region open; 0 and None are "not chunked".
        for none in (0, None):
            with tms.region(tag="plain", chunk_size=none):
                assert lib.tms_get_chunk_size() == 0
                rc, p = cuda_malloc(3 * MIB)
            assert rc == 0
        with tms.region(tag="c", chunk_size=4 * MIB):
            assert lib.tms_get_chunk_size() == 4 * MIB
            with tms.region(tag="inner"):
                assert lib.tms_get_chunk_size() == 0, "nested regions do not inherit it"
            assert lib.tms_get_chunk_size() == 4 * MIB
        assert json.loads(lib.call_string(lib.tms_region_current))["depth"] == 0
        """,
    )


def test_an_allocation_that_is_not_a_multiple_of_the_chunk_fails_clearly(preloaded):
    run(
        preloaded,
        """
        C = 4 * MIB
        # What PyTorch does when its allocation fails: it raises an error of its own. The region
        # turns it into ours, with the library's message naming both sizes, chained from it.
        try:
            with tms.region(tag="kv", chunk_size=C):
                rc, p = cuda_malloc(6 * MIB)
                assert rc == 1 and p is None, (rc, p)  # cudaErrorInvalidValue
                raise RuntimeError("CUDA error: invalid argument")
        except tms_pkg.InvalidArgumentError as e:
            msg = str(e)
            assert "6291456" in msg and "4194304" in msg and "must be a multiple" in msg, msg
            assert isinstance(e.__cause__, RuntimeError) and "invalid argument" in str(e.__cause__)
        else:
            raise SystemExit("not translated")
        assert tms.stats()["tags"] == [] or tag_stats("kv")["allocations"] == 0
        # The message stays the thread's last error, but a later region translates only what
        # happened inside it: other exceptions pass through unchanged.
        class Mine(Exception):
            pass
        for exc in (RuntimeError("shape mismatch"), Mine("x"), KeyError("k")):
            try:
                with tms.region(tag="kv", chunk_size=C):
                    raise exc
            except BaseException as e:
                assert e is exc, (e, exc)
        # Our own errors pass through too, even right after a refused allocation.
        mine = tms_pkg.UnsupportedError("mine")
        try:
            with tms.region(tag="kv", chunk_size=C):
                assert cuda_malloc(14 * MIB)[0] == 1
                raise mine
        except tms_pkg.TorchMemorySaverError as e:
            assert e is mine, e
        # The same refusal twice in a row (the same message) is translated both times: the
        # thread's error count tells a new error from the old one.
        for _ in range(2):
            try:
                with tms.region(tag="kv", chunk_size=C):
                    assert cuda_malloc(6 * MIB)[0] == 1
                    raise RuntimeError("CUDA error: invalid argument")
            except tms_pkg.InvalidArgumentError as e:
                assert "6291456" in str(e), e
        n = lib.tms_error_count()
        tms.pause("kv")
        tms.resume("kv")
        assert lib.tms_error_count() == n, "no new error, no count"
        # Not in a region without a chunk size, nor for another chunk size (each refusal below
        # is a new last error: 10 then 18 MiB).
        for mib, kw in ((10, {}), (18, {"chunk_size": 2 * C})):
            try:
                with tms.region(tag="kv", **kw):
                    with tms.region(tag="kv", chunk_size=C):
                        assert cuda_malloc(mib * MIB)[0] == 1
                    assert f"({mib * MIB} bytes)" in lib.last_error()
                    raise RuntimeError("outer")
            except RuntimeError as e:
                assert not isinstance(e, tms_pkg.TorchMemorySaverError) and str(e) == "outer", e
        """,
    )


def test_bad_indices_and_targets(preloaded):
    run(
        preloaded,
        """
        C = GRAN
        p = chunked("kv", 4 * C, C, enable_cpu_backup=True)
        e = raises(tms_pkg.InvalidArgumentError, tms.pause_chunks, "kv", [1, 4])
        assert "chunk 4" in str(e) and "4 chunks" in str(e), e
        raises(tms_pkg.InvalidArgumentError, tms.resume_chunks, Buf(p, C), [7])
        e = raises(tms_pkg.InvalidArgumentError, tms.pause_chunks, "kv", [0, -1])
        assert "-1" in str(e), e
        for bad in ([1.0], ["1"], [True], [None]):
            raises(TypeError, tms.pause_chunks, "kv", bad)
        for bad in (3, None, "01"):
            raises(TypeError, tms.pause_chunks, "kv", bad)
        raises(TypeError, tms.pause_chunks, 1234, [0])
        raises(TypeError, tms.get_chunk_states, None)
        raises(tms_pkg.InvalidArgumentError, tms.pause_chunks, "", [0])
        assert tms.get_chunk_states("kv") == [True] * 4, "refused calls paused nothing"
        # A tag with allocations but no chunked one, an address outside every allocation.
        with tms.region(tag="plain"):
            rc, plain = cuda_malloc(4 * MIB)
        for f in (tms.get_num_chunks, tms.get_chunk_states, tms.get_chunk_layout):
            e = raises(tms_pkg.NotFoundError, f, "plain")
            assert "has no chunked allocation" in str(e), e
        e = raises(tms_pkg.NotFoundError, tms.pause_chunks, "plain", [0])
        assert "has no chunked allocation" in str(e), e
        for f in (tms.get_num_chunks, tms.get_chunk_states, tms.get_chunk_layout):
            e = raises(tms_pkg.InvalidArgumentError, f, Buf(plain, 4 * MIB))
            assert "not chunked" in str(e), e
        e = raises(tms_pkg.InvalidArgumentError, tms.pause_range, Buf(plain, 4 * MIB), 0, 4 * MIB)
        assert "not chunked" in str(e), e
        raises(tms_pkg.InvalidArgumentError, tms.pause_chunks, Buf(plain, 4 * MIB), [0])
        raises(tms_pkg.NotFoundError, tms.get_num_chunks, Buf(8, 8))
        """,
    )


def test_the_existing_librarys_keywords_and_answers_for_a_tag_without_allocations(preloaded):
    # Its chunk API: pause_chunks(tag=..., chunk_indices=...) and friends by keyword, and
    # 0 / [] / nothing done for a tag that holds no allocation (a rank whose cache is not made).
    out = run(
        preloaded,
        """
        C = GRAN
        p = chunked("kv", 4 * C, C, enable_cpu_backup=True)
        data = fill(p, 4 * C, C)
        tms.pause_chunks(tag="kv", chunk_indices=[1, 2])
        assert tms.get_chunk_states(tag="kv") == [True, False, False, True]
        assert tms.get_num_chunks(tag="kv") == 4
        assert tms.get_chunk_layout(tag="kv") == [(i * C, C) for i in range(4)]
        tms.resume_chunks(tag="kv", chunk_indices=(2,))
        tms.resume_chunks("kv", chunk_indices=[1])
        assert tms.get_chunk_states("kv") == [True] * 4 and ctypes.string_at(p, 4 * C) == data
        tms.pause_chunks(tag=Buf(p, 4 * C), chunk_indices=[0])  # tag= names a tensor too
        assert tms.get_chunk_states(tag=Buf(p, C)) == [False, True, True, True]
        # As the existing library's facade calls its implementation.
        tms._impl.resume_chunks(tag="kv", chunk_indices=[0])
        assert tms._impl.get_num_chunks(tag="kv") == 4 and tms._impl.get_chunk_states(tag="kv") == [True] * 4
        # A tag without any allocation: never made, and made then freed.
        with tms.region(tag="gone"):
            rc, q = cuda_malloc(4 * MIB)
        assert cuda_free(q) == 0
        for tag in ("nope", "gone"):
            assert tms.get_num_chunks(tag) == 0 and tms.get_num_chunks(tag=tag) == 0
            assert tms.get_chunk_states(tag=tag) == [] and tms.get_chunk_layout(tag=tag) == []
            assert tms.pause_chunks(tag=tag, chunk_indices=[0]) is None
            assert tms.resume_chunks(tag, [0, 5]) is None
        assert tms.get_chunk_states("kv") == [True] * 4, "nothing else changed"
        # Bad arguments: an index out of range still raises for a tag without allocations.
        raises(tms_pkg.InvalidArgumentError, tms.pause_chunks, tag="nope", chunk_indices=[-1])
        for f, kw in ((tms.pause_chunks, dict(tag="kv", chunk_indices=[0], indices=[0])),
                      (tms.pause_chunks, dict(tag_or_tensor="kv", tag="kv", chunk_indices=[0])),
                      (tms.resume_chunks, dict(tag="kv")),
                      (tms.resume_chunks, dict(chunk_indices=[0])),
                      (tms.get_chunk_states, dict(tag_or_tensor="kv", tag="kv")),
                      (tms.get_num_chunks, dict())):
            print("TYPE", raises(TypeError, f, **kw))
        """,
    )
    assert "TYPE pause_chunks() got the chunk indices twice: as indices and as chunk_indices=" in out, out
    assert "TYPE pause_chunks() got a tag or tensor twice: as tag_or_tensor and as tag=" in out, out
    assert "TYPE resume_chunks() needs the chunk indices: indices (or chunk_indices=)" in out, out
    assert "TYPE resume_chunks() needs a tag or tensor: tag_or_tensor (or tag=)" in out, out
    assert "TYPE get_num_chunks() needs a tag or tensor" in out, out


def test_a_tag_with_two_chunked_allocations_names_both(preloaded):
    run(
        preloaded,
        """
        C = GRAN
        a = chunked("kv", 2 * C, C, enable_cpu_backup=True)
        b = chunked("kv", 3 * C, C, enable_cpu_backup=True)
        calls = [
            (tms.pause_chunks, ("kv", [0])),
            (tms.resume_chunks, ("kv", [0])),
            (tms.get_num_chunks, ("kv",)),
            (tms.get_chunk_states, ("kv",)),
            (tms.get_chunk_layout, ("kv",)),
        ]
        for f, args in calls:
            e = raises(tms_pkg.InvalidArgumentError, f, *args)
            msg = str(e)
            assert f"{a:#x}" in msg and f"{b:#x}" in msg and "2 chunked allocations" in msg, (f.__name__, msg)
        # Each by its own address.
        assert tms.get_num_chunks(Buf(a, 2 * C)) == 2 and tms.get_num_chunks(Buf(b, 3 * C)) == 3
        tms.pause_chunks(Buf(b, 3 * C), [1])
        assert tms.get_chunk_states(Buf(a, 2 * C)) == [True, True]
        assert tms.get_chunk_states(Buf(b, 3 * C)) == [True, False, True]
        tms.resume("kv")
        assert tms.get_chunk_states(Buf(b, 3 * C)) == [True] * 3
        """,
    )


def test_summary_shows_partial_allocations(preloaded):
    out = run(
        preloaded,
        """
        C = GRAN
        chunked("kv", 4 * C, C, enable_cpu_backup=True)
        with tms.region(tag="w"):
            cuda_malloc(4 * MIB)
        assert "partial" not in tms.summary()
        tms.pause_chunks("kv", [0, 1])
        s = tms.summary()
        print(s)
        head, kv, w = s.splitlines()[1:4]
        assert head.split()[:5] == ["tag", "allocs", "paused", "partial", "active"], head
        assert kv.split()[:6] == ["kv", "1", "0", "1", "0.004", "0.004"], kv
        assert w.split()[:4] == ["w", "1", "0", "0"], w
        # The column lines up: the number ends where its heading does.
        end = head.index("partial") + len("partial")
        assert kv[end - 1] == "1" and kv[end] == " " and w[end - 1] == "0", (head, kv, w)
        tms.resume("kv")
        assert "partial" not in tms.summary()
        """,
    )
    assert "partial" in out


def test_pools_are_keyed_by_chunk_size(preloaded):
    # A stand-in for torch with CUDA (pools, use_mem_pool) shows which pool each region routes to.
    r = preloaded(
        """
        import contextlib, types
        routed = []
        class MemPool:
            def __init__(self, allocator=None):
                self.id = id(self)
        @contextlib.contextmanager
        def use_mem_pool(pool):
            routed.append(pool)
            yield
        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            yield
        cuda = types.SimpleNamespace(
            is_available=lambda: True, current_device=lambda: 0, MemPool=MemPool, graph=graph,
            use_mem_pool=use_mem_pool, is_current_stream_capturing=lambda: False,
        )
        sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)
        for chunk in (0, 4 << 20, 4 << 20, 8 << 20, None):
            with tms.region(tag="kv", chunk_size=chunk):
                pass
        with tms.region(tag="kv", chunk_size=4 << 20, enable_cpu_backup=True):
            pass
        ids = [id(p) for p in routed]
        assert ids[0] == ids[4] and ids[1] == ids[2], ids
        assert len({ids[0], ids[1], ids[3], ids[5]}) == 4, ids
        keys = sorted(k for k in tms._impl._mem_pools)
        print(keys)
        # cuda_graph takes the chunk size the same way.
        lib = tms._impl._binary_wrapper
        with tms.cuda_graph("G", tag="g", chunk_size=4 << 20):
            assert lib.tms_get_chunk_size() == 4 << 20
        assert lib.tms_get_chunk_size() == 0
        """,
    )
    out = r.stdout
    assert "4194304" in out and "8388608" in out, out


def test_the_log_counts_each_chunk_once(preloaded):
    out = run(
        preloaded,
        """
        import logging, sys
        p = chunked("kv", 4 * GRAN, GRAN, enable_cpu_backup=True)
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="LOG %(message)s")
        tms.pause_chunks("kv", [3, 1, 3])
        tms.resume_chunks(Buf(p, GRAN), [1, 1])
        """,
    )
    assert "LOG paused 2 chunks of tag 'kv'" in out, out
    assert "LOG resumed 1 chunks of the allocation" in out, out


# Another thread frees the chunked allocation and makes another one (under the same tag, or at
# the same address) right after the library answers one of a query's calls: `after_a_call(f)`
# runs f once, after the next chunk query the library answers. By address, `at(old, new)` hands
# the library old's address up to that change and new's after it, as the address would then
# resolve. The first call's room is made 4 chunks, so that small allocations outgrow it.
REPLACED_BETWEEN_CALLS = """
import torch_memory_saver.chunks as chunks_mod
chunks_mod._CHUNK_ROOM = 4
QUERIES = ("tms_get_num_chunks_for_tag", "tms_get_chunk_states", "tms_get_chunk_layout", "tms_chunks_of",
           "tms_chunk_states_at")
real = {q: getattr(lib, q) for q in QUERIES}
pending, calls = [], []
address = {}
def wrapped(q):
    def call(*args):
        if q in ("tms_chunks_of", "tms_chunk_states_at") and args[0] in address:
            args = (address[args[0]][bool(calls) and not pending],) + args[1:]
        calls.append(q)
        out = real[q](*args)
        todo = pending[:]
        del pending[:]
        for f in todo:
            f()
        return out
    return call
for q in QUERIES:
    setattr(lib, q, wrapped(q))
def after_a_call(f):
    del calls[:]
    pending.append(f)
def at(old, new):
    address[old] = (old, new)

def replace_kv(n, paused=()):
    '''Free the tag's allocation and make one of n chunks of 2 MiB, `paused` paused.'''
    def change():
        assert cuda_free(cur[0]) == 0
        cur[0] = chunked("kv", n * GRAN, GRAN, enable_cpu_backup=True)
        if paused:
            tms.pause_chunks("kv", list(paused))
    return change
"""


def test_a_chunk_query_answers_for_one_allocation_though_another_replaces_it_between_calls(preloaded):
    # States and layout are those of one allocation: the one the call found before the change,
    # or the one after it. Never a mix (room read for 6 chunks, 4 written: 2 made-up paused
    # chunks, or (0, 0) layout entries), nor a refusal of a buffer the caller never passed
    # ("room for 6 entries, but the allocation has 8 chunks").
    run(
        preloaded,
        REPLACED_BETWEEN_CALLS
        + textwrap.dedent("""
        cur = [chunked("kv", 6 * GRAN, GRAN, enable_cpu_backup=True)]
        six = ([True] * 6, [(i * GRAN, GRAN) for i in range(6)])
        four = ([True, False, True, True], [(i * GRAN, GRAN) for i in range(4)])
        eight = ([True] * 7 + [False], [(i * GRAN, GRAN) for i in range(8)])
        wrong = []
        def check(what, query, target, *answers):
            try:
                got = query(target)
            except tms_pkg.TorchMemorySaverError as e:
                got = f"{type(e).__name__}: {e}"
            if got not in answers:
                wrong.append(f"{what}: {got}")
        after_a_call(replace_kv(4, paused=[1]))
        check("states, 6 chunks then 4", tms.get_chunk_states, "kv", six[0], four[0])
        after_a_call(replace_kv(8, paused=[7]))
        check("states, 4 chunks then 8", tms.get_chunk_states, "kv", four[0], eight[0])
        after_a_call(replace_kv(6))
        check("layout, 8 chunks then 6", tms.get_chunk_layout, "kv", eight[1], six[1])
        after_a_call(replace_kv(4))
        check("layout, 6 chunks then 4", tms.get_chunk_layout, "kv", six[1], four[1])
        after_a_call(replace_kv(8))
        check("layout, 4 chunks then 8", tms.get_chunk_layout, "kv", four[1], eight[1])
        check("layout, 8 chunks", tms.get_chunk_layout, "kv", eight[1])

        # By address: old (6 chunks) is replaced by 4 chunks, chunk 1 paused, or by 8.
        old = chunked("by_addr_old", 6 * GRAN, GRAN)
        small = chunked("by_addr_small", 4 * GRAN, GRAN, enable_cpu_backup=True)
        tms.pause_chunks(Buf(small, GRAN), [1])
        large = chunked("by_addr_large", 8 * GRAN, GRAN)
        for new, states in ((small, four[0]), (large, [True] * 8)):
            at(old, new)
            after_a_call(lambda: None)
            what = f"states at an address, 6 chunks then {len(states)}"
            check(what, tms.get_chunk_states, Buf(old, GRAN), six[0], states)
        assert not wrong, "\\n".join(wrong)
        """),
    )


def test_a_chunk_query_that_keeps_finding_a_larger_allocation_is_refused_after_a_few_tries(preloaded):
    # Each call finds a larger allocation than the try before made room for: the query gives up
    # after its tries, saying why; once the allocation holds still it is answered.
    out = run(
        preloaded,
        REPLACED_BETWEEN_CALLS
        + textwrap.dedent("""
        cur = [chunked("kv", 5 * GRAN, GRAN, enable_cpu_backup=True)]
        size = [5]
        def grow():
            size[0] += 1
            replace_kv(size[0])()
            pending.append(grow)  # again after the next call
        for query in (tms.get_chunk_states, tms.get_chunk_layout):
            after_a_call(grow)
            e = raises(tms_pkg.InvalidStateError, query, "kv")
            print("REFUSED", e)
            del pending[:]
            assert len(query("kv")) == size[0]
        """),
    )
    assert "get_chunk_states('kv'): the chunked allocation had more chunks at each of 8 tries" in out, out
    assert "get_chunk_layout('kv'): the chunked allocation had more chunks at each of 8 tries" in out, out


def test_the_chunk_queries_write_one_entry_per_chunk_and_nothing_past_them(preloaded):
    # What get_chunk_states and get_chunk_layout read the chunk count from, given more room
    # than the allocation has chunks (tms.h says so); and too little room writes nothing.
    run(
        preloaded,
        """
        p = chunked("kv", 4 * GRAN, GRAN, enable_cpu_backup=True)
        tms.pause_chunks("kv", [2])
        # tms_get_chunk_states says true or false, tms_chunk_states_at a status.
        for call, args, ok in (("tms_get_chunk_states", (b"kv",), True), ("tms_chunk_states_at", (p + 5,), 0)):
            out = (ctypes.c_uint8 * 7)(*[0xAB] * 7)
            assert getattr(lib, call)(*args, out, 7) == ok, (call, lib.last_error())
            assert list(out) == [1, 1, 0, 1, 0xAB, 0xAB, 0xAB], (call, list(out))
            out = (ctypes.c_uint8 * 3)(*[0xAB] * 3)
            assert getattr(lib, call)(*args, out, 3) != ok, call
            assert "room for 3 entries, but the allocation has 4 chunks" in lib.last_error(), lib.last_error()
            assert list(out) == [0xAB] * 3, (call, list(out))
        offsets, sizes = (ctypes.c_size_t * 6)(*[7] * 6), (ctypes.c_size_t * 6)(*[7] * 6)
        assert lib.tms_get_chunk_layout(b"kv", offsets, sizes, 6) == 0, lib.last_error()
        assert list(offsets) == [0, GRAN, 2 * GRAN, 3 * GRAN, 7, 7] and list(sizes) == [GRAN] * 4 + [7, 7]
        offsets, sizes = (ctypes.c_size_t * 3)(*[7] * 3), (ctypes.c_size_t * 3)(*[7] * 3)
        assert lib.tms_get_chunk_layout(b"kv", offsets, sizes, 3) != 0
        assert list(offsets) == list(sizes) == [7] * 3
        """,
    )
