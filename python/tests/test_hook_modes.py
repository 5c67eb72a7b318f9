"""Hook modes registered with ``register_hook_mode`` (the existing library's hook-mode registry,
which integrations of out-of-process memory services build on), without torch: a registered
mode's factory builds the facade's ``_impl`` once, at first use, and every call goes to it;
``_uses_preload()`` and ``configure_subprocess()`` follow the mode's ``uses_preload``; the
builtin modes are registered the same way; bad registrations and unregistered modes are clear
errors. Each test runs in a fresh interpreter: registrations are process-wide."""

from __future__ import annotations

import subprocess
import textwrap

from conftest import clean_env, run_py

CUSTOM = """
import contextlib
from torch_memory_saver import entrypoint, register_hook_mode
calls = []
made = []

class ServiceSaver:
    '''An allocator of its own (an out-of-process memory service, say): no hook_mode attribute.'''
    def __init__(self):
        made.append(self)
    @contextlib.contextmanager
    def region(self, tag, enable_cpu_backup):
        calls.append(("region", tag, enable_cpu_backup)); yield
    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup):
        calls.append(("cuda_graph", cuda_graph, tag)); yield
    def pause(self, tag=None):
        calls.append(("pause", tag))
    def resume(self, tag=None):
        calls.append(("resume", tag))
    def pause_chunks(self, tag, chunk_indices):
        calls.append(("pause_chunks", tag, list(chunk_indices)))
    def get_num_chunks(self, tag):
        return 7

def mapped_libtms():
    with open("/proc/self/maps") as f:
        return "libtms" in f.read()
"""


def run(body: str, env: dict) -> subprocess.CompletedProcess:
    return run_py(CUSTOM + textwrap.dedent(body), env)


def test_a_registered_mode_builds_the_impl_that_takes_every_call():
    r = run(
        """
        register_hook_mode("service", ServiceSaver, uses_preload=False)
        assert entrypoint._HOOK_MODE_REGISTRY["service"] == (ServiceSaver, False)
        tms.hook_mode = "service"
        assert tms.hook_mode == "service" and tms._uses_preload() is False and not made
        os.environ["LD_PRELOAD"] = "/elsewhere/libother.so"
        with tms_pkg.configure_subprocess():
            print("CHILD", os.environ["LD_PRELOAD"])  # left alone: the mode needs no preload
        with tms.region(tag="weights", enable_cpu_backup=True):
            pass
        with tms.cuda_graph("G", tag="graph"):
            pass
        tms.pause("kv")
        tms.resume()
        tms.pause_chunks(tag="kv", chunk_indices=range(2))
        assert tms.get_num_chunks(tag="kv") == 7
        assert len(made) == 1 and tms._impl is made[0], "one factory call, at first use"
        assert tms.hook_mode == "service" and tms._uses_preload() is False
        tms.hook_mode = "service"  # the same mode: fine
        import pickle
        t = tms_pkg.TorchMemorySaver()
        t.hook_mode = "service"
        assert pickle.loads(pickle.dumps(t)).hook_mode == "service", "as spawned workers get it"
        t.pause("a")
        assert isinstance(pickle.loads(pickle.dumps(t))._impl, ServiceSaver)
        for other in ("preload", "torch"):
            try:
                tms.hook_mode = other
                raise SystemExit("should refuse")
            except tms_pkg.InvalidStateError as e:
                assert isinstance(e, RuntimeError) and "'service'" in str(e), e
        for c in calls:
            print(c)
        print("LIBTMS", mapped_libtms())
        """,
        clean_env(),
    )
    assert r.stdout.splitlines() == [
        "CHILD /elsewhere/libother.so",
        "('region', 'weights', True)",
        "('cuda_graph', 'G', 'graph')",
        "('pause', 'kv')",
        "('resume', None)",
        "('pause_chunks', 'kv', [0, 1])",
        "('pause', 'a')",
        "LIBTMS False",  # the service's mode never loaded this library
    ], r.stdout


def test_builtin_modes_are_registered_and_keep_the_preload(tmp_path):
    r = run(
        """
        from torch_memory_saver.hooks import mode_preload
        reg = entrypoint._HOOK_MODE_REGISTRY
        assert [(m, reg[m].uses_preload) for m in ("preload", "torch")] == [("preload", True), ("torch", True)]
        assert tms.hook_mode == "preload" and tms._uses_preload() is True
        tms.hook_mode = "torch"
        assert tms._uses_preload() is True
        with tms_pkg.configure_subprocess():
            print("TORCH", os.environ["LD_PRELOAD"] == mode_preload.preload_library_path())
        assert "LD_PRELOAD" not in os.environ
        # A mode that uses the preload, as the builtins do.
        register_hook_mode("with-preload", ServiceSaver)
        assert entrypoint._HOOK_MODE_REGISTRY["with-preload"].uses_preload is True
        t = tms_pkg.TorchMemorySaver()
        t.hook_mode = "with-preload"
        assert t._uses_preload() is True
        # The builtin factories give the package's own implementation of that mode.
        impl = reg["torch"].factory()
        assert isinstance(impl, entrypoint._TorchMemorySaverImpl) and impl.hook_mode == "torch"
        tms._ensure_initialized()
        assert isinstance(tms._impl, entrypoint._TorchMemorySaverImpl) and tms._impl.hook_mode == "torch"
        print("OK", tms.pause() is None)
        """,
        clean_env(TMS_BACKEND="sim", TMS_SOCKET_DIR=str(tmp_path)),
    )
    assert r.stdout.splitlines() == ["TORCH True", "OK True"], r.stdout


def test_a_mode_set_before_registration_or_after_a_read_of_available():
    # sglang selects the mode in each process, and the plugin registers it there: either order
    # before first use works. A facade whose builtin implementation was made (reading
    # `available` makes it) but never used takes a registered mode as well.
    r = run(
        """
        tms.hook_mode = "service"
        register_hook_mode("service", ServiceSaver, uses_preload=False)
        tms.pause("x")
        t = tms_pkg.TorchMemorySaver()
        t.available
        assert isinstance(t._impl, entrypoint._TorchMemorySaverImpl)
        t.hook_mode = "service"
        assert t._impl is None and t.hook_mode == "service"
        t.resume("y")
        print(calls, len(made))
        """,
        clean_env(),
    )
    assert r.stdout.strip() == "[('pause', 'x'), ('resume', 'y')] 2", r.stdout


def test_bad_registrations_and_unregistered_modes_are_clear_errors():
    r = run(
        """
        def expect(exc, f, *args, **kw):
            try:
                f(*args, **kw)
            except exc as e:
                print(type(e).__name__, e)
                return e
            raise SystemExit(f"{args} did not raise {exc.__name__}")
        register_hook_mode("service", ServiceSaver, uses_preload=False)
        expect(ValueError, register_hook_mode, "service", ServiceSaver)
        expect(ValueError, register_hook_mode, "preload", ServiceSaver)
        expect(ValueError, register_hook_mode, "", ServiceSaver)
        expect(TypeError, register_hook_mode, None, ServiceSaver)
        expect(TypeError, register_hook_mode, "gms", "ServiceSaver")
        assert set(entrypoint._HOOK_MODE_REGISTRY) == {"preload", "torch", "service"}
        # A mode this process never registered (a spawned child that skipped the plugin, say):
        # kept when set, refused by _uses_preload() and at first use, naming the remedy.
        tms.hook_mode = "gms"
        assert tms._impl_ctor_kwargs == {"hook_mode": "gms"}
        e = expect(ValueError, tms._uses_preload)
        assert isinstance(e, RuntimeError), "a RuntimeError too, as the existing library raises"
        expect(ValueError, tms.pause)
        assert tms._impl is None
        # configure_subprocess keeps the preload for it, as integrations that patch
        # _ensure_initialized (and name their mode themselves) had it.
        os.environ.pop("LD_PRELOAD", None)
        with tms_pkg.configure_subprocess():
            print("PRELOAD", bool(os.environ.get("LD_PRELOAD")))
        # A factory that fails leaves the facade as it was; one that gives nothing is refused.
        def broken():
            raise OSError("service not running")
        register_hook_mode("broken", broken)
        register_hook_mode("nothing", lambda: None)
        t = tms_pkg.TorchMemorySaver()
        t.hook_mode = "broken"
        expect(OSError, t.pause)
        assert t._impl is None and t.hook_mode == "broken"
        t.hook_mode = "nothing"
        expect(TypeError, t.pause)
        assert t._impl is None
        """,
        clean_env(),
    )
    lines = r.stdout.splitlines()
    assert lines[:5] == [
        "InvalidArgumentError hook mode 'service' is already registered",
        "InvalidArgumentError hook mode 'preload' is already registered",
        "InvalidArgumentError hook mode name must not be empty",
        "TypeError hook mode name must be a str, not NoneType",
        "TypeError factory of hook mode 'gms' must be callable (it makes the implementation), not str",
    ], r.stdout
    assert lines[5] == lines[6] and "not 'gms'" in lines[5] and "register_hook_mode" in lines[5], r.stdout
    assert lines[7:] == [
        "PRELOAD True",
        "OSError service not running",
        "TypeError the factory of hook mode 'nothing' returned None, not an implementation",
    ], r.stdout


def test_an_unregistered_mode_set_once_built_is_refused_naming_every_registered_mode():
    # docs/python-api.md: refused at once, "naming the registered modes": the message must
    # offer the registered "service", not say only the builtin two are possible.
    r = run(
        """
        register_hook_mode("service", ServiceSaver, uses_preload=False)
        tms.available
        try:
            tms.hook_mode = "gms"
        except tms_pkg.InvalidArgumentError as e:
            print(e)
        print(tms.hook_mode)
        """,
        clean_env(),
    )
    refused, mode = r.stdout.splitlines()
    assert "'service'" in refused and "not 'gms'" in refused and "register_hook_mode" in refused, refused
    assert mode == "preload"


def test_a_registered_mode_whose_factory_gives_the_package_implementation_keeps_its_name(tmp_path):
    # A mode registered under a name of its own whose factory builds the package's own
    # implementation (torch mode whose children get no preload, say) was reported, once built,
    # as the builtin mode inside ("torch"): _uses_preload() followed "torch" (True), so
    # configure_subprocess() preloaded children anyway, and setting the mode's own name again
    # raised InvalidStateError "hook_mode is already 'torch' and in use".
    r = run(
        """
        register_hook_mode("torch-nopreload", lambda: entrypoint._TorchMemorySaverImpl(hook_mode="torch"),
                           uses_preload=False)
        tms.hook_mode = "torch-nopreload"
        assert tms.hook_mode == "torch-nopreload" and tms._uses_preload() is False
        tms._ensure_initialized()
        assert isinstance(tms._impl, entrypoint._TorchMemorySaverImpl) and tms._impl.hook_mode == "torch"
        tms.pause()  # in use now
        assert tms.hook_mode == "torch-nopreload", tms.hook_mode
        assert tms._uses_preload() is False
        os.environ["LD_PRELOAD"] = "/elsewhere/libother.so"
        with tms_pkg.configure_subprocess():
            print("CHILD", os.environ["LD_PRELOAD"])
        tms.hook_mode = "torch-nopreload"  # the same mode: fine
        try:
            tms.hook_mode = "preload"
            raise SystemExit("should refuse")
        except tms_pkg.InvalidStateError as e:
            assert "'torch'" in str(e) or "'torch-nopreload'" in str(e), e
        # Before use, a builtin mode switches such an implementation, and is what it reports.
        t = tms_pkg.TorchMemorySaver()
        t.hook_mode = "torch-nopreload"
        t._ensure_initialized()
        t.hook_mode = "preload"
        assert t.hook_mode == "preload" and t._impl.hook_mode == "preload" and t._uses_preload() is True
        print("OK")
        """,
        clean_env(TMS_BACKEND="sim", TMS_SOCKET_DIR=str(tmp_path)),
    )
    assert r.stdout.splitlines() == ["CHILD /elsewhere/libother.so", "OK"], r.stdout
