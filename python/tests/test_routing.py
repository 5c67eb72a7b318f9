"""Routing allocations to a region's pool from several threads at once, with a stand-in for
torch that enforces what PyTorch does: one thread at a time may route to a pool
("beginAllocateToPool: already recording to mempool_id"). A region entered by a second thread
while the first is inside it must get a sibling pool of the same kind, not PyTorch's error
(seen on an H200 with real threads before the fix)."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest

from torch_memory_saver import regions, saver


class FakeTorch:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recording: dict = {}
        self.made = 0
        # The current device (one for the process: the tests set it in one thread), and the
        # device each pool routed to is routed on.
        self.device = 0
        self.devices: dict = {}
        outer = self

        class Cuda:
            @staticmethod
            @contextlib.contextmanager
            def use_mem_pool(pool, device=None):
                with outer.lock:
                    if id(pool) in outer.recording:
                        raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
                    outer.recording[id(pool)] = threading.get_ident()
                    outer.devices[id(pool)] = outer.device if device is None else device
                try:
                    yield
                finally:
                    with outer.lock:
                        del outer.recording[id(pool)]
                        del outer.devices[id(pool)]

            @staticmethod
            def current_device():
                return outer.device

            @staticmethod
            def is_current_stream_capturing():
                return False

            @staticmethod
            def MemPool():
                return object()

        self.cuda = Cuda

    def new_pool(self):
        with self.lock:
            self.made += 1
        return object()


def _impl_over(monkeypatch, torch, mode, flags=None):
    """An implementation of hook mode ``mode`` whose regions and captures route with ``torch``
    (put in ``sys.modules``), without the library: its flags (``flags`` where given, else
    nothing) and chunk checks stand in."""
    import sys

    monkeypatch.setitem(sys.modules, "torch", torch)
    impl = saver._TorchMemorySaverImpl(mode)
    monkeypatch.setattr(impl, "_library", lambda: None)
    monkeypatch.setattr(impl, "_flags", flags or (lambda *a: contextlib.nullcontext()))
    monkeypatch.setattr(impl, "_chunk_misfits", lambda *a: contextlib.nullcontext())
    return impl


def _captures_routing_over(monkeypatch):
    """A fake torch whose graph captures do nothing (so a capture's place on a route stack is
    all there is of it) and a preload-mode implementation routing with it: (torch, impl)."""
    torch = FakeTorch()

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        yield

    torch.cuda.graph = staticmethod(graph)
    impl = _impl_over(monkeypatch, torch, "preload")
    monkeypatch.setattr(regions, "_torch_if_cuda", lambda: torch)
    return torch, impl


def _own_routing(monkeypatch, torch):
    """Route with ``torch`` through a routing state of the test's own (the module's is shared
    by every test): returned, to look into."""
    monkeypatch.setattr(regions, "_torch_if_cuda", lambda: torch)
    routing = regions._Routing()
    monkeypatch.setattr(regions, "_routing", routing)
    return routing


def _leave_unfinished_in_a_cycle(block):
    """Enter ``block()`` inside a generator left unfinished, in a reference cycle: the block is
    ended by whichever garbage collection comes next, in whatever thread makes it."""

    def left_unfinished():
        with block():
            yield

    gen = left_unfinished()
    next(gen)
    loop = [gen]
    loop.append(loop)


def _thread_in_region(impl, tag, inside, may_leave, errors):
    """A thread, not started, that enters ``impl.region(tag)``, sets ``inside`` and stays till
    ``may_leave`` is set; what it raises goes to ``errors`` (a failure fails the test)."""

    def body():
        try:
            with impl.region(tag):
                inside.set()
                assert may_leave.wait(timeout=10)
        except Exception as e:  # collected
            errors.append(repr(e))

    return threading.Thread(target=body)


def test_threads_in_the_same_region_get_pools_of_their_own():
    impl = saver._TorchMemorySaverImpl("torch")
    torch = FakeTorch()
    pool = object()
    inside = threading.Barrier(4)
    used, errors = [], []

    def one():
        try:
            with impl._routed(torch, pool, torch.new_pool):
                with torch.lock:
                    used.append(next(p for p, t in torch.recording.items() if t == threading.get_ident()))
                inside.wait(timeout=10)  # all four inside at once
        except Exception as e:  # collected: a failure of any thread fails the test
            errors.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(used)) == 4 and id(pool) in used, used
    assert torch.made == 3
    # Once they have left, the pool and its siblings are free again: four more threads reuse
    # them and make none.
    used.clear()
    inside = threading.Barrier(4)
    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(used)) == 4 and torch.made == 3, (errors, used, torch.made)
    assert not regions._routing.busy, regions._routing.busy


def test_one_thread_nests_routes_to_the_same_pool():
    impl = saver._TorchMemorySaverImpl("torch")
    torch = FakeTorch()
    pool = object()
    with impl._routed(torch, pool, torch.new_pool):
        with impl._routed(torch, pool, torch.new_pool):
            assert list(torch.recording) == [id(pool)]
        assert list(torch.recording) == [id(pool)]
    assert torch.made == 0 and not torch.recording


def test_a_dropped_pool_that_needed_a_sibling_goes_with_its_siblings(monkeypatch):
    """``_mem_pools.pop(key)`` drops a region's pool (saver.py: "Popping one drops it"), also
    one that two threads were inside at once (which made it a sibling): nothing of this package
    may keep the pool, or its sibling, alive after that."""
    import gc
    import weakref

    class Pool:  # a MemPool stand-in that can be weakly referenced, as torch.cuda.MemPool can
        pass

    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    refs = []

    def new_pool(_torch):
        p = Pool()
        refs.append(weakref.ref(p))
        return p

    monkeypatch.setattr(impl, "_new_pool", new_pool)
    key = ("kv", False, False, "", 0)  # as impl._pool keys the region pool of tag "kv"
    impl._mem_pools[key] = new_pool(torch)
    both = threading.Barrier(2)
    errors = []

    def one():
        try:
            pool = impl._mem_pools[key]
            with impl._routed(torch, pool, lambda: impl._new_pool(torch)):
                both.wait(timeout=10)  # both threads inside at once: one gets a sibling
        except Exception as e:  # collected: a failure of any thread fails the test
            errors.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(refs) == 2, refs  # the region's pool and one sibling
    impl._mem_pools.pop(("kv", False))  # the existing library's key: drops the tag's pool
    gc.collect()
    assert [r() for r in refs] == [None, None], "a dropped pool (or its sibling) is still referenced"


def _pools_telling_their_end(torch):
    """Make ``torch.cuda.MemPool`` a stand-in whose destruction while a thread routes is
    recorded in the list returned."""
    destroyed_while_routing = []

    class Pool:
        def __del__(self):
            with torch.lock:
                if torch.recording:
                    destroyed_while_routing.append(dict(torch.recording))

    torch.cuda.MemPool = staticmethod(Pool)
    return destroyed_while_routing


def test_a_disable_pool_is_never_destroyed_while_another_thread_routes(monkeypatch):
    """``disable()``'s pool of its own (``_routed(torch, None)``) may be destroyed only while no
    thread routes (PyTorch asserts, ending the process, otherwise: see ``_Routing``). Thread A
    leaves its block, its pool is retired while no one routes; thread B then enters a region
    before A has finished leaving: A's pool must not be destroyed under B's route."""
    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    destroyed_while_routing = _pools_telling_their_end(torch)
    b_inside, b_may_leave = threading.Event(), threading.Event()
    real_collect = regions._routing.collect
    fired = []

    def collect(t):
        retiring = bool(regions._routing.retired)  # A's pool was just retired (not a route's end)
        real_collect(t)
        if threading.current_thread() is main and retiring and not fired:
            fired.append(1)
            b.start()  # B routes while A is between retiring its pool and leaving the block
            assert b_inside.wait(timeout=10)

    main = threading.current_thread()
    errors = []

    def other():
        try:
            with impl._routed(torch, object(), torch.new_pool):
                b_inside.set()
                b_may_leave.wait(timeout=10)
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    b = threading.Thread(target=other)
    monkeypatch.setattr(regions._routing, "collect", collect)
    with impl._routed(torch, None):
        pass
    b_may_leave.set()
    b.join()
    assert fired and not errors, (fired, errors)
    assert not destroyed_while_routing, "disable()'s pool was destroyed while another thread routed"


def test_a_pool_is_never_destroyed_while_a_thread_is_starting_its_route():
    """A thread routes from the moment PyTorch's ``use_mem_pool`` is entered; it must count as
    routing from then on (``_Routing.active``), or a ``disable()`` pool retired meanwhile in
    another thread is destroyed under its route (PyTorch asserts, ending the process)."""
    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    destroyed_while_routing = _pools_telling_their_end(torch)
    real_use = torch.cuda.use_mem_pool
    b_routing, b_may_go_on = threading.Event(), threading.Event()
    region_pool = object()

    @contextlib.contextmanager
    def use_mem_pool(pool):
        with real_use(pool):
            if pool is region_pool:
                b_routing.set()  # B routes to the region's pool now...
                b_may_go_on.wait(timeout=10)  # ...and is held here, at the start of its route
            yield

    torch.cuda.use_mem_pool = staticmethod(use_mem_pool)
    errors = []

    def other():
        try:
            with impl._routed(torch, region_pool, torch.new_pool):
                pass
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    b = threading.Thread(target=other)
    with impl._routed(torch, None):  # A: a disable() block
        b.start()
        assert b_routing.wait(timeout=10)
    b_may_go_on.set()
    b.join()
    assert not errors, errors
    assert not destroyed_while_routing, "disable()'s pool was destroyed while another thread routed"


def test_no_route_starts_while_a_retired_pool_is_destroyed():
    """``collect`` destroys retired pools after letting go of its lock (a pool's end may run
    code that routes again); a thread entering a region meanwhile must wait for the end, or
    PyTorch sees a pool destroyed under its route (and asserts, ending the process)."""
    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    destroyed_while_routing = _pools_telling_their_end(torch)
    dying, may_die = threading.Event(), threading.Event()

    class Slow(torch.cuda.MemPool):
        def __del__(self):
            dying.set()
            may_die.wait(timeout=10)
            super().__del__()

    torch.cuda.MemPool = staticmethod(Slow)
    b_routed = threading.Event()
    errors = []

    def disable_block():  # A: leaving it destroys its own pool, slowly
        with impl._routed(torch, None):
            pass

    def region():  # B: enters a region while A's pool is being destroyed
        try:
            with impl._routed(torch, object(), torch.new_pool):
                b_routed.set()
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    a, b = threading.Thread(target=disable_block), threading.Thread(target=region)
    a.start()
    assert dying.wait(timeout=10)
    b.start()
    routed_early = b_routed.wait(timeout=0.5)
    may_die.set()
    a.join()
    b.join()
    assert not routed_early, "B routed while A's pool was being destroyed"
    assert b_routed.is_set() and not errors, errors
    assert not destroyed_while_routing
    assert regions._routing.destroying is None and not regions._routing.active


def test_a_graph_captured_inside_a_region_is_not_routed_to_the_regions_pool(monkeypatch):
    """PyTorch serves an allocation from the first pool routed to that takes it, and a region's
    route takes every allocation of its thread: a capture inside ``region()`` must suspend the
    region's route, or the graph's memory is the region's (its tag, and a pool whose freed
    blocks later tensors reuse while the graph replays them). A region opened inside the capture
    routes as usual and, on leaving, restarts nothing; the region's route is back after."""

    torch = FakeTorch()
    seen = []

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        seen.append(("capture", dict(torch.recording)))
        yield

    torch.cuda.graph = staticmethod(graph)
    impl = _impl_over(monkeypatch, torch, "preload")
    region_pool, inner_pool = object(), object()
    with impl._routed(torch, region_pool, torch.new_pool):
        with impl.cuda_graph("G", tag="graph"):
            seen.append(("in capture", dict(torch.recording)))
            with impl._routed(torch, inner_pool, torch.new_pool):
                seen.append(("inner region", dict(torch.recording)))
            seen.append(("after inner", dict(torch.recording)))
        seen.append(("after capture", dict(torch.recording)))
    me = threading.get_ident()
    assert seen == [
        ("capture", {}),
        ("in capture", {}),
        ("inner region", {id(inner_pool): me}),
        ("after inner", {}),
        ("after capture", {id(region_pool): me}),
    ], seen
    assert not torch.recording and not regions._routing.active


@pytest.mark.parametrize("drop", ["del", "pop", "replace"])
@pytest.mark.parametrize("inside", [1, 2])
def test_a_dropped_region_pool_is_never_destroyed_while_another_thread_routes(monkeypatch, drop, inside):
    """A region's pool dropped from ``_mem_pools`` (``del``, ``pop`` or ``[] =``, which
    ``_PoolMap`` documents) while threads are inside the region is kept alive by their routes
    alone; the last of them to leave must not destroy it, nor the sibling made for a second
    thread inside (``inside=2``), while another thread routes to another region's pool (PyTorch
    asserts, ending the process: see ``_Routing``). Once no thread routes, they go."""
    import gc
    import weakref

    torch = FakeTorch()
    destroyed_while_routing = _pools_telling_their_end(torch)
    torch.cuda.current_device = staticmethod(lambda: 0)
    impl = _impl_over(monkeypatch, torch, "torch")
    made = []

    def new_pool(_torch):
        p = torch.cuda.MemPool()
        made.append(weakref.ref(p))
        return p

    monkeypatch.setattr(impl, "_new_pool", new_pool)
    all_inside = threading.Barrier(inside + 2)  # the dropped region's threads, B and this one
    kv_may_leave, b_may_leave = threading.Event(), threading.Event()
    errors = []

    def in_region(tag, may_leave):
        try:
            with impl.region(tag):
                all_inside.wait(timeout=10)
                assert may_leave.wait(timeout=10)
        except Exception as e:  # collected: a failure of any thread fails the test
            errors.append(repr(e))

    kv = [threading.Thread(target=in_region, args=("kv", kv_may_leave)) for _ in range(inside)]
    b = threading.Thread(target=in_region, args=("other", b_may_leave))
    for t in (*kv, b):
        t.start()
    all_inside.wait(timeout=10)
    assert len(made) == inside + 1, made  # kv's pool (and its sibling), other's pool
    other = weakref.ref(impl._mem_pools[("other", False)])
    kv_pools = [r for r in made if r() is not other()]  # kv's pool, and its sibling
    if drop == "del":
        del impl._mem_pools[("kv", False)]  # the existing library's key: drops the tag's pool
    elif drop == "pop":
        impl._mem_pools.pop(("kv", False))
    else:
        impl._mem_pools[("kv", False)] = object()  # the tag's next region allocates from this one
    kv_may_leave.set()  # the kv threads leave while B still routes to other's pool
    for t in kv:
        t.join()
    b_may_leave.set()
    b.join()
    assert not errors, errors
    assert not destroyed_while_routing, "a dropped region pool was destroyed while another thread routed"
    gc.collect()
    assert [r() for r in kv_pools] == [None] * inside, "the dropped pool (or its sibling) is still referenced"
    assert other() is not None  # other's pool, still in _mem_pools


def test_nothing_keeps_a_dropped_region_pool_past_its_routes_end(monkeypatch):
    """The route's end hands a region's pool to ``_routing.retire``, and ``collect`` lets it go
    at once where no thread routes: no other reference of this package may outlive that (the
    region's own, or its ``with`` statement's), or where ``_mem_pools`` dropped the pool, it is
    destroyed with that one, after a thread B may have started routing (PyTorch asserts, ending
    the process). Thread A leaves the region whose pool it dropped; B enters another region
    after A's route has ended, while A's region is still leaving (its flags)."""
    import gc
    import weakref

    torch = FakeTorch()
    destroyed_while_routing = _pools_telling_their_end(torch)
    torch.cuda.current_device = staticmethod(lambda: 0)
    b_inside, b_may_leave = threading.Event(), threading.Event()
    errors = []

    @contextlib.contextmanager
    def flags(lib, enabled, tag, *rest):
        yield
        if tag == "kv":  # A's route has ended; its region has not yet
            b.start()
            assert b_inside.wait(timeout=10)

    impl = _impl_over(monkeypatch, torch, "torch", flags)
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())

    b = _thread_in_region(impl, "other", b_inside, b_may_leave, errors)
    with impl.region("kv"):
        kv = weakref.ref(impl._mem_pools[("kv", False)])
        del impl._mem_pools[("kv", False)]  # A's route holds the pool alone now
    b_may_leave.set()
    b.join()
    assert not errors, errors
    assert not destroyed_while_routing, "a dropped region pool was destroyed while another thread routed"
    gc.collect()
    assert kv() is None, "the dropped pool is still referenced"


@pytest.mark.parametrize("drop", ["del", "pop", "replace", "clear", "popitem", "update", "ior"])
def test_a_pool_dropped_from_the_map_is_never_destroyed_while_another_thread_routes(monkeypatch, drop):
    """A region's pool that no thread routes to, dropped from ``_mem_pools`` (``del``, ``pop``,
    ``[] =``, ``clear``) while thread B routes to another region's pool: the map held its last
    reference, and its destruction under B's route would end the process (see ``_Routing``).
    It goes once B has left."""
    import gc
    import weakref

    torch = FakeTorch()
    destroyed_while_routing = _pools_telling_their_end(torch)
    torch.cuda.current_device = staticmethod(lambda: 0)
    impl = _impl_over(monkeypatch, torch, "torch")
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())
    with impl.region("kv"):
        pass
    kv = weakref.ref(impl._mem_pools[("kv", False)])
    b_inside, b_may_leave = threading.Event(), threading.Event()
    errors = []

    t = _thread_in_region(impl, "other", b_inside, b_may_leave, errors)
    t.start()
    assert b_inside.wait(timeout=10)
    if drop == "del":
        del impl._mem_pools[("kv", False)]
    elif drop == "pop":
        impl._mem_pools.pop(("kv", False))  # the caller drops what it was given at once
    elif drop == "replace":
        impl._mem_pools[("kv", False)] = torch.cuda.MemPool()
    elif drop == "popitem":
        while kv() in impl._mem_pools.values():
            impl._mem_pools.popitem()
    elif drop in ("update", "ior"):
        full = next(k for k in dict.keys(impl._mem_pools) if k[0] == "kv")
        if drop == "update":
            impl._mem_pools.update({full: torch.cuda.MemPool()})
        else:
            impl._mem_pools |= {full: torch.cuda.MemPool()}
    else:
        impl._mem_pools.clear()
    gc.collect()
    assert not destroyed_while_routing, "a pool dropped from the map was destroyed while another thread routed"
    assert kv() is not None
    b_may_leave.set()
    t.join()
    assert not errors, errors
    gc.collect()
    assert kv() is None, "the dropped pool outlived every route"
    assert not destroyed_while_routing


def test_a_pool_retired_while_retired_pools_are_destroyed_goes_too():
    """``collect`` destroys retired pools outside its lock, and a pool's end may run Python code
    that routes again (``_Routing``): a ``disable()`` block there retires its own pool while the
    destruction is under way, which ``collect`` leaves to the destruction. That pool must go
    with it once no route is active, not wait in ``retired`` (with its cached blocks) for some
    later route's end anywhere in the process, which may never come."""
    import gc
    import weakref

    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    destroyed_while_routing = _pools_telling_their_end(torch)
    Pool = torch.cuda.MemPool
    made = []

    def plain():
        p = Pool()
        made.append(weakref.ref(p))
        return p

    class Reentrant(Pool):
        def __del__(self):
            torch.cuda.MemPool = staticmethod(plain)
            with impl._routed(torch, None):  # a disable() block, run by this pool's end
                pass
            super().__del__()

    torch.cuda.MemPool = staticmethod(Reentrant)
    with impl._routed(torch, None):  # a disable() block: leaving it destroys its pool
        pass
    gc.collect()
    assert len(made) == 1, made  # the inner block ran, with a pool of its own
    assert made[0]() is None and not regions._routing.retired, (
        "the pool retired during the destruction was kept past it",
        regions._routing.retired,
    )
    assert not destroyed_while_routing
    assert regions._routing.destroying is None and not regions._routing.active


def _torch_without_a_device():
    """FakeTorch as torch is where CUDA is not initialized and cannot be (no driver, no
    device, a CPU build, a forked child): asking whether the stream captures raises."""
    torch = FakeTorch()

    def is_current_stream_capturing():
        raise RuntimeError("CUDA error: CUDA driver version is insufficient for CUDA runtime version")

    torch.cuda.is_current_stream_capturing = staticmethod(is_current_stream_capturing)
    torch.cuda.is_initialized = staticmethod(lambda: False)
    return torch


@pytest.mark.parametrize("torch_kind", ["stand-in", "real"])
@pytest.mark.parametrize("drop", ["del", "pop", "replace", "clear"])
def test_dropping_a_pool_from_the_map_needs_no_device(monkeypatch, drop, torch_kind):
    """``_mem_pools`` is a dict integrations read and patch (see ``_PoolMap``), also where torch
    is imported but CUDA is not initialized (their CPU tests, a process that has not touched
    the device yet): dropping an entry there must not ask CUDA whether a capture is under way
    (it raises, or initializes CUDA). No capture can be under way before CUDA is initialized."""
    import sys

    if torch_kind == "real":
        torch = pytest.importorskip("torch")
        if torch.cuda.is_initialized():
            pytest.skip("CUDA is initialized in this process")
    else:
        torch = _torch_without_a_device()
        monkeypatch.setitem(sys.modules, "torch", torch)
    impl = saver._TorchMemorySaverImpl("torch")
    key = ("kv", False, False, "", 0)
    impl._mem_pools[key] = object()
    if drop == "del":
        del impl._mem_pools[("kv", False)]
    elif drop == "pop":
        impl._mem_pools.pop(key)
    elif drop == "replace":
        impl._mem_pools[key] = object()
    else:
        impl._mem_pools.clear()
    assert not regions._routing.retired


@pytest.mark.parametrize("inner", ["cuda_graph", "disable", "region"])
def test_a_suspended_route_restarts_on_its_own_device(monkeypatch, inner):
    """A route suspended by a nested block (a capture, ``disable()``, another region) restarts
    after it; PyTorch's ``use_mem_pool`` routes the current device's allocations. A nested
    block on another device (``with torch.cuda.device(1): with cuda_graph(...)``) must not move
    the enclosing region's route there: the region's tensors made on its device after the
    block would come from the default pool (not pauseable in torch mode), and the other
    device's would come from the region's pool (one of another device's key)."""

    torch, impl = _captures_routing_over(monkeypatch)
    region_pool = object()
    seen = []
    with impl._routed(torch, region_pool, torch.new_pool):
        torch.device = 1  # with torch.cuda.device(1):
        if inner == "cuda_graph":
            block = impl.cuda_graph("G", tag="graph")
        elif inner == "disable":
            block = impl.disable()
        else:
            block = impl._routed(torch, object(), torch.new_pool)
        with block:
            pass
        seen.append(dict(torch.devices))  # still on device 1
        torch.device = 0  # the device block's end
        seen.append(dict(torch.devices))
    assert seen == [{id(region_pool): 0}] * 2, seen
    assert not torch.recording and not regions._routing.active


@pytest.mark.parametrize("block", ["region", "disable"])
def test_a_block_left_unexited_and_collected_inside_a_routing_step_ends_there(monkeypatch, block):
    """A region (or disable()) entered and dropped without its exit, in a reference cycle, is
    ended by a garbage collection, which may come at any bytecode, so inside a step of
    ``_routing`` that holds its lock: the block's end takes that lock again, in the same
    thread. With a plain lock that thread hung for ever. The collection is made inside the
    lock here; the block's end must then have run whole."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    ended, errors = threading.Event(), []

    def body():
        try:
            cm = impl.region("left") if block == "region" else impl.disable()
            cm.__enter__()
            assert len(torch.recording) == 1 and routing.active == 1
            loop = [cm]
            loop.append(loop)
            del cm, loop
            with routing.lock:  # a step of the package's, where a collection may come
                assert gc.collect() > 0
            ended.set()
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    t = threading.Thread(target=body, daemon=True)  # hung, it must not keep pytest from ending
    t.start()
    t.join(timeout=10)
    assert ended.is_set(), f"the block's end hung inside the routing lock (errors: {errors})"
    assert not errors, errors
    assert not torch.recording, "the route of the collected block still routes"
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


def test_a_region_whose_flags_fail_leaves_no_pool_to_end_under_another_route(monkeypatch):
    """A region whose flags fail (the library refuses them) must hold no pool when it raises:
    where the map dropped that pool meanwhile and ``collect`` let the map's reference go (no
    thread routed then), the region's own reference would be the last, and its end would come
    with the error, while thread B routes (PyTorch asserts, ending the process)."""
    torch = FakeTorch()
    destroyed_while_routing = _pools_telling_their_end(torch)
    torch.cuda.current_device = staticmethod(lambda: 0)
    b_inside, b_may_leave = threading.Event(), threading.Event()
    errors, refuse = [], []

    @contextlib.contextmanager
    def flags(lib, enabled, tag, *rest):
        if refuse and tag == "kv":
            impl._mem_pools.clear()  # another thread drops the pool; no one routes: it is let go
            b.start()
            assert b_inside.wait(timeout=10)
            raise RuntimeError("the library refused the region's flags")
        yield

    impl = _impl_over(monkeypatch, torch, "torch", flags)
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())
    b = _thread_in_region(impl, "other", b_inside, b_may_leave, errors)
    with impl.region("kv"):  # the pool is made, and kept in the map
        pass
    refuse.append(True)
    with pytest.raises(RuntimeError, match="refused the region's flags"):
        with impl.region("kv"):
            pass
    b_may_leave.set()
    b.join()
    assert not errors, errors
    assert not destroyed_while_routing, "a dropped region pool was destroyed while another thread routed"


@pytest.mark.parametrize("block", ["region", "disable", "cuda_graph"])
def test_a_block_collected_in_another_thread_undoes_only_its_own_enter(monkeypatch, block):
    """A region (or disable(), or a capture) entered in thread A inside a generator that is
    never finished, in a reference cycle, is ended by a garbage collection in whatever thread
    makes it: here thread B, inside a route of its own. The block's end must undo what its enter
    did, on A's route stack: end its own route, and leave B's stack and routing alone. Before,
    it popped B's route off B's stack and restarted A's enclosing route in B (routing B's
    allocations to A's pool), and B's own end then found B's stack empty."""
    torch, impl = _captures_routing_over(monkeypatch)
    routing = regions._Routing()
    monkeypatch.setattr(regions, "_routing", routing)
    a_pool, b_pool = object(), object()
    left, collected = threading.Event(), threading.Event()
    seen, errors = {}, []

    def enter_and_leave_unfinished():
        with impl.region("left") if block == "region" else (
            impl.disable() if block == "disable" else impl.cuda_graph("G", tag="graph")
        ):
            yield

    def a():
        try:
            with impl._routed(torch, a_pool, torch.new_pool):  # A's enclosing route
                gen = enter_and_leave_unfinished()
                next(gen)
                loop = [gen]
                loop.append(loop)
                del gen, loop
                left.set()
                assert collected.wait(timeout=10)
                seen["a_stack"] = len(regions._route_stack(impl._local))
        except Exception as e:  # collected: a failure fails the test
            errors.append(f"A: {e!r}")

    def b():
        try:
            with impl._routed(torch, b_pool, torch.new_pool):
                assert left.wait(timeout=10)
                assert gc.collect() > 0  # ends A's block, here in B
                with torch.lock:
                    seen["recording"] = dict(torch.recording)
                seen["b_stack"] = len(regions._route_stack(impl._local))
                collected.set()
        except Exception as e:  # collected: a failure fails the test
            errors.append(f"B: {e!r}")
        finally:
            collected.set()

    gc.disable()  # the collection is B's, not one that happens to come in A
    try:
        ta, tb = threading.Thread(target=a), threading.Thread(target=b)
        ta.start()
        tb.start()
        ta.join(timeout=20)
        tb.join(timeout=20)
    finally:
        gc.enable()
    assert not errors, errors
    b_ident = tb.ident
    assert seen["recording"] == {id(b_pool): b_ident}, "B's routing changed, or A's block routes"
    assert (seen["a_stack"], seen["b_stack"]) == (1, 1), seen
    assert not torch.recording
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


def test_a_block_collected_under_a_later_block_of_its_thread_leaves_the_stack_whole(monkeypatch):
    """A region left unexited (a generator never finished) and ended by a garbage collection
    inside a later block of the same thread: it was suspended under that block, so its end
    restarts nothing and takes only its own entry off the stack; the later block's end then
    restarts the route below the ended region. Before, the region's end popped the later
    block's entry and restarted the enclosing route beside the later one's."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    outer, later = object(), object()
    me = threading.get_ident()

    gc.disable()  # the collection is the test's own
    try:
        with impl._routed(torch, outer, torch.new_pool):
            _leave_unfinished_in_a_cycle(lambda: impl.region("left"))
            with impl._routed(torch, later, torch.new_pool):
                assert gc.collect() > 0  # ends the region, under the later route
                assert torch.recording == {id(later): me}
                assert len(regions._route_stack(impl._local)) == 2
            assert torch.recording == {id(outer): me}, "not the route below the region"
        assert not torch.recording and not regions._route_stack(impl._local)
    finally:
        gc.enable()
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


def test_disable_blocks_under_another_threads_region_reuse_their_retired_pools(monkeypatch):
    """A ``disable()`` block's pool is retired on exit, and destroyed only once no route or
    capture is under way anywhere (``_Routing``). While one thread keeps a region open (a
    serving thread), every ``disable()`` block another thread ran kept a pool of its own, with
    its cached device memory, till the region's end: growth without bound. A block now takes
    a retired pool of an earlier ``disable()`` block of its device instead of making one, so
    the retired pools are at most as many as blocks open at once, and all go once nothing is
    under way. Never a region's pool, a pool of another device, nor the kept pool of
    ``dispose_mem_pool_after_use=False``, and never one destroyed under a route."""
    import weakref

    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "torch")
    routing = _own_routing(monkeypatch, torch)
    destroyed_while_routing = _pools_telling_their_end(torch)
    Pool = torch.cuda.MemPool
    made = []

    def tracked():
        p = Pool()
        made.append(weakref.ref(p))
        return p

    torch.cuda.MemPool = staticmethod(tracked)
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())
    inside, may_leave, errors = threading.Event(), threading.Event(), []
    a = _thread_in_region(impl, "serving", inside, may_leave, errors)
    a.start()
    try:
        assert inside.wait(timeout=10)
        region_pool = made[0]()
        me = threading.get_ident()

        def routed_to():
            with torch.lock:
                return next(p for p, t in torch.recording.items() if t == me)

        served = set()
        for _ in range(100):
            with impl.disable():
                served.add(routed_to())
        assert len(served) == 1 and len(made) == 2, (len(served), len(made))
        assert len(routing.retired) <= 1, f"{len(routing.retired)} retired pools after 100 blocks"
        with impl.disable():  # blocks open at once: one pool each
            outer = routed_to()
            with impl.disable():
                assert routed_to() != outer
        assert len(made) == 3 and len(routing.retired) == 2, (len(made), len(routing.retired))
        with impl.disable(dispose_mem_pool_after_use=False):
            kept = routed_to()
        with impl.disable():
            assert routed_to() not in (kept, id(region_pool)), "a kept or region pool was taken"
        torch.device = 1  # with torch.cuda.device(1): a pool of device 0 would not do
        with impl.disable():
            assert torch.devices[routed_to()] == 1
            on_one = routed_to()
        assert len(made) == 5, len(made)  # device 1's own
        with impl.disable():
            assert routed_to() == on_one
        torch.device = 0
    finally:
        may_leave.set()
        a.join()
    assert not errors, errors
    gc.collect()
    alive = [r() for r in made if r() is not None]
    assert alive == [region_pool, impl._kept_disable_pools[0]], alive
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})
    assert not destroyed_while_routing


def test_a_disable_pool_a_graph_allocated_from_is_never_reused(monkeypatch):
    """A ``disable()`` block inside a graph capture routes the capture's allocations to its
    pool, whose blocks the graph replays into while it lives: a later block taking that pool
    would hand them to eager tensors. Nor does a block in a capture take an eager block's pool:
    both make a pool of their own, as before."""
    torch = FakeTorch()
    capturing = []

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        capturing.append(True)
        try:
            yield
        finally:
            capturing.pop()

    torch.cuda.graph = staticmethod(graph)
    torch.cuda.is_current_stream_capturing = staticmethod(lambda: bool(capturing))
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    me = threading.get_ident()

    def routed_to():
        with torch.lock:
            return next(p for p, t in torch.recording.items() if t == me)

    inside, may_leave, errors = threading.Event(), threading.Event(), []
    a = _thread_in_region(impl, "serving", inside, may_leave, errors)
    a.start()
    try:
        assert inside.wait(timeout=10)
        with impl.disable():
            eager = routed_to()
        with impl.cuda_graph("G", tag="graph"):
            with impl.disable():
                captured = routed_to()
        with impl.disable():
            after = routed_to()
            with impl.disable():  # the eager pool is taken: the graph's would be next
                nested = routed_to()
    finally:
        may_leave.set()
        a.join()
    assert not errors, errors
    assert captured != eager, "a block in a capture took an eager block's pool"
    assert after == eager, "not the eager block's pool taken first"
    assert nested not in (eager, captured), "the pool a graph allocated from was reused"
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


def test_a_disable_pool_whose_route_failed_to_end_is_not_reused(monkeypatch):
    """Where PyTorch raised ending a ``disable()`` block's route, the pool's state is unknown
    (it may still be routed to): the error reaches the caller, and the next block makes a pool
    of its own rather than take that one."""
    torch = FakeTorch()
    real_use = torch.cuda.use_mem_pool
    fail = []

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        with real_use(pool, device):
            yield
        if fail:
            fail.clear()
            raise RuntimeError("endAllocateToPool failed")

    torch.cuda.use_mem_pool = staticmethod(use_mem_pool)
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    inside, may_leave, errors = threading.Event(), threading.Event(), []
    a = _thread_in_region(impl, "serving", inside, may_leave, errors)
    a.start()
    try:
        assert inside.wait(timeout=10)
        with pytest.raises(RuntimeError, match="endAllocateToPool failed"):
            with impl.disable():
                failed = [p for p, t in torch.recording.items() if t == threading.get_ident()][0]
                fail.append(True)
        with impl.disable():
            assert failed not in torch.recording, "the pool whose route failed to end was reused"
    finally:
        may_leave.set()
        a.join()
    assert not errors, errors
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


@pytest.mark.parametrize("where", ["same thread", "another thread"])
def test_a_block_collected_while_the_block_above_it_ends_leaves_the_right_route(monkeypatch, where):
    """A region left unexited (a generator never finished) under a later block of its thread,
    ended by a garbage collection that comes while the later block ends, after that block took
    its entry off the stack and before it restarted the entry below (here: inside the later
    route's ``use_mem_pool`` exit). The later block must then restart what is on top of the
    stack now, the route below the ended region, once. Before, it restarted the ended region's
    route, whose pool was already retired (PyTorch raises for a None pool; the fake routes to
    it), beside the enclosing route the collection had restarted in this thread, or left the
    enclosing route suspended where the collection came in another thread."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    outer, later = object(), object()
    me = threading.get_ident()
    use_mem_pool = torch.cuda.use_mem_pool
    collect_at_end = []

    def collect():
        if where == "same thread":
            assert gc.collect() > 0
            return
        done = []
        t = threading.Thread(target=lambda: done.append(gc.collect()))
        t.start()
        t.join(timeout=10)
        assert done and done[0] > 0

    @contextlib.contextmanager
    def collecting_use_mem_pool(pool, device=None):
        with use_mem_pool(pool, device):
            yield
        if pool is later and collect_at_end:
            collect_at_end.clear()
            collect()

    torch.cuda.use_mem_pool = staticmethod(collecting_use_mem_pool)

    gc.disable()  # the collection is the test's own
    try:
        with impl._routed(torch, outer, torch.new_pool):
            _leave_unfinished_in_a_cycle(lambda: impl.region("left"))
            with impl._routed(torch, later, torch.new_pool):
                collect_at_end.append(True)
            assert not collect_at_end, "the collection did not come"
            assert torch.recording == {id(outer): me}, "not the route below the region alone"
            assert len(regions._route_stack(impl._local)) == 1
        assert not torch.recording and not regions._route_stack(impl._local)
    finally:
        gc.enable()
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


def test_a_block_collected_while_a_block_entered_above_it_suspends_it_leaves_one_route(monkeypatch):
    """A region left unexited (a generator never finished), ended by a garbage collection that
    comes while a later block of its thread suspends its route on entering (here: inside that
    route's ``use_mem_pool`` exit). The collection restarts the route below the region; the
    later block must suspend that one too, so that its own route alone serves inside it.
    Before, it suspended only the region's route, and the enclosing route, routed to first,
    took the later block's allocations (PyTorch serves from the first pool routed to)."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    outer, later = object(), object()
    me = threading.get_ident()
    use_mem_pool = torch.cuda.use_mem_pool
    collect_at_end = []

    @contextlib.contextmanager
    def collecting_use_mem_pool(pool, device=None):
        with use_mem_pool(pool, device):
            yield
        if collect_at_end:
            collect_at_end.clear()
            assert gc.collect() > 0

    torch.cuda.use_mem_pool = staticmethod(collecting_use_mem_pool)

    gc.disable()  # the collection is the test's own
    try:
        with impl._routed(torch, outer, torch.new_pool):
            _leave_unfinished_in_a_cycle(lambda: impl.region("left"))
            collect_at_end.append(True)  # at the region route's suspension
            with impl._routed(torch, later, torch.new_pool):
                assert not collect_at_end, "the collection did not come"
                assert torch.recording == {id(later): me}, "not the later block's route alone"
            assert torch.recording == {id(outer): me}
            assert len(regions._route_stack(impl._local)) == 1
        assert not torch.recording and not regions._route_stack(impl._local)
    finally:
        gc.enable()
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


def test_a_block_collected_in_another_thread_while_its_thread_restarts_it_stays_ended(monkeypatch):
    """Thread A ends a later block and restarts the route below it: a disable() block left
    unexited (a generator never finished). A garbage collection in thread B ends that block
    meanwhile, after A read it off its stack and before A's start routes (here: while A asks
    whether its stream captures). A must not start the ended block's route: its pool is retired
    by then (PyTorch raises for a None pool; the fake routes to it, and the count of routes
    never comes back to 0, so no retired pool is destroyed again), or about to be, and then
    taken by a later disable() block while A routes to it. A restarts what is below it instead."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    outer, later = object(), object()
    me = threading.get_ident()
    collect_when_asked = []

    def is_current_stream_capturing():
        # Not in collect(), under the routing lock: at the restart's own question.
        if collect_when_asked and threading.get_ident() == me and not routing.lock._is_owned():
            collect_when_asked.clear()
            done = []
            t = threading.Thread(target=lambda: done.append(gc.collect()))
            t.start()
            t.join(timeout=10)
            assert done and done[0] > 0
        return False

    torch.cuda.is_current_stream_capturing = staticmethod(is_current_stream_capturing)

    gc.disable()  # the collection is the test's own
    try:
        with impl._routed(torch, outer, torch.new_pool):
            _leave_unfinished_in_a_cycle(impl.disable)  # whose route asks at its start
            with impl._routed(torch, later, torch.new_pool):
                pass
            # The block is on top again, suspended; the next restart asks first.
            with impl._routed(torch, later, torch.new_pool):
                collect_when_asked.append(True)
            assert not collect_when_asked, "the collection did not come"
            assert torch.recording == {id(outer): me}, "not the route below the block alone"
            assert len(regions._route_stack(impl._local)) == 1
        assert not torch.recording and not regions._route_stack(impl._local)
    finally:
        gc.enable()
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})
