"""NCCL's communicators as the tag ``"nccl"`` through the Python API, on the simulated device:
the NCCL test double of the Rust tests (tests/c/fake_nccl.c, built here with the system C
compiler, with the fake CUDA runtime it allocates from) in a preloaded subprocess. Needs the
source tree's C files and ``cc``; skipped otherwise."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

C_DIR = Path(__file__).resolve().parents[2] / "tests" / "c"

NCCL_PRELUDE = """
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]

fake = ctypes.CDLL(os.environ["FAKE_NCCL"], mode=ctypes.RTLD_GLOBAL)
process = ctypes.CDLL(None)  # the global scope: the preloaded library's interposers come first

def make(lib=process):
    uid = UniqueId()
    fake.ncclGetUniqueId(ctypes.byref(uid))
    comm = ctypes.c_void_p()
    rc = lib.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0)
    assert rc == 0, rc
    return comm.value

def nccl_stats():
    return tag_stats("nccl")["nccl"]
"""


def snippet(code: str) -> str:
    """``code`` after the helpers above."""
    return NCCL_PRELUDE + textwrap.dedent(code)


@pytest.fixture(scope="module")
def fake_nccl(tmp_path_factory):
    """``{"new": libnccl.so.2 with ncclCommSuspend, "old": one without}``."""
    cc = shutil.which("cc")
    if cc is None or not (C_DIR / "fake_nccl.c").is_file():
        pytest.skip("needs the source tree's tests/c and a C compiler")
    d = tmp_path_factory.mktemp("fake-nccl")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libcudart.so"), str(C_DIR / "fake_cudart.c")], check=True)
    out = {}
    for name, flags in (("new", []), ("old", ["-DFAKE_NCCL_NO_SUSPEND"])):
        (d / name).mkdir()
        so = d / name / "libnccl.so.2"
        subprocess.run(
            [cc, *flags, "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o", str(so), str(C_DIR / "fake_nccl.c"),
             "-Wl,--no-as-needed", f"-L{d}", "-lcudart", f"-Wl,-rpath,{d}"],
            check=True,
        )
        out[name] = str(so)
    return out


def test_pause_and_resume_of_the_tag_and_the_settings(preloaded, fake_nccl):
    r = preloaded(
        snippet("""
        a, b = make(), make()
        s = nccl_stats()
        assert (s["communicators"], s["version"], s["registered_policy"]) == (2, "2.29.7", "keep"), s
        assert tms.nccl_in_all_tags is False and tms.nccl_registered_buffers == "keep"
        tms.pause("nccl")
        assert fake.fake_nccl_suspended() == 2
        t = tag_stats("nccl")
        assert (t["paused_allocations"], t["bytes_paused"]) == (2, 2 << 20), t
        tms.resume("nccl")
        assert fake.fake_nccl_suspended() == 0
        # Every tag includes them only when asked.
        tms.pause(); tms.resume()
        assert fake.fake_nccl_suspend_calls() == 2
        tms.nccl_in_all_tags = True
        tms.pause()
        assert fake.fake_nccl_suspended() == 2 and nccl_stats()["in_all_tags"] is True
        tms.resume()
        tms.nccl_in_all_tags = False
        # A registered buffer: kept mapped, or the pause refused by name.
        with tms.region(tag="kv"):
            rc, kv = cuda_malloc(4 << 20)
        h = ctypes.c_void_p()
        assert process.ncclCommRegister(ctypes.c_void_p(a), ctypes.c_void_p(kv), ctypes.c_size_t(4096), ctypes.byref(h)) == 0
        tms.pause("kv")
        assert tag_stats("kv")["active_allocations"] == 1
        tms.resume("kv")
        tms.nccl_registered_buffers = "refuse"
        try:
            tms.pause("kv")
            raise AssertionError("not refused")
        except tms_pkg.InvalidStateError as e:
            print("REFUSED", e)
        try:
            tms.nccl_registered_buffers = "sometimes"
            raise AssertionError("not refused")
        except tms_pkg.InvalidArgumentError:
            pass
        assert process.ncclCommDeregister(ctypes.c_void_p(a), h) == 0
        tms.pause("kv")
        assert tag_stats("kv")["paused_allocations"] == 1
        try:
            with tms.region(tag="nccl"):
                pass
            raise AssertionError("not refused")
        except tms_pkg.InvalidArgumentError as e:
            print("RESERVED", e)
        print(tms.summary())
        """),
        FAKE_NCCL=fake_nccl["new"],
    )
    assert "holds a buffer NCCL registered" in r.stdout and "ncclCommDeregister" in r.stdout, r.stdout
    assert 'tag "nccl" is reserved' in r.stdout
    assert "\nnccl " in r.stdout, "summary() has a row for the tag"


def test_communicators_made_through_a_handle_are_handed_over(preloaded, fake_nccl):
    preloaded(
        snippet("""
        c = make(fake)  # through NCCL's own handle: not interposed (pynccl wrappers do this)
        tms.pause("nccl")
        assert fake.fake_nccl_suspended() == 0, "not known yet"
        tms.add_nccl_communicators([c])
        tms.pause("nccl")
        assert fake.fake_nccl_suspended() == 1 and nccl_stats()["communicators"] == 1
        tms.resume("nccl")
        tms.remove_nccl_communicators()
        assert nccl_stats()["communicators"] == 0
        try:
            tms.add_nccl_communicators([0])
            raise AssertionError("not refused")
        except tms_pkg.InvalidArgumentError:
            pass
        # A value with no memory behind it would end the process in NCCL's first call on it.
        try:
            tms.add_nccl_communicators([c, 12345])
            raise AssertionError("not refused")
        except tms_pkg.InvalidArgumentError as e:
            assert "0x3039 is not an NCCL communicator" in str(e), e
        assert nccl_stats()["communicators"] == 0, "nothing of a refused call is kept"
        tms.add_nccl_communicators([c])
        assert nccl_stats()["communicators"] == 1
        """),
        FAKE_NCCL=fake_nccl["new"],
    )


def test_an_nccl_without_suspend_is_named(preloaded, fake_nccl):
    r = preloaded(
        snippet("""
        make()
        with tms.region(tag="kv"):
            rc, kv = cuda_malloc(4 << 20)
        try:
            tms.pause("nccl")
            raise AssertionError("not refused")
        except tms_pkg.UnsupportedError as e:
            print("UNSUPPORTED", e)
        tms.nccl_in_all_tags = True
        tms.pause()  # the memory pauses all the same
        assert tag_stats("kv")["paused_allocations"] == 1
        print("STATS", nccl_stats()["unsupported"])
        """),
        FAKE_NCCL=fake_nccl["old"],
    )
    assert "NCCL 2.21.5 has no ncclCommSuspend (needs \u2265 2.29.7)" in r.stdout, r.stdout


def test_a_job_wide_call_over_nccl_is_refused_at_once_by_a_rank_whose_communicators_are_suspended(
    preloaded, fake_nccl
):
    # torch_memory_saver.distributed over an NCCL group (a one-rank stand-in for torch's), on a
    # rank with nccl_in_all_tags on. Its own pause() of every tag suspended its communicators:
    # it cannot take part in a collective over them, so a job-wide resume of every tag is refused
    # before any. Resumed, it takes part, and refuses through the agreement, changing nothing.
    r = preloaded(
        snippet("""
        import types
        gathers = []
        def all_gather_object(out, obj, group=None):
            gathers.append(obj)
            out[0] = json.loads(json.dumps(obj))
        dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 0,
                                     get_world_size=lambda group=None: 1, all_gather_object=all_gather_object,
                                     get_backend=lambda group=None: "nccl")
        sys.modules["torch"] = types.SimpleNamespace(distributed=dist, cuda=types.SimpleNamespace(is_available=lambda: False))
        sys.modules["torch.distributed"] = dist
        sys.modules["numpy"] = types.ModuleType("numpy")
        from torch_memory_saver import distributed as tmsd
        make()
        with tms.region(tag="kv"):
            rc, kv = cuda_malloc(4 << 20)
        tms.nccl_in_all_tags = True
        tms.pause()
        assert fake.fake_nccl_suspended() == 1
        try:
            tmsd.resume()
            raise AssertionError("not refused")
        except tms_pkg.InvalidArgumentError as e:
            print("REFUSED", e)
        assert gathers == [] and fake.fake_nccl_suspended() == 1
        tms.resume()
        try:
            tmsd.pause()
            raise AssertionError("not refused")
        except tmsd.DistributedError as e:
            print("AGREED", sorted(e.failed))
        assert len(gathers) == 2 and fake.fake_nccl_suspended() == 0  # the outcome, the undo
        assert tag_stats("kv")["active_allocations"] == 1
        """),
        FAKE_NCCL=fake_nccl["new"],
    )
    assert "REFUSED every tag includes NCCL's communicators on this rank" in r.stdout, r.stdout
    assert "they are suspended" in r.stdout and "AGREED [0]" in r.stdout, r.stdout


def test_communicators_taken_back_are_not_handed_over_again_by_a_pause_under_way(monkeypatch):
    """A pause (or resume, or stats()) of another thread reads the communicators to hand over,
    then hands them over. Where ``remove_nccl_communicators`` ran in between, the pause handed
    over the communicator it had read after the removal had returned, and the program then
    destroys it: the library would suspend a destroyed communicator at the next pause of
    ``"nccl"``. With a stand-in library that records what it is handed, and holds the pause's
    hand-over back till the removal has returned (or for 2 s, where the removal waits for it)."""
    import threading

    from torch_memory_saver import saver

    handed: list = []
    pauser = None
    removed = threading.Event()
    holding = threading.Event()

    class Lib:
        @staticmethod
        def tms_nccl_adopt(arr, n):
            if threading.current_thread() is pauser:
                holding.set()
                removed.wait(timeout=2)
            handed.append([arr[i] for i in range(n)])
            return 0

        @staticmethod
        def check(status):
            assert status == 0

    impl = saver._TorchMemorySaverImpl("preload")
    monkeypatch.setattr(impl, "_library", lambda: Lib)
    comm = 0x1000
    impl.add_nccl_communicators([comm])
    assert handed == [[comm]]
    errors: list = []

    def run(fn):
        try:
            fn()
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    def remove():
        impl.remove_nccl_communicators([comm])
        removed.set()

    pauser = threading.Thread(target=run, args=(lambda: impl._hand_over_nccl(None),))
    pauser.start()
    assert holding.wait(timeout=10)
    remover = threading.Thread(target=run, args=(remove,))
    remover.start()
    pauser.join(timeout=10)
    remover.join(timeout=10)
    assert not errors, errors
    assert handed[-1] == [], f"a communicator taken back was handed over again after: {handed}"
